// The smallest LibTorch module holder, for the compile-fail checks: what they test is the Fsdp type's
// policies, and a model that costs nothing to compile keeps each check cheap.
#pragma once

#include <fsdpx/core/fsdp.hpp>

namespace fsdpx::test {
struct NetImpl : torch::nn::Module {};
TORCH_MODULE(Net);
}  // namespace fsdpx::test
