// Loading saved slices into this rank's tensors, whatever world size saved them: used by the loaders of
// fsdpx's state dicts (checkpoint/impl/state_dict.ipp) and of DCP's (dcp/impl/state_dict_loader.ipp).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdpx/detail/config.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {
struct StateDict;  // checkpoint/state_dict.hpp (which includes its .ipp, a user of this header)
}

namespace fsdpx::detail {

/// Copies the overlaps of saved slices into this rank's destinations, and checks that every
/// destination was filled exactly and that nothing saved was left over.
class SliceLoader {
 public:
  struct Target {
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // within the flattened tensor
    at::Tensor dst;              // 1-D, end - begin elements
    std::vector<std::pair<int64_t, int64_t>> filled;
  };

  /// `cast_floating`: a floating-point tensor saved in another floating-point dtype is cast (an
  /// inference-only model in bfloat16 loading a float32 checkpoint); otherwise a dtype mismatch is an error.
  explicit SliceLoader(std::string what, bool cast_floating = false)
      : what_(std::move(what)), cast_floating_(cast_floating) {}

  void add_target(const std::string& name, std::vector<int64_t> shape, int64_t begin, int64_t end, at::Tensor dst) {
    targets_[name].push_back(Target{std::move(shape), begin, end, std::move(dst), {}});
  }

  /// Copies from one saved state dict; `key` selects the tensor of each slice.
  FSDPX_DECL void load(const StateDict& sd, const std::string& key);

  /// Throws, naming everything that does not match; `strict`: names the checkpoint has and the model lacks are errors
  /// too. `absent_is_missing` false: a name no saved state dict mentions at all is no error (optimizer state of a
  /// tensor the optimizer never stepped: a frozen unit's shards); one that is there in part is.
  FSDPX_DECL void finish(bool strict = true, bool absent_is_missing = true);

  std::map<std::string, std::vector<Target>>& targets() { return targets_; }
  /// Whether any saved state dict loaded so far has a slice of `name`.
  bool seen(const std::string& name) const { return seen_.count(name) != 0; }
  /// Whether every saved rank's state dict was loaded (or a full one).
  bool complete() const { return complete_; }

 private:
  static std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
  static std::string join(std::vector<std::string> v) { return ::fsdpx::detail::join_names(std::move(v), 12); }

  std::string what_;
  bool cast_floating_ = false;
  std::map<std::string, std::vector<Target>> targets_;
  std::vector<std::string> unexpected_;
  std::vector<std::string> problems_;
  std::set<std::string> mismatched_;
  std::set<std::string> seen_;
  std::set<int> ranks_seen_;
  bool complete_ = false;  // every saved rank was read (or a full state dict)
};

}  // namespace fsdpx::detail
