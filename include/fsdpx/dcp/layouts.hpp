// The step-folder layouts of PyTorch Distributed Checkpoint that fsdpx writes and resumes, in one place:
//
//   LightRFT's    the model's DCP in the step folder, the optimizer's in optim_states/, scheduler_state.pt (a
//                 torch LR scheduler's state_dict) and client_state.pt (plain values) beside them. fsdpx's
//                 CheckpointCoordinator writes it (CheckpointFormat::dcp), with fsdpx's extra state file and
//                 commit record in place of the two .pt files.
//   torchtitan's  one DCP of {"model": ..., "optimizer": ... (flattened by parameter), "lr_scheduler": ...,
//                 "dataloader": ..., "train_state": ...}; newer torchtitan puts the model's entries at the top.
//
// And DCP's checkpoint::StepFormat, the seam through which the coordinator writes such steps and resume and
// merge read them: this header registers it (checkpoint/step_format.hpp), so a
// program that includes <fsdpx/dcp.hpp> in any translation unit reads and writes DCP steps.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <optional>

#include <c10/core/ScalarType.h>

#include <fsdpx/checkpoint/step_format.hpp>
#include <fsdpx/dcp/options.hpp>
#include <fsdpx/dcp/reader.hpp>
#include <fsdpx/hf/safetensors.hpp>

namespace fsdpx::dcp {

enum class FolderLayout {
  lightrft,    // the model's DCP in the folder; optim_states/, scheduler_state.pt, client_state.pt beside it
  torchtitan,  // one DCP: model., optimizer., lr_scheduler., dataloader., train_state.
};

/// Where LightRFT's layout keeps the optimizer's DCP, in the step folder.
inline constexpr const char* optimizer_folder = "optim_states";

/// The layout of the DCP folder `reader` opened: torchtitan's when it has "optimizer.state." or a
/// "train_state.step" entry, else LightRFT's.
FSDPX_DECL FolderLayout folder_layout(const Reader& reader);

/// The names an optimizer's DCP is read with, from the model's (`model_names`): the same tensor names and
/// placements, under `prefix` ("" for LightRFT's optim_states/, "optimizer." for torchtitan's folder). One rule
/// for a DCP optimizer's state whoever wrote the folder.
FSDPX_DECL LoadOptions optimizer_names(const LoadOptions& model_names, std::string prefix);

/// Every tensor of a DCP checkpoint, whole, under its saved name, in name order (bytes entries are left
/// aside): what fsdpx-merge writes of a DCP folder. Floating-point tensors are cast to `dtype` when given.
FSDPX_DECL hf::NamedTensors read_tensors(const Reader& reader, std::optional<c10::ScalarType> dtype = std::nullopt);

/// DCP's seam (CheckpointFormat::dcp), registered by this header.
FSDPX_DECL const checkpoint::StepFormat& step_format();

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/layouts.ipp>
#endif
