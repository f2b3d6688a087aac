// State-dict policies: what Fsdp::state_dict() returns by default.
#pragma once

#include <concepts>

namespace fsdpx {

enum class StateDictKind { full, sharded, local };

/// Full tensors, gathered to the CPU of rank 0 (or every rank when asked).
struct FullStateDict {
  static constexpr StateDictKind kind = StateDictKind::full;
};
/// Each rank's shards with the metadata to reshard on load.
struct ShardedStateDict {
  static constexpr StateDictKind kind = StateDictKind::sharded;
};
/// The raw local flat shards: fastest, same topology only.
struct LocalStateDict {
  static constexpr StateDictKind kind = StateDictKind::local;
};

template <class P>
concept StateDictPolicy = requires {
  { P::kind } -> std::convertible_to<StateDictKind>;
};

}  // namespace fsdpx
