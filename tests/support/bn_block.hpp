// A residual block with BatchNorm, shared by the suites that need a unit holding buffers (running
// statistics and an int64 batch counter) beside its parameters: the protocol's buffer sync, and the
// checkpoints' buffers round trip.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace fsdpx::test {

/// relu(bn(fc(x))) + x.
struct BnBlockImpl : torch::nn::Module {
  explicit BnBlockImpl(int64_t dim) {
    // No bias before the BatchNorm (as conv-BN blocks do): its gradient is analytically zero, and
    // Adam would turn the rounding noise left in it into steps that differ between any two runs.
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm1d(dim));
  }
  at::Tensor forward(const at::Tensor& x) { return torch::relu(bn(fc(x))) + x; }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnBlock);

}  // namespace fsdpx::test
