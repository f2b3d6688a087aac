// Wrap policies: which submodules become sharding units. The model is walked from the root; a module
// the policy picks becomes a unit and is not descended into. Parameters outside every unit belong to
// the root unit.
#pragma once

#include <concepts>
#include <cstdint>

#include <torch/nn/module.h>

namespace fsdpx {

/// What a wrap policy may look at for one module.
struct UnitQuery {
  const torch::nn::Module& module;
  int64_t numel;                // parameters of the module and its descendants
  int64_t largest_child_numel;  // the same for its largest child
};

/// Every module whose implementation is one of `Impls` (e.g. WrapModules<BlockImpl>).
template <class... Impls>
struct WrapModules {
  static_assert(sizeof...(Impls) > 0, "WrapModules<...> needs at least one module implementation type");
  static_assert((std::derived_from<Impls, torch::nn::Module> && ...),
                "WrapModules<Impls...>: each Impl must derive from torch::nn::Module (name BlockImpl, not Block)");
  static bool is_unit(const UnitQuery& q) { return ((dynamic_cast<const Impls*>(&q.module) != nullptr) || ...); }
};

/// Every module for which `Predicate{}(query)` is true.
template <class Predicate>
struct WrapIf {
  static_assert(std::default_initializable<Predicate> && std::predicate<const Predicate&, const UnitQuery&>,
                "WrapIf<Predicate>: Predicate must be default-constructible and callable as bool(const UnitQuery&)");
  static bool is_unit(const UnitQuery& q) { return Predicate{}(q); }
};

/// The smallest modules that hold at least MinParams parameters.
template <int64_t MinParams>
struct WrapBySize {
  static_assert(MinParams > 0, "WrapBySize<N>: N must be positive");
  static bool is_unit(const UnitQuery& q) { return q.numel >= MinParams && q.largest_child_numel < MinParams; }
};

/// One unit: the whole model.
struct NoWrap {
  static bool is_unit(const UnitQuery&) { return false; }
};

template <class P>
concept WrapPolicy = requires(const UnitQuery& q) {
  { P::is_unit(q) } -> std::convertible_to<bool>;
};

}  // namespace fsdpx
