// Checkpoints: state dicts, fsdpx's file format and the checkpoint root's layout, the background save
// coordinator, resume, merge to a full model, and the seam each checkpoint format plugs into. PyTorch
// Distributed Checkpoint is a room of its own: <fsdpx/dcp.hpp>.
#pragma once

#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/memory_tier.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/checkpoint/names.hpp>
#include <fsdpx/checkpoint/resume.hpp>
#include <fsdpx/checkpoint/save_request.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/checkpoint/step_format.hpp>
#if defined(FSDPX_WITH_BOOST)
#include <fsdpx/checkpoint/coordinator.hpp>
#endif
