// Activation-checkpointing policies: which units keep only their inputs in forward and recompute
// their forward inside backward (docs/core.md, "Activation checkpointing"). The root is never
// checkpointed; a unit is asked once, at construction.
//
//   Fsdp<Model, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<BlockImpl>, CheckpointAll>
//   CheckpointEvery<2>                  the 2nd, 4th, ... unit in the model's registration order
//   CheckpointNames<"model.layers.*">   units by their dotted name ('*' within one segment)
//   CheckpointIf<Predicate>             any rule over CheckpointQuery
#pragma once

#include <concepts>
#include <string_view>

#include <fsdpx/policies/wrap.hpp>

namespace fsdpx {

/// What a checkpointing policy may look at for one unit.
struct CheckpointQuery {
  std::string_view name;  // the unit's dotted name in the model ("model.layers.3")
  int index = 0;          // its position among the model's units (root and frozen companions left out)
  int count = 0;          // how many such units the model has
};

/// No unit is checkpointed (the default).
struct NoActivationCheckpointing {
  static constexpr bool checkpoints(const CheckpointQuery&) { return false; }
};

/// Every unit.
struct CheckpointAll {
  static constexpr bool checkpoints(const CheckpointQuery&) { return true; }
};

/// Every N-th unit (the N-th, 2N-th, ...), as torchtitan's selective layer checkpointing: a trade of
/// memory against recomputation between none and all.
template <int N>
struct CheckpointEvery {
  static_assert(N > 0, "CheckpointEvery<N>: N must be positive (CheckpointEvery<1> checkpoints every unit)");
  static constexpr bool checkpoints(const CheckpointQuery& q) { return (q.index + 1) % N == 0; }
};

/// Units whose dotted name matches one of `Patterns` ('*' within one segment, as WrapNames).
template <NamePattern... Patterns>
struct CheckpointNames {
  static_assert(sizeof...(Patterns) > 0, "CheckpointNames<...> needs at least one name pattern");
  static_assert(((Patterns.view().size() > 0) && ...), "CheckpointNames<...>: a name pattern is empty");
  static constexpr bool checkpoints(const CheckpointQuery& q) {
    return (detail::name_matches(Patterns.view(), q.name) || ...);
  }
};

/// Units for which `Predicate{}(query)` is true.
template <class Predicate>
struct CheckpointIf {
  static_assert(std::default_initializable<Predicate> && std::predicate<const Predicate&, const CheckpointQuery&>,
                "CheckpointIf<Predicate>: Predicate must be default-constructible and callable as "
                "bool(const CheckpointQuery&)");
  static bool checkpoints(const CheckpointQuery& q) { return Predicate{}(q); }
};

template <class P>
concept CheckpointPolicy = requires(const CheckpointQuery& q) {
  { P::checkpoints(q) } -> std::convertible_to<bool>;
};

}  // namespace fsdpx
