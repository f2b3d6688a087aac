// Weight sync by broadcast: the trainer's full parameters, gathered unit by unit from the sharded
// model, go from trainer rank 0 to every rollout rank of a model-update group (MPI on CPUs, NCCL on
// GPUs), packed into double-buffered weight buckets (sync/detail/bucket.hpp).
//
//   auto groups = fsdpx::sync::split_trainer_rollout(world, /*trainers=*/2);   // collective over world
//   if (groups.is_trainer()) {
//     Sharded model(make_model(), *groups.trainer);
//     fsdpx::sync::WeightBroadcaster sender(model, groups.model_update, {.dtype = at::kBFloat16});
//     for (int64_t step = 0; ...; ++step) { train(model); sender.broadcast(step); }   // every trainer rank
//   } else {
//     fsdpx::sync::WeightReceiver receiver(*groups.model_update);
//     for (...) { const int64_t version = receiver.receive_into(*rollout_model); ... }
//   }
//
// What is sent: each unit's gathered parameters in its compute dtype (what the unsharded module holds,
// Precision::param_dtype), cast to BroadcastOptions::dtype when one is set. Whatever the mesh and
// offload policy, the other ranks of the sending rank's shard group send it their shards unit by unit,
// each cast by its owner (a gather to that rank, not an all-gather; other replicas sit out); only
// trainer rank 0 broadcasts.
//
// On the wire, per version: an announcement, the buckets' sizes, then each bucket's header and its
// payload in segments; sync/detail/broadcast_wire.hpp describes it (once) and docs/sync.md specifies it.
//
// Two kinds of version (docs/sync.md, "Delta versions and proof of arrival"):
// - streamed (the default): the units' parameters as above, then the version's manifest (a CRC-32C per
//   tensor, BroadcastOptions::checksums), which receivers check against what arrived. Received in place,
//   so a mismatch (a corrupted transport) is an error after the module was written.
// - cut (BroadcastOptions::delta): the sending rank keeps a host copy of what it sent last; the version
//   is the delta from it when every receiver holds it (the all-reduce), else whole: the manifest first,
//   then what travels (sync/delta.hpp). Receivers stage it, check every tensor, then apply it: on any
//   failure the module keeps its previous weights.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <array>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/memory/host.hpp>
#include <fsdpx/core/model_ref.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/weights.hpp>
#include <fsdpx/sync/detail/receive.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/detail/broadcast_wire.hpp>
#include <fsdpx/sync/detail/held_version.hpp>

namespace fsdpx::sync {

/// The concept weight sync took a model by before every call took a ShardedModelRef (2026-12): now
/// fsdpx::ShardedModelLike.
template <class F>
concept HasShardedModel = ShardedModelLike<F>;

// ---- groups ---------------------------------------------------------------------------------------

/// The world split for RL: trainers are world ranks [0, trainers), rollouts [trainers, world size).
struct TrainerRolloutGroups {
  int trainers = 0;
  std::optional<dist::AnyCommunicator> trainer;       // on trainer ranks: build the Fsdp model over it
  std::optional<dist::AnyCommunicator> rollout;       // on rollout ranks
  std::optional<dist::AnyCommunicator> model_update;  // on trainer rank 0 (its rank 0) and every rollout
  bool is_trainer() const { return trainer.has_value(); }
};

/// Collective over `world`: every rank calls it with the same `trainers`.
FSDPX_DECL TrainerRolloutGroups split_trainer_rollout(const dist::AnyCommunicator& world, int trainers);

// ---- the trainer side: gathering ------------------------------------------------------------------

namespace detail {

/// Runs `fn(unit)` for every unit of `model` in order, each unsharded meanwhile, with the next unit's
/// gather in flight. Collective over the trainer ranks. Units unsharded before the call stay so; the
/// others are resharded after their turn, so at most two units are full at a time.
template <class Fn>
void for_each_unsharded_unit(core::ShardedModel& model, Fn&& fn) {
  const size_t n = model.num_units();
  std::vector<bool> keep(n);
  for (size_t i = 0; i < n; ++i) keep[i] = model.unit(i).is_unsharded();
  for (size_t i = 0; i < n; ++i) {
    core::Unit& u = model.unit(i);
    u.unshard();
    if (i + 1 < n) model.unit(i + 1).unshard_async();
    fn(u);
    if (!keep[i]) u.reshard();
  }
}

/// The module's buffers (running statistics, rotary tables, counters: replicated, so any rank's are
/// everyone's), by name. They travel with every version in their own dtype, exactly; a receiver casts
/// them to its module's dtype on loading.
FSDPX_DECL std::vector<NamedTensor> module_buffers(const core::ShardedModel& model);

}  // namespace detail

struct GatherOptions {
  std::optional<at::ScalarType> dtype;  // default: each unit's compute dtype
  at::Device device = at::kCPU;
};

/// The full parameters (on `device`, cast to `dtype`), in unit order, then the buffers (on `device`,
/// in their own dtype), all as fresh tensors. Collective over the trainer ranks; only ranks with
/// `collect` keep anything (the others return nothing).
FSDPX_DECL std::vector<NamedTensor> gather_full_state_dict(ShardedModelRef model, bool collect,
                                                           const GatherOptions& options = {});

// ---- the trainer side: broadcasting ---------------------------------------------------------------

struct BroadcastOptions {
  /// Capacity of each of the two buckets (header included). Larger buckets mean fewer collectives;
  /// a tensor larger than a bucket is split.
  int64_t bucket_bytes = int64_t{32} << 20;
  /// The rollout dtype; default: each unit's compute dtype.
  std::optional<at::ScalarType> dtype;
  /// Deprecated, for one release: tuning.keep_gather_buffers and tuning.direct_bytes spelled flat; each
  /// one set here wins over its twin. (Not marked [[deprecated]]: GCC then warns wherever a BroadcastOptions
  /// is made with designated initializers, naming these fields or not.)
  std::optional<bool> keep_gather_buffers;
  std::optional<int64_t> direct_bytes;
  /// Each version's manifest travels (a CRC-32C per tensor, computed by the sending rank; on a GPU
  /// through host copies of each unit), and receivers check what arrived against it.
  bool checksums = true;
  /// Cut versions: the sending rank keeps a host copy of the version it sent last (the model's size in
  /// the wire dtype) and sends the next as the delta from it, when every receiver holds it. Off
  /// (std::nullopt): every version streamed whole from the gather buffers, which is faster where the
  /// link moves bytes faster than a pass over the host copies compares them (NVLink, InfiniBand,
  /// shared memory); deltas pay off over slow links. Only the sending rank's value matters.
  /// The two give a receiver different guarantees on a failure: streamed writes into the module as the
  /// version arrives and checks it after (a failure midway is a SyncError once the module changed, which
  /// says so, and WeightReceiver::last_version() is no_version until the next version repairs it); cut
  /// stages and checks every tensor first (the module keeps its weights, bit for bit).
  std::optional<DeltaOptions> delta;

  /// Advanced: how the bytes move, not what arrives. The defaults are the fastest measured on CPU ranks
  /// (docs/sync.md, "Measured").
  struct Tuning {
    /// Gather each unit to the sending rank only, already cast to the rollout dtype by each rank, into
    /// two buffers the broadcaster keeps there (the size of the largest unit), instead of through the
    /// unit's own unshard() on every rank, which allocates and frees the full parameters every time (on
    /// the CPU: page faults on every byte, which cost more than the broadcast itself; docs/sync.md,
    /// "Measured"). The sending rank's own shard is read in place when it already is in the rollout
    /// dtype. Same values, bit for bit (the same casts of the same shards). false: no memory is kept
    /// between syncs. Must agree on all trainer ranks.
    bool keep_gather_buffers = true;
    /// Chunks of at least this many bytes travel in a broadcast of their own: sent straight from the
    /// gather buffer or the sending rank's shard (keep_gather_buffers) and received straight into the
    /// rollout's parameter (or tensor) when its dtype matches. Smaller ones are packed together, in one
    /// broadcast per run. Only the sender sets it (it travels in the preamble).
    int64_t direct_bytes = int64_t{64} << 10;
  };
  Tuning tuning = {};
};

class WeightBroadcaster {
 public:
  /// `update_group`: the model-update group on trainer rank 0 (where this process must be rank 0, the
  /// root), std::nullopt on the other trainer ranks.
  /// `model`: an fsdpx::Fsdp<...> or its core::ShardedModel.
  FSDPX_DECL WeightBroadcaster(ShardedModelRef model, std::optional<dist::AnyCommunicator> update_group,
                               BroadcastOptions options = {});

  bool is_sender() const { return group_.has_value(); }
  int64_t last_version() const { return last_version_; }

  struct Stats {
    int64_t bytes = 0;  // bucket bytes sent (headers included)
    int64_t buckets = 0;
    double seconds = 0;            // the whole broadcast(), gathers included
    double send_wait_seconds = 0;  // waiting for broadcasts before refilling a staging bucket or gather buffer
    int64_t bytes_in_place = 0;    // payload sent straight from the gather buffers, without a copy
    bool delta = false;            // cut versions: sent as the delta from the version before
    int64_t full_bytes = 0;        // cut versions: the bytes of the version's tensors (what whole sends)
  };
  const Stats& last_stats() const { return stats_; }
  /// Whether the last version went as a delta (cut versions only): every receiver's last_was_delta().
  bool last_was_delta() const { return stats_.delta; }

  /// Sends the current weights as `version` (e.g. the training step; strictly increasing). Collective:
  /// every trainer rank (the gathers) and every rank of the model-update group (the broadcast).
  FSDPX_DECL void broadcast(int64_t version);

 private:
  // One version on the wire (sync/detail/broadcast_wire.hpp describes it).
  FSDPX_DECL void send(int64_t version);
  /// A streamed version: the units' parameters as they are gathered, then its manifest.
  FSDPX_DECL void send_streamed(int64_t version);
  /// A cut version: every unit's parameters (and the buffers) to host copies in the wire dtype, cut
  /// against base_ (a delta when `receivers_hold` it), sent as tensors, then base_ holds it.
  FSDPX_DECL void send_cut(int64_t version, bool receivers_hold);
  /// Plans `specs` into buckets, encodes their headers (on the device), and sends the preamble (with
  /// `direct_bytes`) and the header sizes; the staging buckets then fit the largest bucket.
  struct Planned {
    std::vector<detail::BucketLayout> plan;
    std::vector<at::Tensor> headers;  // each bucket's, kept until the version is sent
  };
  FSDPX_DECL Planned plan_and_send_preamble(const std::vector<detail::TensorSpec>& specs, int64_t version,
                                            int64_t direct_bytes);
  /// Sends whole tensors (host or device) through the two staging buckets: the preamble, the header
  /// sizes, then per bucket its header and payload.
  FSDPX_DECL void send_tensors(int64_t version, const std::vector<NamedTensor>& tensors);

  /// Where a unit's full flat parameters (in the wire dtype) lie on the sending rank during its turn.
  struct UnitData {
    at::Tensor gathered{};               // the unit's padded flat buffer, being gathered
    const dist::Work* gather = nullptr;  // that gather, waited for before `gathered` is read
    at::Tensor own{};                    // this rank's shard read in place: elements [own_begin, own_end)
    int64_t own_begin = 0, own_end = 0;
    bool lasting = false;  // valid until before_gather(slot); false: read the parameters instead
    /// Elements [begin, begin + numel) (on one side of the own range's edges) and whether they lie in
    /// the gather buffer. Only these wait for the gather: the own shard goes out while it runs.
    std::pair<at::Tensor, bool> range(int64_t begin, int64_t numel) const {
      if (own.defined() && begin >= own_begin && begin + numel <= own_end) {
        return {own.narrow(0, begin - own_begin, numel), false};
      }
      if (gather != nullptr) gather->wait_stream();
      return {gathered.narrow(0, begin, numel), true};
    }
  };

  /// The elements of `u` this rank's shard covers when it is read in place (already in the wire
  /// dtype, on the device): the plan breaks chunks at its edges. {0, 0} otherwise.
  FSDPX_DECL std::pair<int64_t, int64_t> own_range(const core::Unit& u) const;
  at::ScalarType wire_dtype(const core::Unit& u) const { return options_.dtype.value_or(u.options().param_dtype); }
  /// The shard already is what the rollout receives: no cast on the way (through the compute dtype
  /// either: a narrower compute dtype rounds), on the device.
  FSDPX_DECL bool shard_in_place(const core::Unit& u) const;
  /// `into` <- this rank's shard as the rollout receives it: cast to the compute dtype, as unshard()
  /// does, then to the wire dtype. Each rank casts its own shard, so the gather moves wire bytes and
  /// the sending rank casts only its own part.
  FSDPX_DECL void cast_shard(const core::Unit& u, const at::Tensor& into) const;

  /// Runs fn(gather slot, unit, data) for every unit in order where the full parameters are: on the
  /// sending rank (keep_gather_buffers), or on every trainer rank (through the units' own unshard()).
  /// Gathers run one unit ahead, into the other of two slots; before_gather(slot) runs before a slot
  /// is overwritten, so that whatever still reads it can finish. Collective over the trainer ranks.
  template <class Before, class Fn>
  void walk_units(Before&& before_gather, Fn&& fn) {
    if (!gather_) {
      // The module's parameters are valid while their unit is unsharded (not after fn returns).
      detail::for_each_unsharded_unit(*model_, [&](core::Unit& u) { fn(0, u, UnitData{}); });
      return;
    }
    if (gather_root_ < 0) return;  // the sending rank is in another shard group
    const size_t n = model_->num_units();
    const int W = gather_->size(), r = gather_->rank();
    const bool root = r == gather_root_;
    // The root keeps two full units (its own shard inside them only when it needs a cast); the others
    // two cast shards, when a cast is needed.
    int64_t need = 0;
    for (size_t i = 0; i < n; ++i) {
      const core::Unit& u = model_->unit(i);
      if (root && W > 1) need = std::max(need, u.layout().padded_numel());
      if (!shard_in_place(u)) need = std::max(need, root ? u.layout().padded_numel() : u.layout().shard_numel());
    }
    const core::UnitOptions& uo = model_->unit(0).options();
    const at::ScalarType wire = wire_dtype(model_->unit(0));
    if (need > 0 && (!gathered_[0].defined() || gathered_[0].numel() < need || gathered_[0].scalar_type() != wire)) {
      for (auto& g : gathered_) g = memory::empty_buffer(need, at::TensorOptions().dtype(wire).device(uo.device));
    }
    std::array<dist::Work, 2> gathering;
    const auto start = [&](size_t i) {
      const int slot = static_cast<int>(i % 2);
      before_gather(slot);
      const core::Unit& u = model_->unit(i);
      const int64_t S = u.layout().shard_numel();
      const bool in_place = shard_in_place(u);
      if (root) {
        at::Tensor full = need > 0 ? gathered_[slot].narrow(0, 0, u.layout().padded_numel()) : at::Tensor();
        if (!in_place) cast_shard(u, full.narrow(0, r * S, S));
        if (W > 1) gathering[slot] = gather_->gather_async(full, full.narrow(0, r * S, S), r);
      } else {
        at::Tensor input = u.shard();
        if (!in_place) {
          input = gathered_[slot].narrow(0, 0, S);
          cast_shard(u, input);
        }
        gathering[slot] = gather_->gather_async(at::Tensor(), input, gather_root_);
      }
    };
    if (n > 0) start(0);
    for (size_t i = 0; i < n; ++i) {
      const int slot = static_cast<int>(i % 2);
      if (root) {
        core::Unit& u = model_->unit(i);
        UnitData data{.lasting = true};
        if (need > 0) data.gathered = gathered_[slot].narrow(0, 0, u.layout().padded_numel());
        data.gather = &gathering[slot];
        std::tie(data.own_begin, data.own_end) = own_range(u);
        if (data.own_end > data.own_begin) data.own = u.shard();
        fn(slot, u, data);
      }
      gathering[slot].wait_stream();
      // The next gather starts once unit i is posted: it overlaps unit i's broadcasts.
      if (i + 1 < n) start(i + 1);  // into the slot unit i - 1 used, once it is sent
    }
  }

  /// Calls fn(piece) for consecutive pieces of parameter `p`'s elements in the wire dtype, in order,
  /// from where they lie during the unit's turn (the gather buffer, this rank's own shard or, without
  /// gather buffers, the parameter itself, cast).
  template <class Fn>
  void for_each_piece(const core::Unit& u, const core::ParamInfo& p, const UnitData& data, Fn&& fn) const {
    if (!data.lasting) return fn(p.param.detach().reshape({-1}).to(wire_dtype(u)));
    std::array<int64_t, 4> cuts{p.offset, std::clamp(data.own_begin, p.offset, p.offset + p.numel),
                                std::clamp(data.own_end, p.offset, p.offset + p.numel), p.offset + p.numel};
    if (data.own_end <= data.own_begin) cuts[1] = cuts[2] = p.offset;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      if (cuts[i + 1] > cuts[i]) fn(data.range(cuts[i], cuts[i + 1] - cuts[i]).first);
    }
  }

  FSDPX_DECL void ensure_buffers(int64_t bytes, c10::Device device);

  static constexpr int lasting_tag = 2, gather_tag = 3;

  core::ShardedModel* model_;
  std::optional<dist::AnyCommunicator> group_;
  BroadcastOptions options_;
  int64_t last_version_ = no_version;
  std::optional<dist::AnyCommunicator> gather_;  // with keep_gather_buffers
  int gather_root_ = -1;                         // the sending rank in gather_; -1: not in this group
  std::array<at::Tensor, 2> gathered_;           // root: full units; others: cast shards (wire dtype)
  std::array<at::Tensor, 2> buffers_;            // buckets (sender only)
  detail::VersionStore base_;                    // cut versions: what was sent last (sender only)
  bool preamble_sent_ = false;                   // this version's preamble went out (no abort possible)
  Stats stats_;
};

// ---- the rollout side -----------------------------------------------------------------------------

struct ReceiveOptions {
  /// Where the buckets land (and receive() allocates): the update group's device (a CUDA device with NCCL).
  at::Device device = at::kCPU;
  /// The sender's rank in the model-update group.
  int root = 0;
};

class WeightReceiver {
 public:
  // A template whose first check rules out WeightReceiver itself: checking a plain AnyCommunicator
  // parameter would ask whether a WeightReceiver is a Communicator while copying one (a cycle).
  template <class Comm>
    requires(!std::same_as<std::remove_cvref_t<Comm>, WeightReceiver> &&
             std::constructible_from<dist::AnyCommunicator, Comm>)
  explicit WeightReceiver(Comm&& update_group, ReceiveOptions options = {})
      : group_(std::forward<Comm>(update_group)), options_(options) {
    FSDPX_CHECK(options_.device.type() == group_.device_type(), "WeightReceiver: buckets on ", options_.device,
                " but the model-update group (", group_.backend_name(), ") works on ",
                c10::DeviceTypeName(group_.device_type(), true), " tensors; set ReceiveOptions::device");
    FSDPX_CHECK(options_.root >= 0 && options_.root < group_.size() && options_.root != group_.rank(),
                "WeightReceiver: root ", options_.root, " must be another rank of the model-update group '",
                group_.name(), "' (size ", group_.size(), ", this rank ", group_.rank(), ")");
  }

  /// Receives the next version into `module`'s parameters by name (names and shapes must match; what
  /// does not is reported, after the whole version was received). Returns the version. Every tensor is
  /// checked against the version's manifest (when the sender sends one). A streamed version lands in
  /// the module as it arrives; a cut version is staged and checked first, and a delta lands in place
  /// when the module holds the version before (the module keeps its weights on any failure).
  FSDPX_DECL int64_t receive_into(torch::nn::Module& module);

  /// Receives the next version as tensors (on ReceiveOptions::device), with its manifest. A delta is
  /// applied to fresh copies of the tensors it touches (snapshots returned before never change).
  FSDPX_DECL WeightVersion receive();

  /// "Do I hold the version received last, exactly?": every tensor's CRC-32C against its manifest.
  void verify(torch::nn::Module& module) const { held_.verify(module); }
  void verify(const std::vector<NamedTensor>& tensors) const { held_.verify(tensors); }

  /// The version the module (or the tensors handed out) holds whole; no_version after a streamed
  /// version failed midway (the module then holds parts of two versions until the next one arrives).
  int64_t last_version() const { return last_version_; }
  /// Payload bytes of the last version received straight into their destination (no unpacking copy).
  int64_t last_bytes_in_place() const { return bytes_in_place_; }
  /// Whether the last version came as a delta.
  bool last_was_delta() const { return last_was_delta_; }

 private:
  /// Runs fn (one version's reception), turning a transport's failure into a SyncError with context.
  template <class Fn>
  auto translating(Fn&& fn) {
    try {
      return fn();
    } catch (const SyncError& e) {
      if (streaming_into_module_ == no_version) throw;
      throw SyncError(::fsdpx::detail::str(e.what(), torn_module()));
    } catch (const Error& e) {
      throw SyncError(::fsdpx::detail::str("fsdpx: receiving weights from the trainer over '", group_.name(),
                                           "' (rank ", group_.rank(), " of ", group_.size(), ", last version ",
                                           last_version_,
                                           ") failed; the sending trainer rank may have exited or "
                                           "crashed: ",
                                           e.what(), torn_module()));
    }
  }
  /// After a streamed version failed midway: says so, and that the module holds no whole version.
  std::string torn_module() {
    if (streaming_into_module_ == no_version) return {};
    const int64_t version = std::exchange(streaming_into_module_, no_version);
    const int64_t before = std::exchange(last_version_, no_version);
    return ::fsdpx::detail::str(
        ". The module was being written as version ", version,
        " arrived (a streamed version): it now holds parts of it and of version ", before,
        ", and no whole version until the next one arrives (BroadcastOptions::delta stages each version and "
        "keeps the module's weights on any failure)");
  }

  /// The next version's announcement (the first broadcast of every version), checked.
  FSDPX_DECL detail::Announcement read_announcement();
  /// A cut version naming a base: says whether this receiver holds it (an all-reduce with the sender).
  FSDPX_DECL void vote(const detail::Announcement& a);
  /// A cut version as collected, its manifest first (the order the rest of it keeps does not matter).
  FSDPX_DECL std::vector<NamedTensor> in_wire_order(std::vector<NamedTensor> collected) const;
  /// A streamed version's manifest, after its buckets: `expected_bytes` long (its tensors arrived).
  FSDPX_DECL Manifest receive_manifest(int64_t version, int64_t expected_bytes);
  std::string where() const { return ::fsdpx::detail::str("the trainer over '", group_.name(), "'"); }

  /// The buckets of `version` (announced), each chunk handed to `sink`: in order within each tensor.
  template <class Sink>
  void receive_buckets(Sink& sink, int64_t version) {
    const auto longs = at::TensorOptions().dtype(at::kLong).device(options_.device);
    auto pre = at::zeros({detail::preamble_longs}, longs);
    group_.broadcast(pre, options_.root);
    pre = pre.cpu();
    const int64_t* p = pre.data_ptr<int64_t>();
    FSDPX_CHECK_AS(SyncError, p[0] == detail::preamble_magic && p[1] == version, "the model-update group '",
                   group_.name(), "' delivered something that is not the preamble of version ", version,
                   ": its ranks disagree about what is being sent (are both sides built from the same fsdpx?)");
    FSDPX_CHECK_AS(SyncError, p[2] != detail::aborted_version, "the trainer could not send version ", version,
                   " (it failed after announcing it, before sending any of it; its own error says why): nothing "
                   "was received");
    const int64_t n = p[2], largest_header = p[3], direct_bytes = p[4], largest = p[5];
    bytes_in_place_ = 0;
    FSDPX_CHECK_AS(
        SyncError,
        n >= 0 && direct_bytes > 0 && largest >= largest_header && (n == 0 || largest_header >= detail::prefix_bytes),
        "corrupt weight-sync preamble: ", n, " buckets of at most ", largest, " bytes, headers of at most ",
        largest_header, " bytes");
    std::vector<int64_t> header_sizes(static_cast<size_t>(n));
    if (n > 0) {
      auto s = at::empty({n}, longs);
      group_.broadcast(s, options_.root);
      s = s.cpu();
      std::copy_n(s.data_ptr<int64_t>(), n, header_sizes.begin());
    }
    const auto bytes = at::TensorOptions().dtype(at::kByte).device(options_.device);
    if (!buffers_[0].defined() || buffers_[0].numel() < largest) {
      for (auto& b : buffers_) b = memory::empty_buffer(std::max<int64_t>(largest, 1), bytes);
    }
    if (!headers_[0].defined() || headers_[0].numel() < largest_header) {
      for (auto& h : headers_) h = at::empty({std::max<int64_t>(largest_header, 1)}, bytes);
    }
    // Per bucket in flight: its broadcasts, and what to do with each entry once they are done.
    struct InFlight {
      detail::BucketLayout layout;
      std::vector<dist::Work> works;
      std::vector<size_t> staged, direct;  // entries to unpack from the staging bucket / received in place
    };
    std::array<InFlight, 2> flight;
    const auto finish = [&](int64_t k) {  // bucket k's data is in place: hand it to the sink
      if (k < 0 || k >= n) return;
      InFlight& f = flight[k % 2];
      for (auto& w : f.works) w.wait_stream();
      // In entry order (both lists ascend): a tensor's chunks reach the sink in order.
      size_t d = 0, st = 0;
      while (d < f.direct.size() || st < f.staged.size()) {
        if (st == f.staged.size() || (d < f.direct.size() && f.direct[d] < f.staged[st])) {
          sink.accepted(f.layout.entries[f.direct[d++]]);
        } else {
          const detail::BucketEntry& e = f.layout.entries[f.staged[st++]];
          sink.accept(e, detail::entry_view(buffers_[k % 2], e));
        }
      }
      f = InFlight{};
    };
    const auto post_header = [&](int64_t k) {
      return k < n ? group_.broadcast_async(headers_[k % 2].narrow(0, 0, header_sizes[k]), options_.root)
                   : dist::Work();
    };
    const std::string where = ::fsdpx::detail::str("broadcast over '", group_.name(), "'");
    dist::Work header = post_header(0);
    for (int64_t k = 0; k < n; ++k) {
      header.wait_stream();
      detail::BucketLayout layout = read_header(headers_[k % 2].narrow(0, 0, header_sizes[k]), where);
      FSDPX_CHECK_AS(SyncError,
                     layout.version == version && layout.index == k && layout.count == n &&
                         layout.header_bytes == header_sizes[k] && layout.total_bytes <= largest,
                     "weight bucket out of order: expected bucket ", k, " of ", n, " of version ", version,
                     " (header of ", header_sizes[k], " bytes), got bucket ", layout.index, " of ", layout.count,
                     " of version ", layout.version, " (header of ", layout.header_bytes, " bytes, ",
                     layout.total_bytes, " in all)");
      finish(k - 2);  // its staging bucket is reused now
      InFlight& f = flight[k % 2];
      for (size_t i = 0; i < layout.entries.size(); ++i) {
        if (layout.entries[i].nbytes() == 0)
          sink.accept(layout.entries[i], detail::entry_view(buffers_[k % 2], layout.entries[i]));
      }
      for (const detail::Segment& sg : detail::segments_of(layout, direct_bytes)) {
        at::Tensor into;
        if (sg.single()) into = sink.destination(layout.entries[sg.first]);
        if (into.defined() && into.device() == options_.device && into.is_contiguous()) {
          f.works.push_back(group_.broadcast_async(detail::as_bytes(into), options_.root));
          f.direct.push_back(sg.first);
          bytes_in_place_ += layout.entries[sg.first].nbytes();
        } else {
          f.works.push_back(
              group_.broadcast_async(buffers_[k % 2].narrow(0, sg.begin, sg.end - sg.begin), options_.root));
          for (size_t i = sg.first; i <= sg.last; ++i) f.staged.push_back(i);
        }
      }
      f.layout = std::move(layout);
      header = post_header(k + 1);
    }
    finish(n - 2);
    finish(n - 1);
  }

  FSDPX_DECL static detail::BucketLayout read_header(const at::Tensor& bucket, const std::string& where);

  dist::AnyCommunicator group_;
  ReceiveOptions options_;
  int64_t last_version_ = no_version;
  int64_t streaming_into_module_ = no_version;  // a streamed version being written into a module
  std::array<at::Tensor, 2> buffers_;           // staging buckets
  std::array<at::Tensor, 2> headers_;
  int64_t bytes_in_place_ = 0;
  bool last_was_delta_ = false;
  detail::HeldVersion held_;  // the version received last (a delta's base), or its manifest
};

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/broadcast.ipp>
#endif
