// Must not compile: CpuOffload with NoShard (tests/CMakeLists.txt checks the message).
#include "net.hpp"

int main() {
  using Bad = fsdpx::Fsdp<fsdpx::test::Net, fsdpx::NoShard, fsdpx::CpuOffload<>>;
  return sizeof(Bad) > 0 ? 0 : 1;
}
