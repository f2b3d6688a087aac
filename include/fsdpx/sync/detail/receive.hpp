// Receiving: where a version's chunks go, and proof that every element arrived exactly once. Coverage
// and VersionCoverage count elements by ranges; TensorCollector assembles whole tensors, ModuleLoader
// copies into a module's parameters by name. Used by every receiver (broadcast, synchronizer, TCP
// client and server).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>  // BucketEntry
#include <fsdpx/sync/detail/wire.hpp>    // the bookkeeping bounds
#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync::detail {

/// Which elements of one tensor have arrived: disjoint [begin, end) ranges, merged where they touch,
/// so chunks that arrive in order take one range. Readers and the server count a tensor whole only
/// when every element arrived exactly once: counting elements alone would take the first half sent
/// twice for the whole tensor, and hand out the other half uninitialised.
class Coverage {
 public:
  /// Records elements [begin, begin + n) of a tensor of `numel` elements; the reason it cannot (out of
  /// range, arrived before, an empty chunk of a non-empty tensor), recording nothing; empty when done.
  FSDPX_DECL std::string add(int64_t begin, int64_t n, int64_t numel);
  /// Elements recorded so far (each once).
  int64_t covered() const { return covered_; }
  /// Disjoint ranges held: what the bookkeeping costs.
  size_t ranges() const { return ranges_.size(); }
  /// Empty when all `numel` elements arrived; else the first range that did not, in words.
  FSDPX_DECL std::string gap(int64_t numel) const;

 private:
  std::map<int64_t, int64_t> ranges_;  // begin -> end
  int64_t covered_ = 0;
  bool empty_seen_ = false;  // the one entry of an empty tensor
};

/// A version's chunks as its buckets arrive (the server, before it commits a publish): each tensor
/// has one dtype and shape, and every element of every tensor arrives exactly once.
class VersionCoverage {
 public:
  /// Records entry `e` of bucket `bucket`; why it cannot belong to the version (naming the tensor),
  /// or empty.
  FSDPX_DECL std::string add(const BucketEntry& e, uint32_t bucket);
  /// Empty when every tensor arrived whole; else the tensors that did not (named, with their gaps).
  FSDPX_DECL std::string missing() const;
  /// What this bookkeeping holds, in bytes (so that a limit on a version can count it).
  int64_t bookkeeping_bytes() const { return bookkeeping_; }

 private:
  struct Tensor {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    Coverage coverage;
  };
  std::unordered_map<std::string, size_t> index_;
  std::vector<Tensor> tensors_;
  int64_t bookkeeping_ = 0;
};

/// Assembles whole tensors from chunks, allocating each on first sight (on `device`).
class TensorCollector {
 public:
  /// `max_bytes`: the most the tensors of one version may take together; a sender announcing more is
  /// refused before the allocation. Their bookkeeping may exceed the bytes that arrived by at most
  /// version_bookkeeping_floor: a version of many empty tensors is refused, not held.
  /// `huge_pages`: host tensors from memory::empty_buffer (2 MiB pages from 2 MiB); a receiver of
  /// untrusted peers passes false, so that scattered one-element chunks touch 4 KiB of memory each, not
  /// 2 MiB (1,024 of them, a 40 KB bucket, touched 2 GiB).
  explicit TensorCollector(at::Device device = at::kCPU, int64_t max_bytes = std::numeric_limits<int64_t>::max(),
                           bool huge_pages = true)
      : device_(device), max_bytes_(max_bytes), huge_pages_(huge_pages) {}

  FSDPX_DECL void accept(const BucketEntry& e, const at::Tensor& chunk);
  /// accept(e, entry_view(bucket, e)), a host bucket's bytes copied as they lie: a version of many
  /// small tensors pays a copy per tensor, not the tensor operations of a view.
  FSDPX_DECL void accept_from(const at::Tensor& bucket, const BucketEntry& e);

  /// Where entry `e`'s chunk can be received in place (the tensor allocated on first sight), or an
  /// undefined tensor when it cannot (then accept() is called with the chunk and says why).
  FSDPX_DECL at::Tensor destination(const BucketEntry& e);
  /// Entry `e` was received into destination(e).
  FSDPX_DECL void accepted(const BucketEntry& e);

  /// Checks every tensor arrived whole, each element exactly once, and hands them out, in arrival order.
  FSDPX_DECL std::vector<NamedTensor> finish();

  FSDPX_DECL static std::string join(const std::vector<std::string>& items, size_t max = 8);

 private:
  /// The tensor for `e`'s name, allocated on first sight (host ones through memory::empty_buffer).
  FSDPX_DECL std::unordered_map<std::string, size_t>::iterator add(const BucketEntry& e);
  /// Records `e` in its tensor's coverage; false (a problem noted) when it overlaps or lies outside.
  FSDPX_DECL bool cover(size_t index, const BucketEntry& e);

  at::Device device_;
  int64_t max_bytes_;
  bool huge_pages_;
  int64_t allocated_ = 0;    // the tensors' bytes
  int64_t arrived_ = 0;      // the chunks' bytes accepted
  int64_t bookkeeping_ = 0;  // beyond the tensors' bytes (bookkeeping_problem)
  std::unordered_map<std::string, size_t> index_;
  std::vector<NamedTensor> tensors_;
  std::vector<Coverage> received_;
  std::vector<std::string> problems_;
};

/// Copies chunks into a module's parameters and buffers by name. Names, shapes and completeness are
/// checked; what does not match is collected and reported at finish(), after every chunk was consumed,
/// so that a broadcast stays in step with its sender. The target's dtype may differ from the wire's
/// (copy_ casts), but then the copy is not bit-exact.
class ModuleLoader {
 public:
  FSDPX_DECL explicit ModuleLoader(torch::nn::Module& module);

  FSDPX_DECL void accept(const BucketEntry& e, const at::Tensor& chunk);

  /// Where entry `e`'s chunk can be received in place: the parameter's elements when the name, shape
  /// and dtype match and the parameter is contiguous; else an undefined tensor (then accept() is
  /// called with the chunk, and casts or reports).
  FSDPX_DECL at::Tensor destination(const BucketEntry& e) const;
  /// Entry `e` was received into destination(e).
  FSDPX_DECL void accepted(const BucketEntry& e);

  FSDPX_DECL void finish();

 private:
  struct Target {
    std::string name;
    at::Tensor param;
    Coverage received;
    bool reported = false;  // a mismatch was already recorded
  };
  /// Records `e` in its target's coverage; false (a problem noted) when it overlaps or lies outside.
  FSDPX_DECL bool cover(Target& t, const BucketEntry& e);
  std::vector<Target> targets_;
  std::map<std::string, size_t> by_name_;
  std::vector<std::string> unknown_;
  std::vector<std::string> problems_;
};

}  // namespace fsdpx::sync::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/receive.ipp>
#endif
