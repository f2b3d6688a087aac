// Built against the installed package: include the umbrella header, all-reduce across ranks.
#include <cstdio>

#include <ATen/ATen.h>
#include <fsdpx/fsdp.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)  // find_package(fsdpx COMPONENTS sync_service), fsdpx::sync_service
#include <fsdpx/sync/service.hpp>
#endif

#include "all_reduce_check.hpp"

int main() {
  auto world = fsdpx::dist::MpiCommunicator::world();
  if (!all_reduce_sums(world)) return 1;
  // Out-of-line parts: compiled in this translation unit (header-only), or once in the library that
  // fsdpx_add_separate_library / fsdpx::separate makes (the consumer_separate program).
  if (fsdpx::checkpoint::find_latest_checkpoint("/nonexistent/fsdpx-consumer").has_value()) {
    std::fprintf(stderr, "consumer: a checkpoint was found where there is none\n");
    return 1;
  }
#if defined(FSDPX_WITH_SYNC_SERVICE)
  fsdpx::sync::SynchronizerServer server;  // 127.0.0.1, a port the system picks; stopped at the end
  if (server.port() == 0) {
    std::fprintf(stderr, "consumer: the synchronizer server has no port\n");
    return 1;
  }
#endif
#if defined(FSDPX_SEPARATE_COMPILATION)
  const char* mode = "compiled once";
#else
  const char* mode = "header-only";
#endif
  std::printf("consumer: fsdpx %s (%s), rank %d of %d: all_reduce ok\n", fsdpx::version, mode, world.rank(),
              world.size());
  return 0;
}
