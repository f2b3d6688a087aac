// Out-of-line functions of fsdpx/sync/broadcast.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/broadcast.hpp>

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

FSDPX_DECL std::vector<NamedTensor> module_buffers(const core::ShardedModel& model) {
  std::vector<NamedTensor> out;
  for (const auto& [name, buffer] : model.named_buffers()) out.push_back({name, buffer.detach()});
  return out;
}

FSDPX_DECL std::vector<NamedTensor> gather_full_state_dict(core::ShardedModel& model, bool collect,
                                                       const GatherOptions& options) {
  std::vector<NamedTensor> out;
  for_each_unsharded_unit(model, [&](core::Unit& u) {
    if (!collect) return;
    for (const auto& p : u.layout().params()) {
      // copy=true: the parameter is a view of a buffer the next reshard frees.
      out.push_back({p.name, p.param.detach().to(options.device, options.dtype.value_or(u.options().param_dtype),
                                                 /*non_blocking=*/false, /*copy=*/true)});
    }
  });
  if (collect) {
    for (auto& b : module_buffers(model)) {
      out.push_back({std::move(b.name), b.tensor.to(options.device, /*non_blocking=*/false, /*copy=*/true)});
    }
  }
  return out;
}

FSDPX_DECL WeightBroadcaster::WeightBroadcaster(core::ShardedModel& model,
    std::optional<dist::AnyCommunicator> update_group,
                    BroadcastOptions options)
    : model_(&model), group_(std::move(update_group)), options_(options) {
  if (options_.keep_gather_buffers) {
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
  FSDPX_CHECK(options_.direct_bytes >= 1, "WeightBroadcaster: direct_bytes must be positive, got ", options_.direct_bytes);
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
  using Clock = std::chrono::steady_clock;
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < model_->num_units(); ++i) {
    const core::Unit& u = model_->unit(i);
    const auto [own_begin, own_end] = own_range(u);
    for (const auto& p : u.layout().params()) {
      TensorSpec s{p.name, p.shape, wire_dtype(u)};
      // A chunk never spans the edge of this rank's own shard, which is read from elsewhere.
      for (const int64_t edge : {own_begin, own_end}) {
        if (edge > p.offset && edge < p.offset + p.numel) s.breaks.push_back(edge - p.offset);
      }
      specs.push_back(std::move(s));
    }
  }
  const std::vector<NamedTensor> buffers = module_buffers(*model_);
  for (const auto& b : buffers) specs.push_back({b.name, b.tensor.sizes().vec(), b.tensor.scalar_type()});
  const auto plan = plan_buckets(specs, options_.bucket_bytes, version);
  const int64_t n = static_cast<int64_t>(plan.size());
  const c10::Device device = model_->unit(0).options().device;
  int64_t largest = 0, largest_header = 0;
  std::vector<int64_t> header_sizes;
  std::vector<at::Tensor> headers;  // kept until the version is sent
  std::vector<std::vector<detail::Segment>> segments;
  for (const auto& b : plan) {
    header_sizes.push_back(b.header_bytes);
    largest = std::max(largest, b.total_bytes);
    largest_header = std::max(largest_header, b.header_bytes);
    stats_.bytes += b.total_bytes;
    auto bytes = encode_header(b);
    headers.push_back(at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte).to(device, false, true));
    segments.push_back(detail::segments_of(b, options_.direct_bytes));
  }
  stats_.buckets = n;
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  group_->broadcast(at::tensor({detail::preamble_magic, version, n, largest_header, options_.direct_bytes, largest},
                               at::kLong).to(longs), 0);
  if (n > 0) group_->broadcast(at::tensor(header_sizes, at::kLong).to(longs), 0);
  ensure_buffers(largest, device);

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
  int64_t k = 0;      // the bucket being filled
  size_t e = 0;       // its next entry
  size_t seg = 0;     // its next segment
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
      const BucketEntry& entry = plan[k].entries[e];
      const auto [chunk, direct, tag] = chunk_of(entry);
      if (!direct && entry.numel > 0) entry_view(buffers_[k % 2], entry).copy_(chunk);
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
  walk_units(
      [&](int slot) { release(gather_tag + slot); },
      [&](int slot, core::Unit& u, const UnitData& data) {
        for (const auto& p : u.layout().params()) {
          send_tensor(p.name, [&](const BucketEntry& entry) {
            const auto [chunk, in_gather_buffer] = data.lasting
                ? data.range(p.offset + entry.element_offset, entry.numel)
                : std::pair{p.param.detach().reshape({-1}).narrow(0, entry.element_offset, entry.numel), false};
            // Gathered data is in the wire dtype already; the parameters are cast while packed.
            const bool direct = data.lasting && entry.nbytes() >= options_.direct_bytes;
            return std::tuple{chunk, direct, in_gather_buffer ? gather_tag + slot : lasting_tag};
          });
        }
      });
  for (const auto& b : buffers) {
    send_tensor(b.name, [&](const BucketEntry& entry) {
      return std::tuple{b.tensor.reshape({-1}).narrow(0, entry.element_offset, entry.numel), false, lasting_tag};
    });
  }
  FSDPX_CHECK_AS(SyncError, k == n, "weight sync: internal error: ", k, " of ", n, " buckets were filled");
  for (auto& [t, w] : pending) w.wait_stream();
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
  for (auto& b : buffers_) b = memory::empty_buffer(std::max<int64_t>(bytes, 1), at::TensorOptions().dtype(at::kByte).device(device));
}

FSDPX_DECL int64_t WeightReceiver::receive_into(torch::nn::Module& module) {
  ModuleLoader loader(module);
  const int64_t version = receive_with(loader);
  loader.finish();
  return version;
}

FSDPX_DECL WeightSnapshot WeightReceiver::receive() {
  TensorCollector collector(options_.device);
  const int64_t version = receive_with(collector);
  return {version, collector.finish()};
}

FSDPX_DECL BucketLayout WeightReceiver::read_header(const at::Tensor& bucket, const std::string& where) {
  if (bucket.is_cpu()) return decode_header(bucket.const_data_ptr<uint8_t>(), bucket.numel(), where);
  // On a device: the prefix tells the header's size, then the header itself comes to the host.
  const auto prefix = bucket.narrow(0, 0, bucket_prefix_bytes).cpu();
  uint32_t header_bytes = 0;
  std::memcpy(&header_bytes, prefix.const_data_ptr<uint8_t>() + 12, sizeof(header_bytes));
  const int64_t h = std::clamp<int64_t>(header_bytes, bucket_prefix_bytes, bucket.numel());
  const auto header = bucket.narrow(0, 0, h).cpu();
  return decode_header(header.const_data_ptr<uint8_t>(), h, where);
}

}  // namespace fsdpx::sync

namespace fsdpx::sync::detail {

FSDPX_DECL std::vector<Segment> segments_of(const BucketLayout& b, int64_t direct_min) {
  std::vector<Segment> out;
  bool run = false;  // the last segment is a run of small entries that may grow
  for (size_t i = 0; i < b.entries.size(); ++i) {
    const BucketEntry& e = b.entries[i];
    if (e.nbytes() == 0) continue;
    if (e.nbytes() >= direct_min) {
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
