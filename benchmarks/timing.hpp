// Timing shared by the multi-rank benchmarks.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/dist/types.hpp>

namespace fsdpx::bench {

/// Median seconds per call over `iters` timed calls (after one warm-up call: first-touch pages,
/// connection set-up), taking the slowest rank for each.
template <class Comm>
double time_collective(Comm& world, int iters, const std::function<void()>& fn) {
  fn();
  std::vector<double> samples;
  for (int i = 0; i < iters; ++i) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    auto dt = at::full({1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), at::kDouble);
    world.all_reduce(dt, dist::ReduceOp::max);
    samples.push_back(dt.item<double>());
  }
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

}  // namespace fsdpx::bench
