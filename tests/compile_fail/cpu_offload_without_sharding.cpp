// Must not compile: CpuOffload with NoShard (tests/CMakeLists.txt checks the message).
#include <fsdpx/fsdp.hpp>

#include "../../examples/common/gpt.hpp"

int main() {
  using Bad = fsdpx::Fsdp<fsdpx::examples::Gpt, fsdpx::NoShard, fsdpx::CpuOffload<>>;
  return sizeof(Bad) > 0 ? 0 : 1;
}
