// The second translation unit of tests/support/header_only_a.cpp's program.
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

int header_only_b() { return static_cast<int>(fsdpx::core::PassStage::idle); }
