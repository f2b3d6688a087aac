// Out-of-line functions of fsdpx/checkpoint/extra_state.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/extra_state.hpp>

#include <utility>
#include <vector>

namespace fsdpx::checkpoint {

FSDPX_DECL c10::IValue extra_state_to_ivalue(const ExtraState& extra, int world_size, int rank) {
  auto d = detail::new_dict();
  d.insert("format", std::string(format_name));
  d.insert("format_version", int64_t{format_version});
  d.insert("component", std::string("extra_state"));
  d.insert("world_size", int64_t{world_size});
  d.insert("rank", int64_t{rank});
  d.insert("step", extra.step);
  auto rng = detail::new_dict();
  rng.insert("cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (at::hasCUDA()) rng.insert("cuda", at::globalContext().defaultGenerator(at::Device(at::kCUDA)).get_state());
  d.insert("rng", rng);
  d.insert("client", extra.client);
  if (!extra.scheduler.isNone()) d.insert("scheduler", extra.scheduler);
  return d;
}

FSDPX_DECL ExtraState extra_state_from_ivalue(const c10::IValue& v, const fs::path& path, bool restore_rng) {
  const detail::Fields f(v, path, "the file");
  FSDPX_CHECK_AS(IoError, f.text("format") == format_name && f.text("component") == "extra_state", "'", path.string(),
                 "' is not an fsdpx extra_state file");
  ExtraState out;
  out.step = f.integer("step");
  out.client = f.dictionary("client");
  if (f.has("scheduler")) out.scheduler = f.get("scheduler");
  // Each generator state is checked as this build's generators keep one before any is set, so a crafted file
  // is refused whole, naming the file, and never leaves the generators half restored.
  const detail::Fields rng(f.get("rng"), path, "'rng'");
  std::vector<std::pair<at::Generator, at::Tensor>> states;
  const auto check = [&](at::Generator generator, const char* key) {
    const c10::IValue& saved = rng.get(key);
    const at::Tensor now = generator.get_state();
    FSDPX_CHECK_AS(IoError,
                   saved.isTensor() && saved.toTensor().scalar_type() == now.scalar_type() &&
                       saved.toTensor().sizes() == now.sizes(),
                   "'", path.string(), "': rng.", key, " is not a generator state of this build's (", now.numel(),
                   " bytes)");
    states.emplace_back(std::move(generator), saved.toTensor());
  };
  check(at::detail::getDefaultCPUGenerator(), "cpu");
  if (rng.has("cuda") && at::hasCUDA()) check(at::globalContext().defaultGenerator(at::Device(at::kCUDA)), "cuda");
  if (restore_rng) {
    for (auto& [generator, state] : states) {
      try {
        generator.set_state(state);
      } catch (const c10::Error& e) {
        FSDPX_FAIL(IoError, "'", path.string(),
                   "' holds a generator state this build refuses: ", e.what_without_backtrace());
      }
    }
  }
  return out;
}

}  // namespace fsdpx::checkpoint
