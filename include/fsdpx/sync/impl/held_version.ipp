// Out-of-line functions of fsdpx/sync/detail/held_version.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/detail/held_version.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include <ATen/Parallel.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/sync/detail/delta_codec.hpp>
#include <fsdpx/sync/detail/receive.hpp>

namespace fsdpx::sync {

namespace detail {

/// The module's parameters and buffers by name, detached (aliases of their memory).
inline std::unordered_map<std::string, at::Tensor> module_tensors(torch::nn::Module& module) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) by_name.emplace(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) by_name.emplace(item.key(), item.value().detach());
  }
  return by_name;
}

FSDPX_DECL void HeldVersion::prepare(torch::nn::Module* module) {
  if (target_ != module || (module != nullptr && !still_adopted(*module))) forget();
}

FSDPX_DECL std::pair<std::vector<NamedTensor>, std::shared_ptr<const Manifest>> HeldVersion::take(
    std::vector<NamedTensor> received, std::string_view where,
    std::optional<std::chrono::steady_clock::time_point> deadline) {
  prepare(nullptr);
  try {
    store_.accept(std::move(received), VersionStore::Apply::copy_on_write, where, deadline);
  } catch (const SyncError&) {
    forget();
    throw;
  }
  return {store_.tensors(), store_.shared_manifest()};
}

FSDPX_DECL void HeldVersion::take_into(torch::nn::Module& module, std::vector<NamedTensor> received,
                                       std::string_view where,
                                       std::optional<std::chrono::steady_clock::time_point> deadline) {
  prepare(&module);
  try {
    FSDPX_CHECK_AS(SyncError, !received.empty(), "an empty version from ", where, " (no manifest)");
    // Only its kind first: accept() decodes and checks it whole either way.
    if (const auto prefix = peek_manifest(received.front().tensor); prefix && prefix->delta) {
      store_.accept(std::move(received), VersionStore::Apply::in_place, where, deadline);  // into the module's
      note_writes();
      return;
    }
    forget();
    VersionStore staged;  // checked whole, and against the module, before anything is loaded
    staged.accept(std::move(received), VersionStore::Apply::copy_on_write, where, deadline);
    check_loadable(module, staged.tensors());
    load_into(module, staged.tensors());
    adopt(module, staged.manifest());
  } catch (const SyncError&) {
    forget();
    throw;
  }
}

FSDPX_DECL void HeldVersion::loaded_into(torch::nn::Module& module, const Manifest& manifest) {
  forget();
  adopt(module, manifest);
}

FSDPX_DECL void HeldVersion::taken(const Manifest& manifest) {
  forget();
  last_manifest_ = std::make_shared<const Manifest>(manifest);
}

FSDPX_DECL void HeldVersion::forget() {
  if (!store_.empty()) last_manifest_ = store_.shared_manifest();
  store_.clear();
  target_ = nullptr;
  counters_.clear();
}

FSDPX_DECL std::shared_ptr<const Manifest> HeldVersion::last_manifest() const {
  return store_.empty() ? last_manifest_ : store_.shared_manifest();
}

FSDPX_DECL void HeldVersion::verify(torch::nn::Module& module) const {
  const auto m = last_manifest();
  FSDPX_CHECK_AS(SyncError, m != nullptr, "nothing to verify against: no version was received yet");
  ::fsdpx::sync::verify(module, *m);
}

FSDPX_DECL void HeldVersion::verify(const std::vector<NamedTensor>& tensors) const {
  const auto m = last_manifest();
  FSDPX_CHECK_AS(SyncError, m != nullptr, "nothing to verify against: no version was received yet");
  ::fsdpx::sync::verify(tensors, *m);
}

FSDPX_DECL void HeldVersion::adopt(torch::nn::Module& module, const Manifest& manifest) {
  last_manifest_ = std::make_shared<const Manifest>(manifest);
  const auto by_name = module_tensors(module);
  std::vector<NamedTensor> aliases;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // a delta must never land twice in one place
  for (const ManifestEntry& e : manifest.entries) {
    const auto it = by_name.find(e.name);
    if (it == by_name.end() || it->second.scalar_type() != e.dtype || !it->second.is_contiguous()) return;
    const auto begin = reinterpret_cast<uintptr_t>(it->second.const_data_ptr());
    spans.emplace_back(begin, begin + it->second.nbytes());
    aliases.push_back({e.name, it->second});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return;  // one tensor sent under two names (a tied one): full versions
  }
  store_.adopt(std::move(aliases), manifest);
  target_ = &module;
  note_writes();
}

FSDPX_DECL void HeldVersion::note_writes() {
  counters_.clear();
  for (const NamedTensor& held : store_.tensors()) counters_.push_back(static_cast<int64_t>(held.tensor._version()));
}

FSDPX_DECL bool HeldVersion::still_adopted(torch::nn::Module& module) const {
  if (store_.empty() || counters_.size() != store_.tensors().size()) return false;
  const auto by_name = module_tensors(module);
  for (size_t i = 0; i < store_.tensors().size(); ++i) {
    const NamedTensor& held = store_.tensors()[i];
    const auto it = by_name.find(held.name);
    if (it == by_name.end() || it->second.const_data_ptr() != held.tensor.const_data_ptr() ||
        it->second.scalar_type() != held.tensor.scalar_type() || it->second.sizes() != held.tensor.sizes() ||
        !it->second.is_contiguous() || static_cast<int64_t>(it->second._version()) != counters_[i]) {
      return false;
    }
  }
  return true;
}

FSDPX_DECL void HeldVersion::check_loadable(torch::nn::Module& module, const std::vector<NamedTensor>& tensors) {
  const auto by_name = module_tensors(module);
  std::unordered_set<const void*> filled;  // by memory: a tied parameter is filled under either name
  std::vector<std::string> problems;
  for (const NamedTensor& t : tensors) {
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      problems.push_back(::fsdpx::detail::str("'", t.name, "' is not a parameter or buffer of the module"));
    } else if (it->second.sizes() != t.tensor.sizes()) {
      problems.push_back(::fsdpx::detail::str("'", t.name, "' has shape ", it->second.sizes(), " in the module but ",
                                              t.tensor.sizes(), " was sent"));
    } else {
      filled.insert(it->second.const_data_ptr());
    }
  }
  for (const auto& [name, t] : by_name) {
    if (t.numel() > 0 && !filled.contains(t.const_data_ptr())) {
      problems.push_back(::fsdpx::detail::str("'", name, "' was not sent"));
    }
  }
  std::sort(problems.begin(), problems.end());
  FSDPX_CHECK_AS(SyncError, problems.empty(),
                 "the received weights do not match the module (nothing was "
                 "loaded): ",
                 TensorCollector::join(problems));
}

}  // namespace detail

}  // namespace fsdpx::sync
