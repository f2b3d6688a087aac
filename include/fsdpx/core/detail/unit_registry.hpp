// Which sharded unit a module is (for fsdpx::forward and fsdpx::call), and the walk over the tensors
// inside a call's arguments and results that the unit protocol casts, hooks and checkpoints.
#pragma once

#include <cstddef>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <fsdpx/error.hpp>

namespace fsdpx::core {

class ShardedModel;
class Unit;

namespace detail {

class UnitRegistry {
 public:
  static UnitRegistry& instance() {
    static UnitRegistry registry;
    return registry;
  }
  void add(const torch::nn::Module* m, ShardedModel* owner, Unit* unit) {
    std::lock_guard lock(mutex_);
    FSDPX_CHECK(units_.find(m) == units_.end(), "module '", m->name(), "' is already a unit of another Fsdp model");
    units_[m] = {owner, unit};
  }
  void remove(const torch::nn::Module* m) {
    std::lock_guard lock(mutex_);
    units_.erase(m);
  }
  std::pair<ShardedModel*, Unit*> find(const torch::nn::Module* m) const {
    std::lock_guard lock(mutex_);
    const auto it = units_.find(m);
    return it == units_.end() ? std::pair<ShardedModel*, Unit*>{nullptr, nullptr} : it->second;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::pair<ShardedModel*, Unit*>> units_;
};

template <class V>
concept TensorOptional = requires(V& v) {
  typename V::value_type;
  v.has_value();
  *v;
};

/// A container of values that may hold tensors (not a string, whose elements are characters).
template <class V>
concept TensorRange = requires(V& v) {
  v.begin();
  typename V::value_type;
} && !std::is_arithmetic_v<typename V::value_type>;

/// Applies `fn` to every tensor in `value` (a tensor, or a tuple, vector or optional of them, nested,
/// or a type that names its tensors with a member `transform_tensors(fn)`) in a fixed order, and returns
/// `value` with each tensor replaced by fn's result. Tensors inside other types are left alone.
template <class T, class Fn>
T map_tensors(T value, Fn&& fn) {
  using V = std::decay_t<T>;
  if constexpr (std::is_same_v<V, at::Tensor>) {
    return fn(std::move(value));
  } else if constexpr (requires { value.transform_tensors(fn); }) {
    value.transform_tensors(fn);
    return value;
  } else if constexpr (requires { std::tuple_size<V>::value; }) {
    std::apply([&](auto&... elems) { ((elems = map_tensors(std::move(elems), fn)), ...); }, value);
    return value;
  } else if constexpr (TensorOptional<V>) {
    if (value.has_value()) *value = map_tensors(std::move(*value), fn);
    return value;
  } else if constexpr (TensorRange<V>) {
    for (auto& v : value) v = map_tensors(std::move(v), fn);
    return value;
  } else {
    return value;  // no tensors inside (a scalar, a string, a struct)
  }
}

/// The tensors map_tensors would visit, in its order.
template <class T>
void collect_tensors(const T& value, std::vector<at::Tensor>& out) {
  (void)map_tensors(value, [&](at::Tensor t) {
    out.push_back(t);
    return t;
  });
}

}  // namespace detail
}  // namespace fsdpx::core
