// Checkpoints: state dicts, the background save coordinator, resume, merge to a full model, the metadata
// of PyTorch Distributed Checkpoint (DCP) and saving one.
#pragma once

#include <fsdpx/checkpoint/dcp_metadata.hpp>
#include <fsdpx/checkpoint/dcp_reader.hpp>
#include <fsdpx/checkpoint/dcp_writer.hpp>
#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/checkpoint/resume.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#if defined(FSDPX_WITH_BOOST)
#include <fsdpx/checkpoint/coordinator.hpp>
#endif
