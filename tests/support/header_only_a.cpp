// Two translation units of one program, both including every fsdpx header in the default
// (header-only) mode: a function defined in a header or an .ipp without `inline` (FSDPX_DECL) is
// defined twice and fails to link. The rest of the suite compiles fsdpx once (fsdpx::separate).
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

int header_only_b();

int main() { return header_only_b() == static_cast<int>(fsdpx::core::PassStage::idle) ? 0 : 1; }
