// Out-of-line functions of fsdpx/checkpoint/extra_state.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/extra_state.hpp>

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
  out.client = f.get("client").toGenericDict();
  if (f.has("scheduler")) out.scheduler = f.get("scheduler");
  if (restore_rng) {
    const detail::Fields rng(f.get("rng"), path, "'rng'");
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    cpu.set_state(rng.get("cpu").toTensor());
    if (rng.has("cuda") && at::hasCUDA()) {
      at::Generator cuda = at::globalContext().defaultGenerator(at::Device(at::kCUDA));
      cuda.set_state(rng.get("cuda").toTensor());
    }
  }
  return out;
}

}  // namespace fsdpx::checkpoint
