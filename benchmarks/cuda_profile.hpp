// FSDPX_PROFILE=DIR: one training step under PyTorch's Kineto profiler (host and CUDA activity), its
// Chrome trace written to DIR/NAME.json; benchmarks/trace_summary.py summarises the traces of every
// contender the same way (GPU busy and idle time, kernel families, the longest kernels). PyTorch's side
// writes the same traces (benchmarks/cuda_profile.py), so the two steps are read by one reader.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

#include <ATen/Context.h>
#include <torch/csrc/autograd/profiler_kineto.h>

namespace fsdpx::bench {

/// A trace's file name: the contender's, and its rank where there are several.
inline std::string trace_name(const std::string& contender, int rank, int world_size) {
  return world_size > 1 ? contender + "-rank" + std::to_string(rank) : contender;
}

/// Runs `step` (which synchronizes the device at its end) once under the profiler when FSDPX_PROFILE
/// names a folder; does nothing otherwise.
template <class Step>
void profile_step(const std::string& name, const Step& step) {
  const char* dir = std::getenv("FSDPX_PROFILE");
  if (dir == nullptr || *dir == '\0') return;
  namespace profiler = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (at::hasCUDA()) activities.insert(ActivityType::CUDA);
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  step();
  const auto result = profiler::disableProfiler();
  std::filesystem::create_directories(dir);
  result->save((std::filesystem::path(dir) / (name + ".json")).string());
}

}  // namespace fsdpx::bench
