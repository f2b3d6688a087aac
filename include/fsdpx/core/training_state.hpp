// Where a sharded model is in a training step, and where each of its units is: the states of the unit
// protocol (FSDP2's TrainingState), public so that a caller can ask ShardedModel::stage(). The
// transitions are in core/sharded_model.hpp and docs/core.md ("The protocol's states").
#pragma once

#include <cstdint>

namespace fsdpx::core {

/// Where the model is between two steps.
enum class PassStage : uint8_t {
  idle,           // no pass: nothing issued, every unit resharded (the root excepted after a forward)
  forward,        // the root's forward runs
  after_forward,  // a forward ran; its graph may still be differentiated
  backward,       // a backward pass runs; its end is queued with autograd
};

/// Where one unit is in the current pass.
enum class UnitPhase : uint8_t {
  idle,           // not run in this pass
  forward,        // its forward runs: gathered
  after_forward,  // its forward ran with gradients on; its backward has not begun
  backward,       // its outputs' gradients arrived: gathered again, its backward (or recomputation) runs
  reduced,        // its backward ended: its reduction was issued (when syncing) and it resharded
};

inline const char* name(PassStage s) {
  switch (s) {
    case PassStage::idle: return "idle";
    case PassStage::forward: return "forward";
    case PassStage::after_forward: return "after forward";
    case PassStage::backward: return "backward";
  }
  return "?";
}

inline const char* name(UnitPhase p) {
  switch (p) {
    case UnitPhase::idle: return "idle";
    case UnitPhase::forward: return "forward";
    case UnitPhase::after_forward: return "after forward";
    case UnitPhase::backward: return "backward";
    case UnitPhase::reduced: return "reduced";
  }
  return "?";
}

}  // namespace fsdpx::core
