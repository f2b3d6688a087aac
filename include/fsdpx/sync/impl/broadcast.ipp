// Out-of-line functions of fsdpx/sync/broadcast.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/broadcast.hpp>

#include <algorithm>
#include <limits>
#include <string_view>
#include <unordered_map>

namespace fsdpx::sync {

FSDPX_DECL TrainerRolloutGroups split_trainer_rollout(const dist::AnyCommunicator& world, int trainers) {
  FSDPX_CHECK(trainers >= 1 && trainers < world.size(), "split_trainer_rollout: ", trainers,
              " trainer ranks in a world of ", world.size(), "; need at least one trainer and one rollout rank");
  const int r = world.rank();
  const bool trainer = r < trainers;
  TrainerRolloutGroups g;
  g.trainers = trainers;
  auto role = world.split(trainer ? 0 : 1, r, trainer ? "trainer" : "rollout");
  (trainer ? g.trainer : g.rollout) = std::move(role);
  // World rank 0 gets update rank 0: the broadcast's root.
  g.model_update = world.split(r == 0 || !trainer ? 0 : dist::no_color, r, "model_update");
  return g;
}

namespace detail {

FSDPX_DECL std::vector<NamedTensor> module_buffers(const core::ShardedModel& model) {
  std::vector<NamedTensor> out;
  for (const auto& [name, buffer] : model.named_buffers()) out.push_back({name, buffer.detach()});
  return out;
}

}  // namespace detail

FSDPX_DECL std::vector<NamedTensor> gather_full_state_dict(ShardedModelRef model_ref, bool collect,
                                                           const GatherOptions& options) {
  core::ShardedModel& model = *model_ref;
  std::vector<NamedTensor> out;
  detail::for_each_unsharded_unit(model, [&](core::Unit& u) {
    if (!collect) return;
    for (const auto& p : u.layout().params()) {
      // copy=true: the parameter is a view of a buffer the next reshard frees.
      out.push_back({p.name, p.param.detach().to(options.device, options.dtype.value_or(u.options().param_dtype),
                                                 /*non_blocking=*/false, /*copy=*/true)});
    }
  });
  if (collect) {
    for (auto& b : detail::module_buffers(model)) {
      out.push_back({std::move(b.name), b.tensor.to(options.device, /*non_blocking=*/false, /*copy=*/true)});
    }
  }
  return out;
}

FSDPX_DECL WeightBroadcaster::WeightBroadcaster(ShardedModelRef model_ref,
                                                std::optional<dist::AnyCommunicator> update_group,
                                                BroadcastOptions options)
    : model_(&*model_ref), group_(std::move(update_group)), options_(options) {
  core::ShardedModel& model = *model_ref;
  // The deprecated flat spellings, where set, into `tuning` (the one place the broadcaster reads).
  if (options_.keep_gather_buffers) options_.tuning.keep_gather_buffers = *options_.keep_gather_buffers;
  if (options_.direct_bytes) options_.tuning.direct_bytes = *options_.direct_bytes;
  if (options_.tuning.keep_gather_buffers) {
    // Collective over the shard group (every trainer rank constructs a broadcaster): a duplicate of
    // it, so these gathers never interleave with the model's own.
    auto& shard = model.mesh().shard_group();
    gather_ = shard.split(0, shard.rank(), "fsdpx/sync_gather");
    // The gathers go to the sending rank only; shard groups without it (other replicas) sit out.
    auto root = at::full({1}, group_ ? gather_->rank() : -1,
                         at::TensorOptions().dtype(at::kLong).device(model.unit(0).options().device));
    gather_->all_reduce(root, dist::ReduceOp::max);
    gather_root_ = static_cast<int>(root.item<int64_t>());
  }
  FSDPX_CHECK(options_.bucket_bytes >= 4096, "WeightBroadcaster: bucket_bytes must be at least 4096, got ",
              options_.bucket_bytes);
  FSDPX_CHECK(options_.tuning.direct_bytes >= 1, "WeightBroadcaster: direct_bytes must be positive, got ",
              options_.tuning.direct_bytes);
  if (group_) {
    FSDPX_CHECK(group_->rank() == 0, "WeightBroadcaster: this trainer rank is rank ", group_->rank(),
                " of the model-update group '", group_->name(), "'; the sending trainer rank must be its rank 0");
    const c10::Device device = model.unit(0).options().device;
    FSDPX_CHECK(device.type() == group_->device_type(), "WeightBroadcaster: the model computes on ", device,
                " but the model-update group (", group_->backend_name(), ") works on ",
                c10::DeviceTypeName(group_->device_type(), true), " tensors");
  }
}

FSDPX_DECL void WeightBroadcaster::broadcast(int64_t version) {
  FSDPX_CHECK_AS(SyncError, version > last_version_, "weight sync: version ", version,
                 " is not newer than the last version sent, ", last_version_, "; versions must increase");
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  stats_ = {};
  try {
    if (!group_) {
      walk_units([](int) {}, [](int, core::Unit&, const UnitData&) {});
    } else {
      send(version);
    }
  } catch (const SyncError&) {
    throw;
  } catch (const Error& e) {
    throw SyncError(::fsdpx::detail::str("fsdpx: weight sync of version ", version, " failed on the trainer side",
                                         group_ ? " (sending rank)" : "", ": ", e.what()));
  }
  last_version_ = version;
  stats_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
}

FSDPX_DECL void WeightBroadcaster::send(int64_t version) {
  const auto longs = at::TensorOptions().dtype(at::kLong).device(model_->unit(0).options().device);
  const bool cut = options_.delta.has_value();
  const Manifest* base = cut && !base_.empty() ? &base_.manifest() : nullptr;
  group_->broadcast(
      at::tensor(
          {detail::announce_magic, version, int64_t{cut ? detail::Announcement::cut : detail::Announcement::streamed},
           base ? base->version : no_version, int64_t{base ? base->digest : 0u}, int64_t{options_.checksums ? 1 : 0}},
          at::kLong)
          .to(longs),
      0);
  preamble_sent_ = false;
  try {
    if (!cut) return send_streamed(version);
    bool receivers_hold = false;
    if (base != nullptr) {
      auto hold = at::ones({1}, longs);
      group_->all_reduce(hold, dist::ReduceOp::min);
      receivers_hold = hold.item<int64_t>() == 1;
    }
    send_cut(version, receivers_hold);
  } catch (...) {
    // Failed after the announcement, before the preamble: the receivers are told, and stay in step.
    if (!preamble_sent_) {
      group_->broadcast(
          at::tensor(std::vector<int64_t>{detail::preamble_magic, version, detail::aborted_version, 0, 1, 0}, at::kLong)
              .to(longs),
          0);
    }
    throw;
  }
}

FSDPX_DECL void WeightBroadcaster::send_cut(int64_t version, bool receivers_hold) {
  std::vector<NamedTensor> current;
  walk_units([](int) {},
             [&](int, core::Unit& u, const UnitData& data) {
               for (const auto& p : u.layout().params()) {
                 at::Tensor host = at::empty(p.shape, at::TensorOptions().dtype(wire_dtype(u)));
                 at::Tensor flat = host.view({-1});
                 int64_t filled = 0;
                 for_each_piece(u, p, data, [&](const at::Tensor& piece) {
                   flat.narrow(0, filled, piece.numel()).copy_(piece);
                   filled += piece.numel();
                 });
                 current.push_back({p.name, std::move(host)});
               }
             });
  for (auto& b : detail::module_buffers(*model_)) {
    current.push_back({std::move(b.name), b.tensor.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous()});
  }
  if (!receivers_hold) base_.clear();  // some receiver lacks the base: the version goes whole
  detail::EncodedVersion v = base_.cut(version, current, *options_.delta);
  stats_.delta = v.manifest.is_delta();
  stats_.full_bytes = v.full_bytes;
  send_tensors(version, v.tensors);
  base_.commit(std::move(v));
}

FSDPX_DECL void WeightBroadcaster::send_tensors(int64_t version, const std::vector<NamedTensor>& tensors) {
  std::vector<detail::TensorSpec> specs;
  std::unordered_map<std::string_view, const at::Tensor*> by_name;
  for (const auto& t : tensors) {
    specs.push_back({t.name, t.tensor.sizes().vec(), t.tensor.scalar_type()});
    by_name.emplace(t.name, &t.tensor);
  }
  // The tensors lie on the host: every chunk goes through a staging bucket (one broadcast per run).
  constexpr int64_t staged_only = std::numeric_limits<int64_t>::max();
  const Planned planned = plan_and_send_preamble(specs, version, staged_only);
  const auto& plan = planned.plan;
  const auto& headers = planned.headers;
  const int64_t n = static_cast<int64_t>(plan.size());
  std::array<std::vector<dist::Work>, 2> pending;  // per staging bucket
  std::vector<dist::Work> sent_headers;
  for (int64_t k = 0; k < n; ++k) {
    for (auto& w : pending[k % 2]) w.wait_stream();  // the staging bucket is free again
    pending[k % 2].clear();
    sent_headers.push_back(group_->broadcast_async(headers[k], 0));
    for (const detail::BucketEntry& e : plan[k].entries) {
      if (e.numel > 0) detail::pack_entry(buffers_[k % 2], e, *by_name.at(e.name));
    }
    for (const detail::Segment& sg : detail::segments_of(plan[k], staged_only)) {
      pending[k % 2].push_back(group_->broadcast_async(buffers_[k % 2].narrow(0, sg.begin, sg.end - sg.begin), 0));
    }
  }
  for (auto& slot : pending) {
    for (auto& w : slot) w.wait_stream();
  }
  for (auto& w : sent_headers) w.wait_stream();
}

FSDPX_DECL void WeightBroadcaster::send_streamed(int64_t version) {
  using Clock = std::chrono::steady_clock;
  std::vector<detail::TensorSpec> specs;
  for (size_t i = 0; i < model_->num_units(); ++i) {
    const core::Unit& u = model_->unit(i);
    const auto [own_begin, own_end] = own_range(u);
    for (const auto& p : u.layout().params()) {
      detail::TensorSpec s{p.name, p.shape, wire_dtype(u)};
      // A chunk never spans the edge of this rank's own shard, which is read from elsewhere.
      for (const int64_t edge : {own_begin, own_end}) {
        if (edge > p.offset && edge < p.offset + p.numel) s.breaks.push_back(edge - p.offset);
      }
      specs.push_back(std::move(s));
    }
  }
  const std::vector<NamedTensor> buffers = detail::module_buffers(*model_);
  for (const auto& b : buffers) specs.push_back({b.name, b.tensor.sizes().vec(), b.tensor.scalar_type()});
  const Planned planned = plan_and_send_preamble(specs, version, options_.tuning.direct_bytes);
  const auto& plan = planned.plan;
  const auto& headers = planned.headers;
  const int64_t n = static_cast<int64_t>(plan.size());
  const c10::Device device = model_->unit(0).options().device;
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  std::vector<std::vector<detail::Segment>> segments;
  for (const auto& b : plan) segments.push_back(detail::segments_of(b, options_.tuning.direct_bytes));

  // Broadcasts in flight, each tagged with the memory it reads: staging bucket 0/1, memory that stays
  // (lasting_tag: headers, the rank's own shard), or gather slot s (gather_tag + s).
  std::vector<std::pair<int, dist::Work>> pending;
  const auto release = [&](int tag) {
    const auto w0 = Clock::now();
    for (auto& [t, w] : pending) {
      if (t == tag) w.wait_stream();
    }
    std::erase_if(pending, [&](const auto& p) { return p.first == tag; });
    stats_.send_wait_seconds += std::chrono::duration<double>(Clock::now() - w0).count();
  };
  int64_t k = 0;   // the bucket being filled
  size_t e = 0;    // its next entry
  size_t seg = 0;  // its next segment
  const auto begin_bucket = [&] {
    if (k >= n) return;
    release(static_cast<int>(k % 2));  // the staging bucket's previous broadcasts must be done
    pending.emplace_back(lasting_tag, group_->broadcast_async(headers[k], 0));
  };
  // `direct`: the entry just done, when it goes out from where it lies (tag: what it reads).
  const auto send_segments = [&](const at::Tensor& direct, int direct_tag) {
    // Every segment whose last entry is done goes out, in order.
    while (seg < segments[k].size() && segments[k][seg].last < e) {
      const detail::Segment& sg = segments[k][seg];
      if (sg.single() && sg.first + 1 == e && direct.defined()) {
        pending.emplace_back(direct_tag, group_->broadcast_async(detail::as_bytes(direct), 0));
        stats_.bytes_in_place += direct.nbytes();
      } else {
        pending.emplace_back(static_cast<int>(k % 2),
                             group_->broadcast_async(buffers_[k % 2].narrow(0, sg.begin, sg.end - sg.begin), 0));
      }
      ++seg;
    }
  };
  // Packs (or sends in place) every chunk of the tensor `name`: the plan lists them consecutively,
  // possibly over several buckets. chunk_of(entry) -> {chunk, whether it goes out from where it lies,
  // the tag of the memory it reads}.
  const auto send_tensor = [&](const std::string& name, auto&& chunk_of) {
    while (k < n && e < plan[k].entries.size() && plan[k].entries[e].name == name) {
      const detail::BucketEntry& entry = plan[k].entries[e];
      const auto [chunk, direct, tag] = chunk_of(entry);
      if (!direct && entry.numel > 0) detail::entry_view(buffers_[k % 2], entry).copy_(chunk);
      ++e;
      send_segments(direct ? chunk : at::Tensor(), tag);
      if (e == plan[k].entries.size()) {
        ++k;
        e = 0;
        seg = 0;
        begin_bucket();
      }
    }
  };
  begin_bucket();
  Manifest manifest;  // what the receivers must end with: each tensor's CRC-32C as it travels
  manifest.version = version;
  const auto record = [&](const std::string& name, const std::vector<int64_t>& shape, at::ScalarType dtype,
                          auto&& each) {
    if (!options_.checksums) return;
    ::fsdpx::detail::Crc32c crc;
    each([&](const at::Tensor& piece) {
      const at::Tensor host = piece.is_cpu() ? piece.contiguous() : piece.cpu();
      crc.update(host.const_data_ptr(), host.nbytes());
    });
    manifest.entries.push_back({name, dtype, shape, DeltaEncoding::full, 0, crc.value(), -1});
  };
  walk_units([&](int slot) { release(gather_tag + slot); },
             [&](int slot, core::Unit& u, const UnitData& data) {
               for (const auto& p : u.layout().params()) {
                 record(p.name, p.shape, wire_dtype(u), [&](auto&& update) { for_each_piece(u, p, data, update); });
                 send_tensor(p.name, [&](const detail::BucketEntry& entry) {
                   const auto [chunk, in_gather_buffer] =
                       data.lasting
                           ? data.range(p.offset + entry.element_offset, entry.numel)
                           : std::pair{p.param.detach().reshape({-1}).narrow(0, entry.element_offset, entry.numel),
                                       false};
                   // Gathered data is in the wire dtype already; the parameters are cast while packed.
                   const bool direct = data.lasting && entry.nbytes() >= options_.tuning.direct_bytes;
                   return std::tuple{chunk, direct, in_gather_buffer ? gather_tag + slot : lasting_tag};
                 });
               }
             });
  for (const auto& b : buffers) {
    record(b.name, b.tensor.sizes().vec(), b.tensor.scalar_type(), [&](auto&& update) { update(b.tensor); });
    send_tensor(b.name, [&](const detail::BucketEntry& entry) {
      return std::tuple{b.tensor.reshape({-1}).narrow(0, entry.element_offset, entry.numel), false, lasting_tag};
    });
  }
  FSDPX_CHECK_AS(SyncError, k == n, "weight sync: internal error: ", k, " of ", n, " buckets were filled");
  for (auto& [t, w] : pending) w.wait_stream();
  if (options_.checksums) {
    manifest.digest = manifest.compute_digest();
    const at::Tensor bytes = manifest.encode().to(device);
    group_->broadcast(at::tensor({bytes.numel()}, at::kLong).to(longs), 0);
    group_->broadcast(bytes, 0);
  }
}

FSDPX_DECL WeightBroadcaster::Planned WeightBroadcaster::plan_and_send_preamble(
    const std::vector<detail::TensorSpec>& specs, int64_t version, int64_t direct_bytes) {
  Planned out;
  out.plan = detail::plan_buckets(specs, options_.bucket_bytes, version);
  const int64_t n = static_cast<int64_t>(out.plan.size());
  const c10::Device device = model_->unit(0).options().device;
  int64_t largest = 0, largest_header = 0;
  std::vector<int64_t> header_sizes;
  for (const auto& b : out.plan) {
    header_sizes.push_back(b.header_bytes);
    largest = std::max(largest, b.total_bytes);
    largest_header = std::max(largest_header, b.header_bytes);
    stats_.bytes += b.total_bytes;
    auto bytes = detail::encode_header(b);
    out.headers.push_back(
        at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte).to(device, false, true));
  }
  stats_.buckets = n;
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  preamble_sent_ = true;
  group_->broadcast(
      at::tensor({detail::preamble_magic, version, n, largest_header, direct_bytes, largest}, at::kLong).to(longs), 0);
  if (n > 0) group_->broadcast(at::tensor(header_sizes, at::kLong).to(longs), 0);
  ensure_buffers(largest, device);
  return out;
}

FSDPX_DECL std::pair<int64_t, int64_t> WeightBroadcaster::own_range(const core::Unit& u) const {
  if (!gather_ || !shard_in_place(u)) return {0, 0};
  const int64_t n = u.layout().shard_numel();
  return {gather_->rank() * n, (gather_->rank() + 1) * n};
}

FSDPX_DECL bool WeightBroadcaster::shard_in_place(const core::Unit& u) const {
  const at::ScalarType s = u.shard().scalar_type();
  return s == wire_dtype(u) && s == u.options().param_dtype && u.shard().device() == u.options().device;
}

FSDPX_DECL void WeightBroadcaster::cast_shard(const core::Unit& u, const at::Tensor& into) const {
  const at::Tensor& shard = u.shard();
  const at::ScalarType compute = u.options().param_dtype;
  // One cast gives the same bits as two unless the compute dtype differs from both ends.
  const bool two_step = compute != shard.scalar_type() && compute != into.scalar_type();
  into.copy_(two_step ? shard.to(into.device(), compute) : shard);
}

FSDPX_DECL void WeightBroadcaster::ensure_buffers(int64_t bytes, c10::Device device) {
  if (buffers_[0].defined() && buffers_[0].numel() >= bytes && buffers_[0].device() == device) return;
  for (auto& b : buffers_)
    b = memory::empty_buffer(std::max<int64_t>(bytes, 1), at::TensorOptions().dtype(at::kByte).device(device));
}

FSDPX_DECL int64_t WeightReceiver::receive_into(torch::nn::Module& module) {
  return translating([&] {
    const detail::Announcement a = read_announcement();
    last_was_delta_ = false;
    if (a.kind == detail::Announcement::cut) {
      held_.prepare(&module);
      vote(a);
      detail::TensorCollector collector(options_.device);
      receive_buckets(collector, a.version);
      std::vector<NamedTensor> received = in_wire_order(collector.finish());
      const bool delta = Manifest::decode(received.front().tensor, where()).is_delta();
      held_.take_into(module, std::move(received), where());  // staged and checked, then applied
      last_was_delta_ = delta;
    } else {
      held_ = detail::HeldVersion{};  // the module is written as the version arrives
      streaming_into_module_ = a.version;
      detail::ModuleLoader loader(module);
      if (a.checksums) {
        detail::ChecksumSink<detail::ModuleLoader> checked(loader);
        receive_buckets(checked, a.version);
        const Manifest manifest = receive_manifest(a.version, checked.manifest_bytes());  // before any error
        loader.finish();
        checked.check(manifest, where());
        held_.taken(manifest);
      } else {
        receive_buckets(loader, a.version);
        loader.finish();
      }
      streaming_into_module_ = no_version;
    }
    last_version_ = a.version;
    return a.version;
  });
}

FSDPX_DECL WeightVersion WeightReceiver::receive() {
  return translating([&] {
    const detail::Announcement a = read_announcement();
    last_was_delta_ = false;
    WeightVersion out;
    out.version = a.version;
    detail::TensorCollector collector(options_.device);
    if (a.kind == detail::Announcement::cut) {
      held_.prepare(nullptr);
      vote(a);
      receive_buckets(collector, a.version);
      std::vector<NamedTensor> received = in_wire_order(collector.finish());
      const bool delta = Manifest::decode(received.front().tensor, where()).is_delta();
      std::tie(out.tensors, out.manifest) = held_.take(std::move(received), where());
      last_was_delta_ = delta;
    } else {
      held_ = detail::HeldVersion{};
      if (a.checksums) {
        detail::ChecksumSink<detail::TensorCollector> checked(collector);
        receive_buckets(checked, a.version);
        const Manifest manifest = receive_manifest(a.version, checked.manifest_bytes());
        out.tensors = collector.finish();
        checked.check(manifest, where());
        held_.taken(manifest);
        out.manifest = std::make_shared<const Manifest>(manifest);
      } else {
        receive_buckets(collector, a.version);
        out.tensors = collector.finish();
      }
    }
    last_version_ = a.version;
    return out;
  });
}

FSDPX_DECL std::vector<NamedTensor> WeightReceiver::in_wire_order(std::vector<NamedTensor> collected) const {
  // A collector lists tensors as first received, and a lone chunk of a later bucket may be received
  // (in place) before an earlier bucket is unpacked: the manifest goes back to the front.
  const auto it = std::find_if(collected.begin(), collected.end(),
                               [](const NamedTensor& t) { return t.name == detail::manifest_name; });
  FSDPX_CHECK_AS(SyncError, it != collected.end(), "a cut version from ", where(), " has no manifest ('",
                 detail::manifest_name, "'): the sender is not fsdpx, or the version is corrupt");
  std::rotate(collected.begin(), it, it + 1);
  return collected;
}

FSDPX_DECL detail::Announcement WeightReceiver::read_announcement() {
  auto a = at::zeros({detail::announce_longs}, at::TensorOptions().dtype(at::kLong).device(options_.device));
  group_.broadcast(a, options_.root);
  a = a.cpu();
  const int64_t* p = a.const_data_ptr<int64_t>();
  FSDPX_CHECK_AS(SyncError, p[0] == detail::announce_magic, "the model-update group '", group_.name(),
                 "' delivered something that is not a weight-sync announcement: its ranks disagree about what is "
                 "being sent (is every rollout rank calling receive while trainer rank 0 calls broadcast? "
                 "are both sides built from the same fsdpx?)");
  FSDPX_CHECK_AS(SyncError,
                 (p[2] == detail::Announcement::streamed || p[2] == detail::Announcement::cut) && p[3] >= no_version &&
                     p[4] >= 0 && p[4] <= std::numeric_limits<uint32_t>::max() && (p[5] == 0 || p[5] == 1),
                 "corrupt weight-sync announcement of version ", p[1], ": kind ", p[2], ", base ", p[3], " (digest ",
                 p[4], "), flags ", p[5]);
  return {p[1], static_cast<detail::Announcement::Kind>(p[2]), p[3], static_cast<uint32_t>(p[4]), p[5] == 1};
}

FSDPX_DECL void WeightReceiver::vote(const detail::Announcement& a) {
  if (a.base_version == no_version) return;  // the sender holds no base: no vote
  auto hold = at::full({1}, held_.holds(a.base_version, a.base_digest) ? 1 : 0,
                       at::TensorOptions().dtype(at::kLong).device(options_.device));
  group_.all_reduce(hold, dist::ReduceOp::min);
}

FSDPX_DECL Manifest WeightReceiver::receive_manifest(int64_t version, int64_t expected_bytes) {
  auto size = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(options_.device));
  group_.broadcast(size, options_.root);
  const int64_t n = size.cpu().item<int64_t>();
  FSDPX_CHECK_AS(SyncError, n == expected_bytes && n <= detail::max_manifest_bytes, "the manifest of version ", version,
                 " from ", where(), " would take ", n, " bytes, but that of the tensors that arrived takes ",
                 expected_bytes, " (the sender is not fsdpx, or the version is corrupt)");
  auto bytes = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(options_.device));
  group_.broadcast(bytes, options_.root);
  Manifest m = Manifest::decode(bytes, where());
  FSDPX_CHECK_AS(SyncError, m.version == version && !m.is_delta(), "the manifest from ", where(), " is of version ",
                 m.version, m.is_delta() ? " (a delta)" : "", " but version ", version, " was sent");
  return m;
}

FSDPX_DECL detail::BucketLayout WeightReceiver::read_header(const at::Tensor& bucket, const std::string& where) {
  if (bucket.is_cpu()) return detail::decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), where);
  // On a device: the prefix tells the header's size, then the header itself comes to the host.
  const auto prefix = bucket.narrow(0, 0, detail::prefix_bytes).cpu();
  uint32_t header_bytes = 0;
  std::memcpy(&header_bytes, prefix.const_data_ptr<uint8_t>() + 12, sizeof(header_bytes));
  const int64_t h = std::clamp<int64_t>(header_bytes, detail::prefix_bytes, bucket.numel());
  const auto header = bucket.narrow(0, 0, h).cpu();
  return detail::decode_header(header.const_data_ptr<uint8_t>(), h, where);
}

}  // namespace fsdpx::sync

namespace fsdpx::sync::detail {

FSDPX_DECL std::vector<Segment> segments_of(const detail::BucketLayout& b, int64_t direct_bytes) {
  std::vector<Segment> out;
  bool run = false;  // the last segment is a run of small entries that may grow
  for (size_t i = 0; i < b.entries.size(); ++i) {
    const detail::BucketEntry& e = b.entries[i];
    if (e.nbytes() == 0) continue;
    if (e.nbytes() >= direct_bytes) {
      out.push_back({i, i, e.byte_offset, e.byte_offset + e.nbytes()});
      run = false;
    } else if (run && out.back().last + 1 == i) {
      out.back().last = i;
      out.back().end = e.byte_offset + e.nbytes();
    } else {
      out.push_back({i, i, e.byte_offset, e.byte_offset + e.nbytes()});
      run = true;
    }
  }
  return out;
}

}  // namespace fsdpx::sync::detail
