// Timing shared by the multi-rank benchmarks.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/dist/types.hpp>

namespace fsdpx::bench {

inline double median(std::vector<double> samples) {
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

/// Seconds of one call, the slowest rank's (collective over `world`, on its device: a GPU
/// communicator reduces device tensors, the current device's). `fn` synchronizes what it times.
template <class Comm>
double time_once(Comm& world, const std::function<void()>& fn) {
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  auto dt = at::full({1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), at::kDouble)
                .to(c10::Device(world.device_type()));
  world.all_reduce(dt, dist::ReduceOp::max);
  return dt.item<double>();
}

/// Median seconds per call over `iters` timed calls (after one warm-up call: first-touch pages,
/// connection set-up), taking the slowest rank for each.
template <class Comm>
double time_collective(Comm& world, int iters, const std::function<void()>& fn) {
  fn();
  std::vector<double> samples;
  for (int i = 0; i < iters; ++i) samples.push_back(time_once(world, fn));
  return median(std::move(samples));
}

/// Two operations timed alternately (a, b, a, b, ...; one warm-up each), so that both see the same
/// machine: a shared VM's speed drifts over seconds. Per-iteration seconds of each.
template <class Comm>
std::pair<std::vector<double>, std::vector<double>> time_side_by_side(Comm& world, int iters,
                                                                      const std::function<void()>& a,
                                                                      const std::function<void()>& b) {
  a();
  b();
  std::pair<std::vector<double>, std::vector<double>> out;
  for (int i = 0; i < iters; ++i) {
    out.first.push_back(time_once(world, a));
    out.second.push_back(time_once(world, b));
  }
  return out;
}

}  // namespace fsdpx::bench
