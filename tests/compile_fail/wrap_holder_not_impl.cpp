// Must not compile: WrapModules names the holder (Block) instead of the implementation (BlockImpl).
#include <fsdpx/fsdp.hpp>

#include "../../examples/common/gpt.hpp"

int main() {
  using Bad = fsdpx::Fsdp<fsdpx::examples::Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                          fsdpx::ShardedStateDict, fsdpx::WrapModules<fsdpx::examples::Block>>;
  return sizeof(Bad) > 0 ? 0 : 1;
}
