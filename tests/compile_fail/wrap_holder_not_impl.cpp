// Must not compile: WrapModules names the holder (Net) instead of the implementation (NetImpl).
#include "net.hpp"

int main() {
  using Bad = fsdpx::Fsdp<fsdpx::test::Net, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                          fsdpx::ShardedStateDict, fsdpx::WrapModules<fsdpx::test::Net>>;
  return sizeof(Bad) > 0 ? 0 : 1;
}
