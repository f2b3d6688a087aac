// collective_demo: the communication pattern of sharded data-parallel training, written out by hand
// with fsdpx's communicators and device mesh (the FSDP core automates exactly this).
//
// Each rank keeps 1/shard of a linear model's weights. Every step it all-gathers the full weights,
// computes the gradient on its slice of the global batch, reduce-scatters (averages) the gradient
// back into shards (plus an all-reduce across replicas on a hybrid mesh) and updates its shard.
// Every process also trains an unsharded replica on the whole batch; both must end up equal, up to
// the float32 rounding of summing in another order.
//
//   mpiexec -n 4 collective_demo [shard_size]      (default: shard over all ranks)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <ATen/ATen.h>
#include <fsdpx/fsdp.hpp>

using fsdpx::dist::DeviceMesh;
using fsdpx::dist::MpiCommunicator;
using fsdpx::dist::ReduceOp;

int main(int argc, char** argv) try {
  auto world = MpiCommunicator::world();
  const int shard_size = argc > 1 ? std::atoi(argv[1]) : world.size();
  auto mesh = DeviceMesh<MpiCommunicator>::build(world, shard_size);
  const int W = world.size(), r = world.rank(), S = mesh.shard_size();

  // Same data and initial weights on every rank (same seed); the batch is split by world rank.
  const int64_t in = 512, out = 256, batch = 120, steps = 10;
  const float lr = 0.5f;
  at::manual_seed(0);
  const auto x = at::randn({batch, in});
  const auto y = x.matmul(at::randn({out, in}).t() * 0.05) + 0.01 * at::randn({batch, out});
  const auto w0 = at::randn({out, in}) * 0.02;
  const int64_t numel = w0.numel(), chunk = (numel + S - 1) / S;  // pad so every shard is equal

  auto padded = at::zeros({chunk * S});
  padded.narrow(0, 0, numel).copy_(w0.flatten());
  auto shard = padded.narrow(0, mesh.shard_group().rank() * chunk, chunk).clone();
  auto replica = w0.clone();

  const auto grad_of = [&](const at::Tensor& w, const at::Tensor& xs, const at::Tensor& ys) {
    const auto err = xs.matmul(w.t()) - ys;  // d/dw mean((xw - y)^2)
    return std::pair{err.pow(2).mean(), err.t().matmul(xs) * (2.0 / static_cast<double>(err.numel()))};
  };
  const auto rows = at::arange(r * batch / W, (r + 1) * batch / W);
  const auto x_local = x.index_select(0, rows), y_local = y.index_select(0, rows);

  if (r == 0) {
    std::printf("collective_demo: %d ranks, mesh %d (replicate) x %d (shard), %lld parameters, %lld per shard\n", W,
                mesh.replicate_size(), S, static_cast<long long>(numel), static_cast<long long>(chunk));
  }
  // The rounding bound of the weights' difference (2-norm). Each gradient element sums `in` products
  // per row and then the rows, on each rank and over the ranks: in another order than the replica's,
  // about sqrt(in) float32 roundings of the gradient's scale apart (6 standard deviations of independent
  // roundings; tests/support/rounding.hpp derives it). Gradient descent on this least-squares loss, at an
  // lr under 2 / its largest curvature (the loss falls), never amplifies a difference in the weights:
  // per step the difference grows by at most lr x the gradients' difference, plus both updates' rounding.
  const double u = 0x1p-24, per_element = 6 * u * std::sqrt(2.0 * 3 * static_cast<double>(in) / 3);
  double bound = 0;
  auto full = at::empty({chunk * S});
  auto grad_full = at::zeros({chunk * S});
  auto grad_shard = at::empty({chunk});
  for (int64_t step = 1; step <= steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    mesh.shard_group().all_gather(full, shard);
    const auto [loss, grad] = grad_of(full.narrow(0, 0, numel).view({out, in}), x_local, y_local);
    grad_full.narrow(0, 0, numel).copy_(grad.flatten());
    auto reduce = mesh.shard_group().reduce_scatter_async(grad_shard, grad_full, ReduceOp::avg);
    auto global_loss = loss.reshape({1}).clone();
    auto loss_work = world.all_reduce_async(global_loss, ReduceOp::avg);  // overlaps the reduce-scatter
    reduce.wait_stream();  // the update below runs after the reduction (in stream order on a GPU)
    if (mesh.replicate_size() > 1) mesh.replicate_group().all_reduce(grad_shard, ReduceOp::avg);
    shard.sub_(grad_shard, lr);
    loss_work.wait_host();  // the host reads the loss
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

    const at::Tensor replica_grad = grad_of(replica, x, y).second;  // the unsharded reference, whole batch
    bound += lr * per_element * replica_grad.abs().max().item<double>() * std::sqrt(static_cast<double>(numel)) +
             2 * u * replica.norm().item<double>();
    replica.sub_(replica_grad, lr);
    if (r == 0)
      std::printf("step %2lld  loss %.6f  %.2f ms\n", static_cast<long long>(step), global_loss.item<float>(), ms);
  }

  mesh.shard_group().all_gather(full, shard);
  const double diff = (full.narrow(0, 0, numel).view({out, in}) - replica).norm().item<double>();
  auto worst = at::full({1}, diff, at::kDouble);
  world.all_reduce(worst, ReduceOp::max);
  if (r == 0)
    std::printf("|sharded - unsharded| over all ranks: %.3g (rounding bound %.3g)\n", worst.item<double>(), bound);
  if (worst.item<double>() > bound) {
    if (r == 0) std::fprintf(stderr, "collective_demo: sharded training diverged from the unsharded replica\n");
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "collective_demo: %s\n", e.what());
  return 1;
}
