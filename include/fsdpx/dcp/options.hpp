// How a model's tensors meet a DCP checkpoint's entries, saving and loading: plain data the checkpoint layer
// defines (checkpoint/names.hpp), so that CheckpointOptions and LoadOptions carry them without DCP's code;
// models::dcp_save_options and dcp_load_options fill them for the decoder.
#pragma once

#include <fsdpx/checkpoint/names.hpp>

namespace fsdpx::dcp {

/// How fsdpx's tensors are named in a DCP checkpoint (save_model, save_optimizer, CheckpointOptions::dcp_names).
using SaveOptions = SaveNames;
/// How a DCP checkpoint's entries meet a model's tensors (load_model, load_optimizer, LoadOptions::dcp).
using LoadOptions = LoadNames;
/// Where a tensor lies inside a larger saved tensor (SaveOptions::placed_in, LoadOptions::placed_in).
using Placement = ::fsdpx::Placement;

}  // namespace fsdpx::dcp
