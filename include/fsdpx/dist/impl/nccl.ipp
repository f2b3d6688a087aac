// The NCCL backend's communicator, out of line: included by fsdpx/dist/nccl.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp). Its parts (the
// communicator's state, its watchdog, a recorded call, a batch's Work) are in nccl_state.ipp.
#pragma once

#include <chrono>
#include <cstddef>
#include <thread>

#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <fsdpx/dist/impl/nccl_state.ipp>
#include <atomic>

#include <fsdpx/dist/nccl.hpp>

namespace fsdpx::dist {

FSDPX_DECL NcclCommunicator NcclCommunicator::create(int rank, int size, c10::DeviceIndex device,
                                                     const ncclUniqueId& id, CommOptions options) {
  const auto ctx = detail::op_context("init", options.name, rank, size);
  c10::cuda::CUDAGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so a missing peer times out instead of hanging in init
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  const auto deadline = deadline_after(options.timeout);
  while (rc == ncclInProgress && comm != nullptr) {
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(comm);
      throw TimeoutError(::fsdpx::detail::str("fsdpx: ", ctx, " did not complete within ", options.timeout.count(),
                                              " ms: not every rank joined"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    ncclCommGetAsyncError(comm, &rc);
  }
  FSDPX_CHECK_AS(CommError, rc == ncclSuccess, ctx, " failed: ", ncclGetErrorString(rc), " (", ncclGetLastError(comm),
                 ")");
  return NcclCommunicator(std::make_shared<detail::NcclCommState>(comm, device, std::move(options)));
}

FSDPX_DECL NcclCommunicator NcclCommunicator::world(CommOptions options) {
  const LaunchEnv env = detect_launch_env();
  ncclUniqueId id{};
  if (env.world_size == 1) {
    ncclGetUniqueId(&id);
  } else {
    FSDPX_CHECK(env.has_rendezvous(), "NcclCommunicator::world() at ", env.world_size, " ranks (",
                to_string(env.launcher),
                " launch) needs MASTER_ADDR and MASTER_PORT for NCCL's unique "
                "id; under mpirun, call fsdpx::dist::nccl_world() (<fsdpx/dist/launch.hpp>), which carries it over "
                "MPI, or export both");
    Rendezvous rendezvous(env, options.timeout);
    id = unique_id(rendezvous, options.name);
  }
  return create(env.rank, env.world_size, static_cast<c10::DeviceIndex>(env.local_rank), id, std::move(options));
}

FSDPX_DECL ncclUniqueId NcclCommunicator::unique_id(Rendezvous& rendezvous, const std::string& key) {
  ncclUniqueId id{};
  std::vector<std::uint8_t> bytes(sizeof(id));
  if (rendezvous.rank() == 0) {
    ncclGetUniqueId(&id);
    std::memcpy(bytes.data(), &id, sizeof(id));
  }
  bytes = rendezvous.broadcast("nccl_unique_id/" + key, std::move(bytes));
  FSDPX_CHECK_AS(CommError, bytes.size() == sizeof(id), "the NCCL unique id from the store has ", bytes.size(),
                 " bytes, expected ", sizeof(id));
  std::memcpy(&id, bytes.data(), sizeof(id));
  return id;
}

FSDPX_DECL void NcclCommunicator::add_all_gather(NcclBatch& batch, at::Tensor output, const at::Tensor& input) const {
  const auto ctx = context("all_gather");
  check_pair(ctx, output, input);
  detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
  const auto type = detail::nccl_dtype(ctx, input.scalar_type());
  const auto count = static_cast<size_t>(input.numel());
  note(batch, "all_gather", {output, input});  // first: the batch holds what its calls point into
  batch.calls.push_back({detail::NcclCall::Kind::all_gather, input.const_data_ptr(), output.data_ptr(), count, type});
}

FSDPX_DECL void NcclCommunicator::add_gather(NcclBatch& batch, at::Tensor output, const at::Tensor& input,
                                             int root) const {
  const auto ctx = context("gather");
  detail::check_root(ctx, root, size());
  detail::check_tensor(ctx, "input", input, device_type());
  check_device(ctx, input);
  const auto type = detail::nccl_dtype(ctx, input.scalar_type());
  const auto count = static_cast<size_t>(input.numel());
  if (rank() != root) {
    note(batch, "gather", {input});
    batch.calls.push_back({detail::NcclCall::Kind::send, input.const_data_ptr(), nullptr, count, type, ncclSum, root});
    return;
  }
  check_pair(ctx, output, input);
  detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
  note(batch, "gather", {output, input});
  // Rank c's slot of the (contiguous, checked) output.
  const auto slot = [base = static_cast<std::byte*>(output.data_ptr()), bytes = input.nbytes()](int c) {
    return static_cast<void*>(base + static_cast<size_t>(c) * bytes);
  };
  if (slot(rank()) != input.const_data_ptr() && count > 0) {
    batch.calls.push_back({detail::NcclCall::Kind::device_copy, input.const_data_ptr(), slot(rank()), input.nbytes()});
  }
  for (int c = 0; c < size(); ++c) {
    if (c == rank()) continue;
    batch.calls.push_back({detail::NcclCall::Kind::recv, nullptr, slot(c), count, type, ncclSum, c});
  }
}

FSDPX_DECL void NcclCommunicator::add_reduce_scatter(NcclBatch& batch, at::Tensor output, const at::Tensor& input,
                                                     ReduceOp op) const {
  const auto ctx = context("reduce_scatter");
  check_pair(ctx, output, input);
  detail::check_scatter_sizes(ctx, input, "input", output, "output", size());
  detail::check_reduce_dtype(ctx, op == ReduceOp::avg, input);
  const auto type = detail::nccl_dtype(ctx, input.scalar_type());
  const auto count = static_cast<size_t>(output.numel());
  note(batch, "reduce_scatter", {output, input});
  batch.calls.push_back({detail::NcclCall::Kind::reduce_scatter, input.const_data_ptr(), output.data_ptr(), count, type,
                         detail::nccl_op(op, size())});
}

FSDPX_DECL void NcclCommunicator::add_all_to_all_v(NcclBatch& batch, at::Tensor output, const at::Tensor& input,
                                                   at::IntArrayRef output_splits, at::IntArrayRef input_splits) const {
  const auto ctx = context("all_to_all");
  check_pair(ctx, output, input);
  const auto plan = detail::all_to_all_plan(ctx, output, input, output_splits, input_splits, rank(), size());
  const auto type = detail::nccl_dtype(ctx, input.scalar_type());
  note(batch, "all_to_all", {output, input});  // first: the batch holds what its calls point into
  const auto bytes = static_cast<size_t>(input.element_size());
  auto* const out = static_cast<std::byte*>(output.data_ptr());
  const auto* const in = static_cast<const std::byte*>(input.const_data_ptr());
  const auto address = [bytes](auto* base, int64_t offset) { return base + static_cast<size_t>(offset) * bytes; };
  const int r = rank();
  if (plan.send_count[r] > 0) {
    batch.calls.push_back({detail::NcclCall::Kind::device_copy, address(in, plan.send_offset[r]),
                           address(out, plan.recv_offset[r]), static_cast<size_t>(plan.send_count[r]) * bytes});
  }
  for (int c = 0; c < size(); ++c) {
    if (c == r) continue;
    if (plan.send_count[c] > 0) {
      batch.calls.push_back({detail::NcclCall::Kind::send, address(in, plan.send_offset[c]), nullptr,
                             static_cast<size_t>(plan.send_count[c]), type, ncclSum, c});
    }
    if (plan.recv_count[c] > 0) {
      batch.calls.push_back({detail::NcclCall::Kind::recv, nullptr, address(out, plan.recv_offset[c]),
                             static_cast<size_t>(plan.recv_count[c]), type, ncclSum, c});
    }
  }
}

FSDPX_DECL void NcclCommunicator::add_all_reduce(NcclBatch& batch, at::Tensor tensor, ReduceOp op) const {
  const auto ctx = context("all_reduce");
  detail::check_tensor(ctx, "tensor", tensor, device_type());
  check_device(ctx, tensor);
  detail::check_reduce_dtype(ctx, op == ReduceOp::avg, tensor);
  const auto type = detail::nccl_dtype(ctx, tensor.scalar_type());
  const auto count = static_cast<size_t>(tensor.numel());
  note(batch, "all_reduce", {tensor});
  batch.calls.push_back(
      {detail::NcclCall::Kind::all_reduce, nullptr, tensor.data_ptr(), count, type, detail::nccl_op(op, size())});
}

FSDPX_DECL void NcclCommunicator::add_broadcast(NcclBatch& batch, at::Tensor tensor, int root) const {
  const auto ctx = context("broadcast");
  detail::check_tensor(ctx, "tensor", tensor, device_type());
  check_device(ctx, tensor);
  detail::check_root(ctx, root, size());
  const auto type = detail::nccl_dtype(ctx, tensor.scalar_type());
  const auto count = static_cast<size_t>(tensor.numel());
  note(batch, "broadcast", {tensor});
  batch.calls.push_back(
      {detail::NcclCall::Kind::broadcast, tensor.const_data_ptr(), tensor.data_ptr(), count, type, ncclSum, root});
}

FSDPX_DECL Work NcclCommunicator::launch(NcclBatch batch) {
  const auto ctx = context(batch.names.empty() ? std::string("empty batch") : std::move(batch.names));
  state_->health()->check(ctx);
  c10::cuda::CUDAGuard guard(device());
  const auto caller = c10::cuda::getCurrentCUDAStream(device());
  {
    const auto ready = state_->acquire_event();  // back to the pool once the wait is enqueued
    detail::check_cuda(cudaEventRecord(ready->get(), caller.stream()), ctx, " (record ready)");
    detail::check_cuda(cudaStreamWaitEvent(stream(), ready->get(), 0), ctx, " (wait ready)");
  }
  {
    const auto calls = state_->lock_calls(ctx);  // released before watch(): it takes the watchdog's lock
    if (batch.calls.size() == 1) {
      state_->settle(batch.calls.front().launch(native_handle(), stream()), ctx);
    } else if (!batch.calls.empty()) {
      state_->settle(ncclGroupStart(), ctx, " (group start)");
      for (const auto& call : batch.calls) state_->settle(call.launch(native_handle(), stream()), ctx);
      state_->settle(ncclGroupEnd(), ctx, " (group end)");
    }
  }
  auto done = state_->acquire_event();
  detail::check_cuda(cudaEventRecord(done->get(), stream()), ctx, " (record done)");
  state_->watch(done, ctx);
  return Work(
      detail::WorkStatePool::make<detail::NcclWorkState>(state_, std::move(done), std::move(batch.tensors), ctx));
}

FSDPX_DECL Work NcclCommunicator::barrier_async() {
  c10::cuda::CUDAGuard guard(device());
  auto token = at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device()));
  return all_reduce_async(std::move(token), ReduceOp::sum);
}

FSDPX_DECL std::optional<NcclCommunicator> NcclCommunicator::split(int color, int key, std::string_view name) const {
  const auto ctx = context("split");
  FSDPX_CHECK(color >= 0 || color == no_color, ctx, ": color ", color, " must be >= 0 or fsdpx::dist::no_color");
  state_->health()->check(ctx);
  c10::cuda::CUDAGuard guard(device());
  // NCCL writes the child's handle only once the split completed (in the background: the parent is
  // nonblocking), so the handle itself is polled, then the child's state: the parent's state can say
  // "done" before the handle is written (docs/gpu.md, 2026-11-26).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t child = nullptr;
  const auto calls = state_->lock_calls(ctx);
  state_->settle(ncclCommSplit(native_handle(), color == no_color ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config),
                 ctx);
  const auto deadline = deadline_after(state_->options().timeout);
  const std::atomic_ref<ncclComm_t> handle(child);
  ncclResult_t parent_rc = ncclInProgress;
  while (handle.load() == nullptr) {
    ncclCommGetAsyncError(native_handle(), &parent_rc);
    if (parent_rc != ncclSuccess && parent_rc != ncclInProgress) break;
    if (color == no_color && parent_rc == ncclSuccess) break;  // no child is made for this rank
    if (std::chrono::steady_clock::now() > deadline) {
      state_->fail(
          ::fsdpx::detail::str("fsdpx: ", ctx, " did not complete within ", state_->options().timeout.count(), " ms"));
      throw TimeoutError(state_->health()->cause());
    }
    std::this_thread::yield();
  }
  FSDPX_CHECK_AS(CommError, parent_rc == ncclSuccess || parent_rc == ncclInProgress, ctx,
                 " failed: ", ncclGetErrorString(parent_rc), " (", ncclGetLastError(native_handle()), ")");
  if (child != nullptr) {
    ncclResult_t rc = ncclInProgress;
    while (rc == ncclInProgress && std::chrono::steady_clock::now() < deadline) ncclCommGetAsyncError(child, &rc);
    FSDPX_CHECK_AS(CommError, rc == ncclSuccess, ctx, " failed: ", ncclGetErrorString(rc));
  }
  if (child == nullptr) return std::nullopt;
  CommOptions options = state_->options();
  options.name = name.empty() ? ::fsdpx::detail::str(this->name(), "/", color) : std::string(name);
  return NcclCommunicator(std::make_shared<detail::NcclCommState>(child, device(), std::move(options)));
}

FSDPX_DECL void NcclCommunicator::check_device(const detail::OpContext& ctx, const at::Tensor& t) const {
  FSDPX_CHECK(t.device().index() == device(), ctx, ": tensor is on ", t.device(),
              " but the communicator uses cuda:", static_cast<int>(device()));
}

FSDPX_DECL void NcclCommunicator::check_pair(const detail::OpContext& ctx, const at::Tensor& output,
                                             const at::Tensor& input) const {
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_tensor(ctx, "input", input, device_type());
  detail::check_same_dtype(ctx, output, input);
  check_device(ctx, output);
}

FSDPX_DECL void NcclCommunicator::note(NcclBatch& batch, std::string_view op,
                                       std::initializer_list<at::Tensor> tensors) {
  if (!batch.names.empty()) batch.names += '+';
  batch.names += op;
  batch.tensors.insert(batch.tensors.end(), tensors.begin(), tensors.end());
}

}  // namespace fsdpx::dist
