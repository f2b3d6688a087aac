// extra_state: what a resumed job needs besides weights and optimizer state: the random number
// generators' states and the user's client state (data position, scheduler step, anything).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <filesystem>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>

#include <fsdpx/checkpoint/format.hpp>

namespace fsdpx {

/// The user's part of extra_state: plain values (numbers, strings, lists, dicts, tensors), and the
/// LR scheduler's state (LrScheduler::state_dict(); None when no scheduler was saved).
struct ExtraState {
  c10::impl::GenericDict client = checkpoint::detail::new_dict();
  int64_t step = 0;
  c10::IValue scheduler;
};

namespace checkpoint {

/// extra_state as saved: the format fields, the step, this rank's RNG states and the client dict.
FSDPX_DECL c10::IValue extra_state_to_ivalue(const ExtraState& extra, int world_size, int rank);

/// Restores the RNG states (when `restore_rng`) and returns the saved ExtraState.
FSDPX_DECL ExtraState extra_state_from_ivalue(const c10::IValue& v, const fs::path& path, bool restore_rng);

}  // namespace checkpoint
}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/extra_state.ipp>
#endif
