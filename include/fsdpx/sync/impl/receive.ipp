// Out-of-line functions of fsdpx/sync/detail/receive.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cstring>

#include <fsdpx/memory/host.hpp>
#include <fsdpx/sync/detail/receive.hpp>

namespace fsdpx::sync::detail {

FSDPX_DECL std::string Coverage::add(int64_t begin, int64_t n, int64_t numel) {
  int64_t end = 0;
  if (begin < 0 || n < 0 || __builtin_add_overflow(begin, n, &end) || end > numel) {
    return ::fsdpx::detail::str("elements [", begin, ", ", begin, "+", n, ") lie outside its ", numel, " elements");
  }
  if (n == 0) {
    // plan_buckets sends an empty chunk only for an empty tensor, once (so its shape travels).
    if (numel != 0)
      return ::fsdpx::detail::str("an empty chunk at element ", begin, " of a tensor of ", numel, " elements");
    if (empty_seen_) return "the empty tensor arrived twice";
    empty_seen_ = true;
    return {};
  }
  auto next = ranges_.lower_bound(begin);  // the first range starting at or after `begin`
  const auto overlap = [&](int64_t b, int64_t e) {
    return ::fsdpx::detail::str("elements [", std::max(begin, b), ", ", std::min(end, e), ") arrived twice (a chunk [",
                                begin, ", ", end, ") overlaps elements already received)");
  };
  if (next != ranges_.end() && next->first < end) return overlap(next->first, next->second);
  auto prev = next == ranges_.begin() ? ranges_.end() : std::prev(next);
  if (prev != ranges_.end() && prev->second > begin) return overlap(prev->first, prev->second);
  // Merge with the neighbours it touches, so in-order chunks keep one range.
  int64_t new_end = end;
  if (next != ranges_.end() && next->first == end) {
    new_end = next->second;
    ranges_.erase(next);
  }
  if (prev != ranges_.end() && prev->second == begin) {
    prev->second = new_end;
  } else {
    ranges_.emplace(begin, new_end);
  }
  covered_ += n;
  return {};
}

FSDPX_DECL std::string Coverage::gap(int64_t numel) const {
  if (numel == 0) return empty_seen_ ? std::string() : "it never arrived";
  if (covered_ == numel) return {};
  int64_t at = 0;  // the first element not covered
  int64_t until = numel;
  for (const auto& [b, e] : ranges_) {
    if (b > at) {
      until = b;
      break;
    }
    at = e;
  }
  return ::fsdpx::detail::str(covered_, " of ", numel, " elements arrived; elements [", at, ", ", until, ") never did");
}

FSDPX_DECL std::string VersionCoverage::add(const BucketEntry& e, uint32_t bucket) {
  auto it = index_.find(e.name);
  if (it == index_.end()) {
    it = index_.emplace(e.name, tensors_.size()).first;
    tensors_.push_back({e.name, e.dtype, e.shape, e.tensor_numel(), {}});
    // A name, a shape and a map node per tensor: a version of many tiny tensors is not free.
    bookkeeping_ +=
        tensor_bookkeeping_bytes + 2 * static_cast<int64_t>(e.name.size()) + 8 * static_cast<int64_t>(e.shape.size());
  }
  Tensor& t = tensors_[it->second];
  if (t.dtype != e.dtype || t.shape != e.shape) {
    return ::fsdpx::detail::str("tensor '", e.name, "' arrived with two shapes or dtypes (", c10::IntArrayRef(t.shape),
                                " ", t.dtype, ", then ", c10::IntArrayRef(e.shape), " ", e.dtype, " in bucket ", bucket,
                                ")");
  }
  const size_t ranges = t.coverage.ranges();
  if (std::string problem = t.coverage.add(e.element_offset, e.numel, t.numel); !problem.empty()) {
    return ::fsdpx::detail::str("tensor '", e.name, "': ", problem, " (bucket ", bucket, ")");
  }
  bookkeeping_ += range_bookkeeping_bytes * (static_cast<int64_t>(t.coverage.ranges()) - static_cast<int64_t>(ranges));
  return {};
}

FSDPX_DECL std::string VersionCoverage::missing() const {
  std::vector<std::string> problems;
  for (const Tensor& t : tensors_) {
    if (std::string gap = t.coverage.gap(t.numel); !gap.empty()) {
      problems.push_back(::fsdpx::detail::str("tensor '", t.name, "': ", gap));
    }
  }
  if (problems.empty()) return {};
  return ::fsdpx::detail::str(problems.size(), " tensor(s) did not arrive whole: ", TensorCollector::join(problems));
}

FSDPX_DECL bool TensorCollector::cover(size_t index, const BucketEntry& e) {
  const at::Tensor& t = tensors_[index].tensor;
  if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype) {
    problems_.push_back(::fsdpx::detail::str("'", e.name, "' arrived with two different shapes or dtypes"));
    return false;
  }
  Coverage& c = received_[index];
  const size_t ranges = c.ranges();
  if (std::string problem = c.add(e.element_offset, e.numel, t.numel()); !problem.empty()) {
    problems_.push_back(::fsdpx::detail::str("'", e.name, "': ", problem));
    return false;
  }
  arrived_ += e.nbytes();
  // Chunks out of order cost a range each: counted, so that a sender cannot grow the bookkeeping freely.
  if (c.ranges() > ranges) {
    bookkeeping_ += range_bookkeeping_bytes;
    const std::string problem =
        bookkeeping_problem(bookkeeping_, arrived_, version_bookkeeping_floor,
                            ::fsdpx::detail::str("the chunks of '", e.name, "', so scattered,"));
    FSDPX_CHECK_AS(SyncError, problem.empty(), "received weights: ", problem);
  }
  return true;
}

FSDPX_DECL void TensorCollector::accept(const BucketEntry& e, const at::Tensor& chunk) {
  auto it = index_.find(e.name);
  if (it == index_.end()) it = add(e);
  if (!cover(it->second, e)) return;  // nothing is written twice
  if (e.numel > 0) tensors_[it->second].tensor.view({-1}).narrow(0, e.element_offset, e.numel).copy_(chunk);
}

FSDPX_DECL void TensorCollector::accept_from(const at::Tensor& bucket, const BucketEntry& e) {
  auto it = index_.find(e.name);
  if (it == index_.end()) it = add(e);
  const at::Tensor& t = tensors_[it->second].tensor;
  if (!bucket.is_cpu() || !t.is_cpu() || !bucket.is_contiguous()) return accept(e, entry_view(bucket, e));
  if (!cover(it->second, e)) return;  // nothing is written twice
  // In bounds: decode_header checked the entry against the bucket, cover() against the tensor.
  if (e.numel > 0) {
    std::memcpy(static_cast<uint8_t*>(t.data_ptr()) + e.element_offset * static_cast<int64_t>(t.element_size()),
                bucket.const_data_ptr<uint8_t>() + e.byte_offset, static_cast<size_t>(e.nbytes()));
  }
}

FSDPX_DECL void TensorCollector::accepted(const BucketEntry& e) { cover(index_.at(e.name), e); }

FSDPX_DECL at::Tensor TensorCollector::destination(const BucketEntry& e) {
  auto it = index_.find(e.name);
  if (it == index_.end()) it = add(e);
  const at::Tensor& t = tensors_[it->second].tensor;
  if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype || e.numel == 0) return {};
  return t.view({-1}).narrow(0, e.element_offset, e.numel);
}

FSDPX_DECL std::vector<NamedTensor> TensorCollector::finish() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (std::string gap = received_[i].gap(tensors_[i].tensor.numel()); !gap.empty()) {
      problems_.push_back(::fsdpx::detail::str("'", tensors_[i].name, "': ", gap));
    }
  }
  FSDPX_CHECK_AS(SyncError, problems_.empty(),
                 "received weights are not whole (every element of every tensor must "
                 "arrive exactly once): ",
                 join(problems_));
  return std::move(tensors_);
}

FSDPX_DECL std::string TensorCollector::join(const std::vector<std::string>& items, size_t max) {
  std::string s;
  for (size_t i = 0; i < items.size() && i < max; ++i) s += (i ? "; " : "") + items[i];
  if (items.size() > max) s += ::fsdpx::detail::str("; and ", items.size() - max, " more");
  return s;
}

FSDPX_DECL std::unordered_map<std::string, size_t>::iterator TensorCollector::add(const BucketEntry& e) {
  const int64_t numel = e.tensor_numel();
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(e.dtype));  // checked by decode_header
  FSDPX_CHECK_AS(SyncError, bytes <= max_bytes_ - allocated_, "received weights: tensor '", e.name, "' of ", bytes,
                 " bytes would take the version beyond its limit of ", max_bytes_, " bytes");
  // Each tensor also costs its bookkeeping, so that a sender cannot make many empty ones for free.
  bookkeeping_ += tensor_bookkeeping_bytes + 2 * static_cast<int64_t>(e.name.size());  // kept twice
  const std::string problem =
      bookkeeping_problem(bookkeeping_, arrived_, version_bookkeeping_floor,
                          ::fsdpx::detail::str("tensor '", e.name, "', the ", tensors_.size() + 1, "th,"));
  FSDPX_CHECK_AS(SyncError, problem.empty(), "received weights: ", problem);
  allocated_ += bytes;
  const auto options = at::TensorOptions().dtype(e.dtype).device(device_);
  tensors_.push_back(
      {e.name, huge_pages_ ? memory::empty_buffer(numel, options).view(e.shape) : at::empty(e.shape, options)});
  received_.emplace_back();
  return index_.emplace(e.name, tensors_.size() - 1).first;
}

FSDPX_DECL ModuleLoader::ModuleLoader(torch::nn::Module& module) {
  // A tied parameter appears under several names; any of them fills it.
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    const auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), targets_.size());
    if (fresh) targets_.push_back({name, t, {}});
    by_name_.emplace(name, it->second);
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) add(item.key(), item.value());
}

FSDPX_DECL void ModuleLoader::accept(const BucketEntry& e, const at::Tensor& chunk) {
  const auto it = by_name_.find(e.name);
  if (it == by_name_.end()) {
    unknown_.push_back(e.name);
    return;
  }
  Target& t = targets_[it->second];
  if (t.reported) return;
  if (t.param.sizes().vec() != e.shape) {
    t.reported = true;
    problems_.push_back(::fsdpx::detail::str("'", e.name, "' has shape ", t.param.sizes(), " in the module but ",
                                             c10::IntArrayRef(e.shape), " was sent"));
    return;
  }
  if (!t.param.is_contiguous()) {
    t.reported = true;
    problems_.push_back(::fsdpx::detail::str("'", e.name, "' is not contiguous in the module"));
    return;
  }
  if (!cover(t, e)) return;  // nothing is written twice
  at::NoGradGuard no_grad;
  if (e.numel > 0) t.param.detach().view({-1}).narrow(0, e.element_offset, e.numel).copy_(chunk);
}

FSDPX_DECL bool ModuleLoader::cover(Target& t, const BucketEntry& e) {
  if (std::string problem = t.received.add(e.element_offset, e.numel, t.param.numel()); !problem.empty()) {
    problems_.push_back(::fsdpx::detail::str("'", e.name, "': ", problem));
    return false;
  }
  return true;
}

FSDPX_DECL void ModuleLoader::accepted(const BucketEntry& e) { cover(targets_[by_name_.at(e.name)], e); }

FSDPX_DECL at::Tensor ModuleLoader::destination(const BucketEntry& e) const {
  const auto it = by_name_.find(e.name);
  if (it == by_name_.end() || e.numel == 0) return {};
  const Target& t = targets_[it->second];
  if (t.reported || t.param.sizes().vec() != e.shape || !t.param.is_contiguous() || t.param.scalar_type() != e.dtype) {
    return {};
  }
  return t.param.detach().view({-1}).narrow(0, e.element_offset, e.numel);
}

FSDPX_DECL void ModuleLoader::finish() {
  std::vector<std::string> missing;
  for (const Target& t : targets_) {
    if (t.reported) continue;
    if (t.received.covered() == 0 && t.param.numel() > 0) {
      missing.push_back(t.name);
    } else if (t.received.covered() != t.param.numel()) {
      problems_.push_back(::fsdpx::detail::str("'", t.name, "': ", t.received.gap(t.param.numel())));
    }
  }
  std::sort(unknown_.begin(), unknown_.end());
  unknown_.erase(std::unique(unknown_.begin(), unknown_.end()), unknown_.end());
  if (!unknown_.empty()) {
    problems_.push_back(::fsdpx::detail::str(
        unknown_.size(),
        " sent tensor(s) are not parameters or buffers of the module: ", TensorCollector::join(unknown_)));
  }
  if (!missing.empty()) {
    problems_.push_back(::fsdpx::detail::str(
        missing.size(), " module parameter(s) or buffer(s) were not sent: ", TensorCollector::join(missing)));
  }
  FSDPX_CHECK_AS(SyncError, problems_.empty(),
                 "the received weights do not match the module (its other parameters may have been updated): ",
                 TensorCollector::join(problems_));
}

}  // namespace fsdpx::sync::detail
