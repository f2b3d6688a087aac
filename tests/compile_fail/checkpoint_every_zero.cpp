// Must not compile: CheckpointEvery<0> (tests/CMakeLists.txt checks the message).
#include <fsdpx/policies/checkpoint.hpp>

int main() { return fsdpx::CheckpointEvery<0>::checkpoints({}) ? 0 : 1; }
