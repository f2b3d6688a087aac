// Must not compile: a sequence-parallel mesh over a model that cannot run on slices of sequences.
#include <fsdpx/fsdp.hpp>

struct PlainImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x; }
};
TORCH_MODULE(Plain);

int main() { return sizeof(fsdpx::Fsdp<Plain, fsdpx::SequenceParallel<2>>); }
