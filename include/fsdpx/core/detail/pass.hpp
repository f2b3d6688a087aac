// The unit protocol's state, made explicit (FSDP2's TrainingState per parameter group): where the model
// is in a training pass, where each unit is, and what the pass has issued. Everything a pass changes
// lives in one Pass object, and every way out of a pass (its end, a failed forward, a failed
// backward, an end of backward that throws) goes through Pass::reset. docs/core.md ("The protocol's
// states") has the transition table.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <fsdpx/core/training_state.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::core {

class Unit;

/// What the last step did (a forward and its backward): for tests, benchmarks and profiles.
struct StepStats {
  std::vector<std::string> forward_order;  // the units the forward ran, in order (the root left out)
  int units_run = 0;                       // units whose forward ran with gradients on, the root included
  int reductions_during_backward = 0;      // reduce-scatters issued as soon as their unit's backward ended
  int reductions_at_end = 0;               // issued only when backward had finished
  int late_reductions = 0;                 // issued again for gradients that arrived after their unit's
  int recomputations = 0;                  // checkpointed unit calls whose forward ran again in backward
  int64_t peak_unsharded_bytes = 0;        // the most full-parameter bytes allocated at once
};

namespace detail {

// The states are public (core/training_state.hpp); the protocol's code names them here too.
using core::PassStage;
using core::UnitPhase;

/// One unit's part of a pass.
struct UnitRecord {
  UnitPhase phase = UnitPhase::idle;
  UnitPhase before_forward = UnitPhase::idle;  // the phase its running forward started from (restored if it throws)
  bool ran_with_grad = false;                  // its forward ran with gradients on (the same on every rank)
  bool prefetched_backward = false;            // its backward prefetch was issued
  int tracked_calls = 0;                       // calls whose inputs went through a post-backward node
  int finished_calls = 0;                      // of those, the calls whose post-backward node ran
  // Those nodes: a node that expired belongs to a graph dropped without a backward.
  std::vector<std::weak_ptr<const void>> post_backward_nodes;
  int grads_ready = 0;         // parameter gradients accumulated since its backward began
  bool late_gradient = false;  // a gradient accumulated after its reduction: reduced again at the end
};

/// Checks that `transition` of unit `unit` toward phase `to` may start from the record's phase: it
/// starts only from the phases `from` (the protocol's table, docs/core.md). From any other, an Error
/// naming the unit, the transition, the phase it found and the phases it accepts; the record is left
/// as it was. `hint`: what the violation most likely means to a user.
inline void check_phase(const UnitRecord& r, const std::string& unit, const char* transition,
                        std::initializer_list<UnitPhase> from, UnitPhase to, const char* hint = "") {
  if (std::find(from.begin(), from.end(), r.phase) != from.end()) return;
  std::string accepted;
  for (const UnitPhase p : from) accepted += (accepted.empty() ? "" : ", ") + std::string(name(p));
  FSDPX_FAIL(Error, "unit '", unit, "': ", transition, " found it in phase \"", name(r.phase),
             "\" but starts only from ", accepted, " (to ", name(to), ")", hint);
}

/// check_phase, then the record moves to `to`.
inline void move_phase(UnitRecord& r, const std::string& unit, const char* transition,
                       std::initializer_list<UnitPhase> from, UnitPhase to, const char* hint = "") {
  check_phase(r, unit, transition, from, to, hint);
  r.phase = to;
}

/// Everything one training pass owns.
struct Pass {
  PassStage stage = PassStage::idle;
  int backward_id = -1;           // autograd's id of the backward pass, while stage == backward
  std::vector<UnitRecord> units;  // by unit index
  std::vector<Unit*> recording;   // this forward's units so far, in order
  std::vector<bool> recorded;
  std::vector<Unit*> issued;  // reductions of this pass, in the order they were issued
  size_t replica_next = 0;    // issued[replica_next...] have not started their replica all-reduce
  StepStats stats;

  /// Forgets the calls whose graph was dropped without a backward (a forward with gradients on whose
  /// result was only read): a unit all of whose tracked calls were dropped is back to idle, as if it
  /// had not run; the others wait only for their live calls.
  void forget_dropped_graphs() {
    for (UnitRecord& r : units) {
      if (r.post_backward_nodes.empty()) continue;
      std::erase_if(r.post_backward_nodes, [](const std::weak_ptr<const void>& n) { return n.expired(); });
      if (r.post_backward_nodes.empty() && r.finished_calls == 0) {
        r = UnitRecord{};
      } else {
        r.tracked_calls = static_cast<int>(r.post_backward_nodes.size());
      }
    }
  }

  /// Back to idle, forgetting every unit's part (what every way out of a pass calls).
  void reset(size_t units_n) {
    stage = PassStage::idle;
    backward_id = -1;
    units.assign(units_n, UnitRecord{});
    recording.clear();
    recorded.assign(units_n, false);
    issued.clear();
    replica_next = 0;
    stats = StepStats{};
  }
};

}  // namespace detail
}  // namespace fsdpx::core
