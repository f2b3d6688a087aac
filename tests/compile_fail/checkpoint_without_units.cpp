// Must not compile: activation checkpointing with NoWrap, which makes no unit to recompute
// (tests/CMakeLists.txt checks the message).
#include "net.hpp"

int main() {
  using Bad = fsdpx::Fsdp<fsdpx::test::Net, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                          fsdpx::ShardedStateDict, fsdpx::NoWrap, fsdpx::CheckpointAll>;
  return sizeof(Bad) > 0 ? 0 : 1;
}
