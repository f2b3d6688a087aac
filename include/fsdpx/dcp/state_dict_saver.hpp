// Saving a sharded model and its optimizer as PyTorch Distributed Checkpoint (torch's state_dict_saver with
// get_model_state_dict / get_optimizer_state_dict), so that `dcp.load` (FSDP2, LightRFT, torchtitan, a plain
// transformers model) reads what fsdpx trained:
//
//   fsdpx::dcp::save_model(model, dir);                                   // collective
//   fsdpx::dcp::save_optimizer(model, optimizer, dir / "optim_states");   // LightRFT's layout
//
// `model` is an fsdpx::Fsdp<...> or its core::ShardedModel. Each rank writes the slices of the sharded state
// dict it holds (elements [begin, end) of each flattened parameter) as the boxes that cover them (plan.hpp),
// in its own data file (writer.hpp).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <filesystem>
#include <vector>

#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/model_ref.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dcp/options.hpp>
#include <fsdpx/dcp/writer.hpp>
#include <fsdpx/detail/file_io.hpp>

namespace fsdpx::dcp {

/// A model state dict (sharded or full: each rank's slices; not local, whose entries are flat unit shards) as
/// the DCP tensors this rank saves, each under its saved names.
FSDPX_DECL std::vector<SavedTensor> model_tensors(const StateDict& sd, const SaveOptions& options = {});

/// An optimizer state dict (optimizer_state_dict's: this rank's slices of each parameter's state) as the DCP
/// tensors this rank saves in get_optimizer_state_dict's layout: state.<name>.<key>, and state.<name>.step
/// from the rank that holds the parameter's first element.
FSDPX_DECL std::vector<SavedTensor> optimizer_tensors(const StateDict& sd, const SaveOptions& options = {});

/// The optimizer's param groups as DCP bytes entries (param_groups.<g>.<key>; see save_optimizer), on world
/// rank 0 (empty on the others). Collective over the model's world: a group's parameters are found from every
/// rank's shards.
FSDPX_DECL std::vector<SavedBytes> param_group_entries(ShardedModelRef model, torch::optim::Optimizer& optimizer,
                                                       const SaveOptions& options = {});

/// Saves `model`'s parameters and buffers as a DCP checkpoint in `dir`, each under its name (as
/// `dcp.save(model.state_dict())` or `dcp.save(get_model_state_dict(model))` does): collective over the
/// model's world; see save_state.
FSDPX_DECL ::fsdpx::detail::WrittenFile save_model(ShardedModelRef model, const fs::path& dir,
                                                   const SaveOptions& options = {});

/// Saves `optimizer`'s state (an optimizer over `model`'s shards, as make_adamw builds) as a DCP
/// checkpoint in `dir`, in the layout of torch's `get_optimizer_state_dict(model, optimizer)`: per
/// parameter `state.<name>.exp_avg`, `state.<name>.exp_avg_sq` (`max_exp_avg_sq` with amsgrad;
/// `momentum_buffer` for SGD) in the parameter's shape and `state.<name>.step` (a float32 scalar), and per
/// param group `param_groups.<g>.<key>`: the keys torch.optim's class of the same name holds (LibTorch's
/// hyperparameters, and Python's flags at their defaults) and `params`, the group's parameter names. So
/// FSDP2's `set_optimizer_state_dict` takes it after `dcp.load` (LightRFT keeps it in `optim_states/`
/// beside the model's checkpoint). Collective over the model's world; see save_state.
FSDPX_DECL ::fsdpx::detail::WrittenFile save_optimizer(ShardedModelRef model, torch::optim::Optimizer& optimizer,
                                                       const fs::path& dir, const SaveOptions& options = {});

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/state_dict_saver.ipp>
#endif
