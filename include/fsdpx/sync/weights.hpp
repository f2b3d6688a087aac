// A set of weights as weight sync moves them: named tensors under one version, and the verbs every
// receiver shares (the Receiver concept). Every transport (broadcast, in-process synchronizer, TCP
// service, checkpoint watcher) speaks it.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/error.hpp>
#include <fsdpx/sync/load.hpp>  // WeightVersion::load_into
#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync {

// (GCC warns about the deprecated member in WeightVersion's implicit constructors, at the struct: not
// at the users' code, which uses only `version`. Reading or writing `step` still warns where it is done.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
/// A complete set of weights under one version: what every receiver hands out (the in-process
/// Synchronizer's snapshots, a TCP fetch, a broadcast received as tensors, a step the checkpoint watcher
/// read). The Python receiver's fsdpx_sync.WeightVersion is the same.
struct WeightVersion {
  int64_t version = no_version;
  std::vector<NamedTensor> tensors;
  /// The trainer run that published it (the TCP service: ClientOptions::run); empty in process.
  std::string run = {};
  /// What the version must be (each tensor's CRC-32C, the digest): sync::verify(tensors, *manifest)
  /// says whether weights are exactly it. Set by every transport but the checkpoint watcher's poll()
  /// and wait_newer() (a checkpoint's files are checked against their commit record instead).
  std::shared_ptr<const Manifest> manifest = {};
  /// Deprecated: the checkpoint watcher's name for the version (its step), kept equal to `version` by
  /// the watcher for one release.
  [[deprecated("WeightVersion::step is now WeightVersion::version")]] int64_t step = no_version;

  /// The tensor named `name`; a SyncError naming it when absent.
  const at::Tensor& at(std::string_view name) const {
    for (const auto& t : tensors) {
      if (t.name == name) return t.tensor;
    }
    throw SyncError(::fsdpx::detail::str("fsdpx: weight version ", version, " has no tensor '", name, "'"));
  }
  int64_t nbytes() const {
    int64_t n = 0;
    for (const auto& t : tensors) n += static_cast<int64_t>(t.tensor.nbytes());
    return n;
  }
  /// Copies the tensors into `module`'s parameters and buffers by name, with the receivers' checks
  /// (sync::load_into in sync/load.hpp: unknown, missing and mis-shaped names are one SyncError).
  void load_into(torch::nn::Module& module) const { sync::load_into(module, tensors); }
};
#pragma GCC diagnostic pop

/// Deprecated: WeightVersion's name in the broadcast, the synchronizer and the TCP service before one
/// type served every transport.
using WeightSnapshot [[deprecated("fsdpx::sync::WeightSnapshot is now fsdpx::sync::WeightVersion")]] = WeightVersion;

/// What a rollout does with a receiver that it pulls from, whatever the transport (SynchronizerReader,
/// SynchronizerClient, CheckpointWatcher; in Python fsdpx_sync.SyncClient and CheckpointWatcher): load
/// the newest version newer than the one it loaded last into a module, in place, waiting up to `wait`
/// (a SyncError after it, the module's weights kept); say which version that was and whether it came as
/// a delta; and check that the module still holds it exactly. The broadcast's WeightReceiver is
/// collective rather than pulled (receive_into, when the trainer broadcasts) but answers the same
/// questions (last_version, last_was_delta, verify).
template <class R>
concept Receiver = requires(R& receiver, const R& held, torch::nn::Module& module, std::chrono::milliseconds wait) {
  { receiver.load_newer_into(module, wait) } -> std::same_as<int64_t>;
  { held.last_version() } -> std::same_as<int64_t>;
  { held.last_was_delta() } -> std::same_as<bool>;
  held.verify(module);
};

}  // namespace fsdpx::sync
