// One seam per checkpoint format: how a step's files are written (CheckpointCoordinator) and read (resume,
// merge_checkpoint: fsdpx-merge, the checkpoint watcher) in each CheckpointFormat, so that neither side asks
// which format it holds.
//
//   const auto& format = checkpoint::step_format(record.files_format);
//   format.load_model(model, dir, record, options);
//
// fsdpx's own format is implemented here (impl/step_format.ipp). PyTorch Distributed Checkpoint's lives in the
// DCP room (dcp/layouts.hpp) and is registered by <fsdpx/dcp.hpp>, in any one translation unit of the program
// (always, when fsdpx is compiled once): without it, writing or reading a DCP step is refused with an error that
// names the header, and a program that never touches DCP compiles none of it. A new format is a StepFormat and
// one register_step_format call (docs/architecture.md, "Where a new feature goes").
#pragma once

#include <fsdpx/detail/config.hpp>

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/names.hpp>
#include <fsdpx/checkpoint/save_request.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/hf/safetensors.hpp>

// Declared here, defined by the headers whose implementations use this seam (so that their .ipp files, which
// include this header, see it whole whichever is included first).
namespace fsdpx {
struct LoadOptions;  // checkpoint/resume.hpp
}  // namespace fsdpx
namespace fsdpx::checkpoint {
struct MergeOptions;  // checkpoint/merge.hpp
struct MergeReport;
}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint {

/// What a rank wrote of one component of a step: the file (an empty path: none, a replica had nothing to
/// write) and its marker's text, from which rank 0 commits the component (StepFormat::commit).
struct WrittenComponent {
  ::fsdpx::detail::WrittenFile file;
  std::string marker;
};

/// A step opened for resuming: what it holds besides the model, each part read and checked already (the small
/// ones), and how the large ones load. Made for a step of an fsdpx root (resume) or for a folder another
/// trainer wrote (StepFormat::open_folder); load_checkpoint applies one rule to either.
struct SavedStep {
  int64_t step = 0;
  int saved_world_size = 0;
  /// Whether the step holds the optimizer's state, and why not ("it was saved without one").
  bool has_optimizer = false;
  std::string no_optimizer;
  /// The LR scheduler's state, as LrScheduler::state_dict() makes it, or why there is none.
  std::optional<c10::IValue> scheduler;
  std::string no_scheduler;
  /// The client state (a folder that keeps none by design: an empty dict), or why there is none. A load that
  /// restores the optimizer requires it.
  std::optional<c10::impl::GenericDict> client;
  std::string no_client_state;
  /// The step the extra state says (ResumeInfo::extra.step).
  int64_t extra_step = 0;
  /// Restores the saved RNG states; empty: none saved.
  std::function<void()> restore_rng;
  std::function<void(core::ShardedModel&)> load_model;
  std::function<void(core::ShardedModel&, torch::optim::Optimizer&)> load_optimizer;
  /// The saved model tensors that the model has no parameter or buffer of: when there are any, the step holds
  /// another model (another program's checkpoint root), the cause a missing part's error names instead.
  /// Empty: not known.
  std::function<std::vector<std::string>(core::ShardedModel&)> foreign_tensors;
  /// Where it was read from, for errors ("checkpoint step 4 in '/ckpt'", "DCP checkpoint '/ckpt/global_step10'").
  std::string what;
};

class StepFormat {
 public:
  virtual ~StepFormat() = default;
  virtual CheckpointFormat format() const = 0;

  // ---- writing: CheckpointCoordinator ----------------------------------------------------------------

  /// Every rank, on save()'s calling thread, before the snapshot: refuses a save this format cannot hold (an
  /// Error naming why), and takes what it needs besides the snapshot into req.format_data (collectively, when
  /// it needs every rank). `names`: how the tensors are named for another library (CheckpointOptions::dcp_names).
  virtual void prepare(SaveRequest& /*req*/, core::ShardedModel& /*model*/, torch::optim::Optimizer* /*optimizer*/,
                       const SaveNames& /*names*/) const {}
  /// The files (relative to the step folder) that a commit of a step leaves besides its commit record. An
  /// interrupted run's must go before the step's data files are written again: they describe other files.
  /// (The coordinator withdraws every format's, detail::format_homes: the run that left them may have
  /// written another format.)
  virtual std::vector<std::string> commit_files() const { return {}; }
  /// A rank's thread: writes its file of component `c` of the step in `dir`, durably.
  virtual WrittenComponent write(const SaveRequest& req, const fs::path& dir, Component c, int rank, int world_size,
                                 const SaveNames& names) const = 0;
  /// Rank 0, once every rank's marker of component `c` is durable (`markers`, by rank): the component's files
  /// for the commit record, each with its size and CRC-32C, after writing any file that completes the component
  /// (DCP's .metadata). An IoError naming the rank whose marker is corrupt.
  virtual std::map<std::string, CommittedFile> commit(const fs::path& dir, int64_t step, Component c,
                                                      std::span<const std::string> markers) const = 0;

  // ---- reading: resume, merge_checkpoint -----------------------------------------------------------------

  /// Loads the model's state of the committed step in `dir` (`record`, its commit record) into `model`.
  virtual void load_model(core::ShardedModel& model, const fs::path& dir, const CommitRecord& record,
                          const LoadOptions& options) const = 0;
  /// The same for the optimizer's state (the step committed it).
  virtual void load_optimizer(core::ShardedModel& model, torch::optim::Optimizer& optimizer, const fs::path& dir,
                              const CommitRecord& record, const LoadOptions& options) const = 0;
  /// The saved model tensors that `model` has no parameter or buffer of (SavedStep::foreign_tensors); by
  /// default none are known.
  virtual std::vector<std::string> foreign_tensors(core::ShardedModel& /*model*/, const fs::path& /*dir*/,
                                                   const CommitRecord& /*record*/,
                                                   const LoadOptions& /*options*/) const {
    return {};
  }
  /// The model's tensors of the step in `dir`, whole (merge_checkpoint). `record`: its commit record, nullptr
  /// when it has none.
  virtual hf::NamedTensors merge(const fs::path& dir, const CommitRecord* record, const MergeOptions& options,
                                 MergeReport* report) const = 0;
  /// A folder of this format outside an fsdpx root (folder_format: DCP's LightRFT or torchtitan step folder),
  /// opened for resuming `model`. fsdpx's format has none (an Error).
  FSDPX_DECL virtual SavedStep open_folder(const fs::path& dir, core::ShardedModel& model,
                                           const LoadOptions& options) const;
};

namespace detail {
/// What marks a folder of a format outside an fsdpx root, and the header its code is in: known here, so that a
/// program without that header is told what to include rather than that the folder holds no checkpoint.
struct FormatHome {
  CheckpointFormat format;
  const char* folder_marker;  // a file in such a folder (DCP: dcp::metadata_file_name)
  const char* header;
  std::array<const char*, 2> commit_files;  // its StepFormat::commit_files (nullptr: none), known without its code
};
inline constexpr FormatHome format_homes[] = {
    {CheckpointFormat::dcp, ".metadata", "<fsdpx/dcp.hpp>", {".metadata", "optim_states/.metadata"}}};
}  // namespace detail

/// The seam of format `f`. For a format whose code this program lacks (CheckpointFormat::dcp without
/// <fsdpx/dcp.hpp> in any translation unit), a ConfigError that says `needed_for` and which header to include.
FSDPX_DECL const StepFormat& step_format(CheckpointFormat f, std::string_view needed_for = {});

/// Makes `impl` the seam of its format (<fsdpx/dcp.hpp> does it for DCP, at static initialization). `impl`
/// must live as long as the program.
FSDPX_DECL void register_step_format(const StepFormat& impl);

/// The format of `dir` when it is a folder of one outside an fsdpx root (a folder with a `.metadata` is DCP's,
/// whether or not this program has DCP's code); nullopt otherwise.
FSDPX_DECL std::optional<CheckpointFormat> folder_format(const fs::path& dir);

}  // namespace fsdpx::checkpoint

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/step_format.ipp>
#endif
