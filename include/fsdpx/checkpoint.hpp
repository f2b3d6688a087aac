// Checkpoints: state dicts, the background save coordinator, resume, merge to a full model.
#pragma once

#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/checkpoint/resume.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#if defined(FSDPX_WITH_BOOST)
#include <fsdpx/checkpoint/coordinator.hpp>
#endif
