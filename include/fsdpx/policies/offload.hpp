// Offload policies: where the sharded parameters, gradients and optimizer state live.
#pragma once

#include <concepts>

namespace fsdpx {

/// Shards live on the training device.
struct NoOffload {
  static constexpr bool offload_to_cpu = false;
  static constexpr bool pin_memory = false;
};

/// Shards, their gradients and the optimizer state live in host memory; parameters are copied to the
/// device for each gather and the optimizer step runs on the host. PinMemory (on a GPU machine) makes
/// those copies asynchronous.
template <bool PinMemory = true>
struct CpuOffload {
  static constexpr bool offload_to_cpu = true;
  static constexpr bool pin_memory = PinMemory;
};

template <class P>
concept OffloadPolicy = requires {
  { P::offload_to_cpu } -> std::convertible_to<bool>;
  { P::pin_memory } -> std::convertible_to<bool>;
};

}  // namespace fsdpx
