// Must not compile: a negative fixed shard size.
#include <fsdpx/policies/mesh.hpp>

int main() { return fsdpx::HybridShard<-4>::shard_size; }
