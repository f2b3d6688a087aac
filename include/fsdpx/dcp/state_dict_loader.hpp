// Loading PyTorch Distributed Checkpoints into a sharded model (torch's state_dict_loader and
// set_model_state_dict): read by any world size, each rank reading only the chunks that overlap its own
// shards:
//
//   fsdpx::dcp::load_model(model, "/ckpt/global_step10");                                  // a folder with a .metadata
//   fsdpx::dcp::load_optimizer(model, optimizer, "/ckpt/global_step10/optim_states");       // LightRFT's layout
//
// `model` is an fsdpx::Fsdp<...> or its core::ShardedModel; names, shapes, dtypes and coverage are checked,
// and every mismatch is named in one error, as for fsdpx's own state dicts.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <filesystem>

#include <torch/optim/optimizer.h>

#include <fsdpx/core/model_ref.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dcp/options.hpp>
#include <fsdpx/dcp/reader.hpp>

namespace fsdpx::dcp {

/// Loads a DCP checkpoint into `model`: each rank reads the chunks that overlap its own shards (and the
/// buffers whole), casting floating-point values to its shards' dtype. Every rank calls it; it is not
/// collective.
FSDPX_DECL void load_model(ShardedModelRef model, const Reader& reader, const LoadOptions& options = {});

/// The same for the DCP checkpoint folder `dir` (one with a `.metadata`: is_checkpoint).
inline void load_model(ShardedModelRef model, const fs::path& dir, const LoadOptions& options = {}) {
  load_model(model, Reader(dir), options);
}

/// Loads an optimizer's state (an optimizer over `model`'s shards, as make_adamw builds) from a DCP
/// checkpoint in the layout of torch's `get_optimizer_state_dict` (FSDP2's, LightRFT's `optim_states/`, what
/// save_optimizer writes): each rank reads its own range of every parameter's `state.<name>.<key>` (exp_avg,
/// exp_avg_sq, ...) and its `state.<name>.step`, and each param group's hyperparameters (`param_groups.<g>.lr`,
/// ...) when the checkpoint has as many groups as the optimizer; a group whose parameters are not the
/// checkpoint's group's is an Error naming the parameter. A parameter without saved state (frozen when saved)
/// starts afresh. `options.prefix` is the optimizer's key in a combined checkpoint ("optim." for
/// dcp.save({"model": ..., "optim": ...})); `options.file_name` and `placed_in` map the model's names as for
/// the model. Every rank calls it; it is not collective.
FSDPX_DECL void load_optimizer(ShardedModelRef model, torch::optim::Optimizer& optimizer, const Reader& reader,
                               const LoadOptions& options = {});

/// The same for the DCP checkpoint folder `dir`.
inline void load_optimizer(ShardedModelRef model, torch::optim::Optimizer& optimizer, const fs::path& dir,
                           const LoadOptions& options = {}) {
  load_optimizer(model, optimizer, Reader(dir), options);
}

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/state_dict_loader.ipp>
#endif
