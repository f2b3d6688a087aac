// Two translation units of one program, both including every umbrella header in the default
// (header-only) mode: a function defined in a header or an .ipp without `inline` (FSDPX_DECL) is
// defined twice and fails to link. The rest of the suite compiles fsdpx once (fsdpx::separate).
// Compiled as a user's build would, optimized, with -Wall -Wextra -Werror: fsdpx's headers must not
// warn in users' builds (tests/CMakeLists.txt).
#include <fsdpx/dcp.hpp>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

int header_only_b(const char* config);

int main(int argc, char** argv) {
  return header_only_b(argc > 1 ? argv[1] : nullptr) == static_cast<int>(fsdpx::core::PassStage::idle) ? 0 : 1;
}
