// fsdpx's Conan test_package: a small model sharded with Fsdp<Net, FullShard> over MPI trains for a
// few SGD steps; the loss must stay finite and fall. Runs at any world size (1 as a singleton).
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/sgd.h>

#include <fsdpx/fsdp.hpp>

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 32))), fc2(register_module("fc2", torch::nn::Linear(32, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int main() {
  auto world = fsdpx::dist::MpiCommunicator::world();
  at::manual_seed(0);  // every rank builds the same model
  fsdpx::Fsdp<Net, fsdpx::FullShard> model(Net(), world);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));

  at::manual_seed(1 + world.rank());  // each rank its own batch
  const auto x = at::randn({64, 8});
  const auto y = x.sum(1, /*keepdim=*/true);
  double first = 0, last = 0;
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    auto loss = at::mse_loss(model(x), y);
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    if (!std::isfinite(last)) {
      std::fprintf(stderr, "fsdpx test_package: rank %d: loss is %f at step %d\n", world.rank(), last, step);
      return 1;
    }
  }
  if (!(last < first)) {
    std::fprintf(stderr, "fsdpx test_package: rank %d: loss did not fall (%f -> %f)\n", world.rank(), first, last);
    return 1;
  }
  std::printf("fsdpx test_package: fsdpx %s, Fsdp<Net, FullShard>, rank %d of %d: loss %.4f -> %.4f\n", fsdpx::version,
              world.rank(), world.size(), first, last);
  return 0;
}
