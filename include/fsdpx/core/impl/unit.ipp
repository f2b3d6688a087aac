// Unit's member functions, out of line: included by fsdpx/core/unit.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/core/unit.hpp>

namespace fsdpx::core {

FSDPX_DECL Unit::Unit(std::string name, int index, std::vector<ParamInfo> params, UnitComms comms,
                      const UnitOptions& options)
    : name_(std::move(name)), index_(index), comms_(std::move(comms)), options_(options) {
  shard_rank_ = comms_.gather.rank();
  check_params(name_, params, options_);
  trainable_ = !params.empty() && params.front().param.requires_grad();
  layout_ = FlatParamLayout(std::move(params), comms_.gather.size());
  const at::Device shard_device = options_.offload_to_cpu ? at::Device(at::kCPU) : options_.device;
  const auto shard_opts = at::TensorOptions().dtype(options_.shard_dtype).device(shard_device);
  shard_ = memory::empty_buffer(layout_.shard_numel(), shard_opts);  // host shards on huge pages
  if (options_.offload_to_cpu && options_.pin_memory && options_.device.is_cuda()) shard_ = shard_.pin_memory();
  const FlatRange mine = layout_.shard_range(shard_rank_);
  at::NoGradGuard no_grad;
  // Every element is written once: the padding zeroed, the rest copied (a second pass over a large
  // shard costs as much as the copy).
  for (const FlatRange& gap : layout_.padding()) {
    const int64_t lo = std::max(gap.begin, mine.begin), hi = std::min(gap.end, mine.end);
    if (lo < hi) shard_.narrow(0, lo - mine.begin, hi - lo).zero_();
  }
  for (const ParamInfo& p : layout_.params()) {
    // Shard values from the original parameter, never from a compute-dtype copy of it.
    const at::Tensor flat = p.param.detach().reshape({-1});
    const int64_t lo = std::max(p.offset, mine.begin), hi = std::min(p.offset + p.numel, mine.end);
    if (lo < hi) shard_.narrow(0, lo - mine.begin, hi - lo).copy_(flat.narrow(0, lo - p.offset, hi - lo));
  }
  // The parameters become views of the full buffer, which starts sharded: its bytes are released
  // right after the views exist (never written, so never resident); the first unshard() gathers.
  full_ = at::empty({layout_.padded_numel()}, at::TensorOptions().dtype(options_.param_dtype).device(options_.device));
  for (const ParamInfo& p : layout_.params()) p.param.set_data(full_.narrow(0, p.offset, p.numel).view(p.shape));
  detail::free_storage(full_);

  const auto [decay, no_decay] = layout_.shard_groups(shard_rank_);
  for (const auto& [range, decayed] : {std::pair{decay, true}, std::pair{no_decay, false}}) {
    if (range.size() > 0) optim_params_.push_back({shard_.narrow(0, range.begin, range.size()), range, decayed});
  }
}

FSDPX_DECL void Unit::check_params(const std::string& name, const std::vector<ParamInfo>& params,
                                   const UnitOptions& options) {
  if (params.empty()) return;
  const bool trainable = params.front().param.requires_grad();
  for (const ParamInfo& p : params) {
    FSDPX_CHECK(p.param.requires_grad() == trainable, "unit '", name, "' mixes frozen and trainable parameters ('",
                params.front().name, "', '", p.name, "'); ShardedModel gives the frozen ones a unit of their own");
    FSDPX_CHECK(p.param.is_floating_point(), "unit '", name, "': parameter '", p.name, "' has dtype ",
                p.param.scalar_type(), "; only floating-point parameters can be sharded");
  }
  FSDPX_CHECK(!options.inference_only || !trainable, "unit '", name,
              "': an inference-only model has trainable parameters; Fsdp freezes them, so something set "
              "requires_grad after it did");
}

FSDPX_DECL void Unit::unshard_async() {
  if (state_ != State::sharded) return;
  RECORD_USER_SCOPE("fsdpx::all_gather");
  // Host buffers come from the step-buffer cache (the same sizes every step); a device's from its allocator.
  detail::allocate_storage(
      full_, full_.is_cpu() ? memory::HostBufferCache::instance().allocate(full_.nbytes()) : at::DataPtr());
  at::NoGradGuard no_grad;
  const FlatRange mine = layout_.shard_range(shard_rank_);
  auto slot = full_.narrow(0, mine.begin, mine.size());
  slot.copy_(shard_, /*non_blocking=*/options_.pin_memory);  // cast (and host-to-device when offloaded)
  gather_ = comms_.gather.all_gather_async(full_, slot);     // in place: the slot is this rank's input
  state_ = State::gathering;
}

FSDPX_DECL void Unit::unshard() {
  unshard_async();
  if (state_ == State::gathering) {
    RECORD_USER_SCOPE("fsdpx::wait_all_gather");
    gather_.wait_stream();
    state_ = State::unsharded;
  }
}

FSDPX_DECL void Unit::reshard() {
  if (state_ == State::sharded) return;
  RECORD_USER_SCOPE("fsdpx::reshard");
  if (state_ == State::gathering) gather_.wait_stream();
  detail::free_storage(full_);
  state_ = State::sharded;
}

FSDPX_DECL void Unit::move_shard(at::Device device) {
  FSDPX_CHECK(state_ == State::sharded, "unit '", name_, "': move the shard only while the unit is sharded");
  RECORD_USER_SCOPE("fsdpx::move_shard");
  // Pinned whenever a GPU's shard goes to the host, so the reload copies asynchronously.
  const bool pin = device.is_cpu() && (shard_.is_cuda() || (options_.pin_memory && options_.device.is_cuda()));
  at::Tensor moved = shard_.to(device);
  if (pin) moved = moved.pin_memory();
  shard_.set_data(moved);
  for (auto& p : optim_params_) {
    p.tensor.set_data(shard_.narrow(0, p.range.begin, p.range.size()));
    if (at::Tensor& g = p.tensor.mutable_grad(); g.defined()) g = pin ? g.to(device).pin_memory() : g.to(device);
  }
}

FSDPX_DECL void Unit::reduce_gradients_async() {
  if (!trainable_ || reducing_) return;
  RECORD_USER_SCOPE("fsdpx::reduce_scatter");
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().dtype(options_.reduce_dtype).device(options_.device);
  flat_grad_ = memory::empty_step_buffer(layout_.padded_numel(), opts);
  for (const ParamInfo& p : layout_.params()) {
    auto dst = flat_grad_.narrow(0, p.offset, p.numel);
    at::Tensor& g = p.param.mutable_grad();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}));
      g.reset();  // the unsharded gradient is no longer needed
    } else {
      dst.zero_();
    }
  }
  for (const FlatRange& gap : layout_.padding()) flat_grad_.narrow(0, gap.begin, gap.size()).zero_();
  // A shard group of one has nothing to reduce: the flat gradient is the result (no backend's AVG
  // over one rank is relied on).
  if (comms_.reduce.size() == 1) {
    reduced_ = flat_grad_;
    reduce_ = dist::Work();
  } else {
    reduced_ = memory::empty_step_buffer(layout_.shard_numel(), opts);
    reduce_ = comms_.reduce.reduce_scatter_async(reduced_, flat_grad_, dist::ReduceOp::avg);
  }
  reducing_ = true;
}

FSDPX_DECL void Unit::start_replica_reduction() {
  if (!reducing_ || replicating_) return;
  RECORD_USER_SCOPE("fsdpx::replica_all_reduce");
  reduce_.wait_stream();
  flat_grad_ = at::Tensor();
  if (comms_.replicate.size() > 1) replica_ = comms_.replicate.all_reduce_async(reduced_, dist::ReduceOp::avg);
  replicating_ = true;
}

FSDPX_DECL void Unit::start_gradient_copy_to_host() {
  if (!reducing_ || copy_done_ || !reduced_.defined() || reduced_.device() == shard_.device() || !shard_.is_cpu())
    return;
  start_replica_reduction();
  RECORD_USER_SCOPE("fsdpx::offload_gradient_copy");
  replica_.wait_stream();  // orders this stream after the reduction
  at::NoGradGuard no_grad;
  const at::Tensor source = reduced_.to(at::kFloat);  // on the device, in stream order
  host_grad_ = at::empty({source.numel()}, at::TensorOptions().dtype(at::kFloat).pinned_memory(options_.pin_memory));
  host_grad_.copy_(source, /*non_blocking=*/options_.pin_memory);
  const c10::Device device = source.device();
  copy_done_.emplace(device.type());
  copy_done_->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  reduced_ = source;  // kept until the copy is done: the device may still read it
}

FSDPX_DECL void Unit::wait_gradient_reduction() {
  if (!reducing_) return;
  start_replica_reduction();
  RECORD_USER_SCOPE("fsdpx::finish_reduction");
  replica_.wait_stream();
  reducing_ = replicating_ = false;
  at::NoGradGuard no_grad;
  at::Tensor g;
  if (copy_done_) {
    copy_done_->synchronize();  // the host copy started by start_gradient_copy_to_host()
    copy_done_.reset();
    g = std::move(host_grad_);
  } else {
    g = reduced_.to(shard_.device(), at::kFloat);
  }
  reduced_ = at::Tensor();
  // After the reduction, in float32 and on the shard alone: no overflow of a low-precision reduction, 1/W
  // of the elements (exact for powers of 2).
  if (options_.gradient_factor != 1) g.mul_(options_.gradient_factor);
  pending_ = pending_.defined() ? pending_ + g : std::move(g);
}

FSDPX_DECL void Unit::apply_gradient_reduction() {
  if (!pending_.defined()) return;
  at::NoGradGuard no_grad;
  const at::Tensor g = std::move(pending_);
  pending_ = at::Tensor();
  for (auto& p : optim_params_) {
    const at::Tensor part = g.narrow(0, p.range.begin, p.range.size());
    at::Tensor& grad = p.tensor.mutable_grad();
    if (grad.defined()) {
      grad.add_(part);
    } else {
      grad = memory::empty_step_buffer(part.numel(), part.options()).copy_(part);
    }
  }
}

FSDPX_DECL bool Unit::discard_gradients() {
  if (reducing_) {
    reducing_ = replicating_ = false;
    reduce_.wait_host();  // nothing of the failed pass stays in flight
    replica_.wait_host();
  }
  if (copy_done_) {
    copy_done_->synchronize();
    copy_done_.reset();
  }
  flat_grad_ = reduced_ = host_grad_ = pending_ = at::Tensor();
  bool dropped = false;
  for (const ParamInfo& p : layout_.params()) {
    if (at::Tensor& g = p.param.mutable_grad(); g.defined()) {
      g.reset();
      dropped = true;
    }
  }
  return dropped;
}

FSDPX_DECL Unit::MasterGather Unit::master_gather_buffers() const {
  const at::Device device = options_.device;
  return {at::empty({layout_.padded_numel()}, shard_.options().device(device)), shard_.to(device)};
}

FSDPX_DECL std::vector<at::Tensor> Unit::shard_grads() const {
  std::vector<at::Tensor> out;
  for (const auto& p : optim_params_) {
    if (p.tensor.grad().defined()) out.push_back(p.tensor.grad());
  }
  return out;
}

}  // namespace fsdpx::core
