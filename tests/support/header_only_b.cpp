// The second translation unit of tests/support/header_only_a.cpp's program.
#include <fsdpx/dcp.hpp>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

// With a config.json's path (never, in the test), parses it: the parser's code is then generated, so
// the optimizer's warnings (-Wmaybe-uninitialized) about it are seen.
int header_only_b(const char* config) {
  if (config != nullptr) return static_cast<int>(fsdpx::models::read_decoder_config(config).num_hidden_layers);
  return static_cast<int>(fsdpx::core::PassStage::idle);
}
