// The NCCL backend's parts, out of line (NcclCommState, NcclCall, NcclWorkState): included by
// fsdpx/dist/impl/nccl.ipp (the communicator's), so by fsdpx/dist/nccl.hpp (header-only) or
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <fsdpx/dist/detail/nccl_state.hpp>

namespace fsdpx::dist::detail {

FSDPX_DECL NcclCommState::NcclCommState(ncclComm_t comm, c10::DeviceIndex device, CommOptions options)
    : comm_(comm), device_(device), options_(std::move(options)) {
  ncclCommCount(comm_, &size_);
  ncclCommUserRank(comm_, &rank_);
  c10::cuda::CUDAGuard guard(device_);
  int least = 0;
  int greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  check_cuda(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest), context("stream create"));
  watchdog_ = std::thread([this] { watch_loop(); });
}

FSDPX_DECL NcclCommState::~NcclCommState() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
  c10::cuda::CUDAGuard guard(device_);
  // While an exception propagates, peers may wait in collectives this rank will never join:
  // ncclCommDestroy would wait for them, so the communicator is aborted and the process can end
  // (the launcher then ends the job).
  if (health_->broken() || std::uncaught_exceptions() > 0) {
    abort_once();
  } else {
    std::lock_guard calls(calls_mutex_);
    if (!aborted_) ncclCommDestroy(comm_);
  }
  cudaStreamDestroy(stream_);
}

FSDPX_DECL std::shared_ptr<CudaEvent> NcclCommState::acquire_event() {
  std::lock_guard lock(events_mutex_);
  for (const auto& event : events_) {
    if (event.use_count() == 1) {
      std::atomic_thread_fence(std::memory_order_acquire);  // after the last holder's use of it
      return event;
    }
  }
  return events_.emplace_back(std::make_shared<CudaEvent>());
}

FSDPX_DECL std::unique_lock<std::recursive_mutex> NcclCommState::lock_calls(const OpContext& ctx) {
  std::unique_lock calls(calls_mutex_);
  if (aborted_) {
    throw CommError(health_->broken() ? health_->cause()
                                      : ::fsdpx::detail::str("fsdpx: ", ctx, ": the communicator was aborted"));
  }
  return calls;
}

FSDPX_DECL void NcclCommState::settle(ncclResult_t result, const OpContext& ctx, std::string_view step) {
  const auto deadline = deadline_after(options_.timeout);
  while (result == ncclInProgress) {
    if (std::chrono::steady_clock::now() > deadline) {
      fail(::fsdpx::detail::str("fsdpx: ", ctx, step, " did not complete within ", options_.timeout.count(), " ms"));
      throw TimeoutError(health_->cause());
    }
    std::this_thread::yield();
    ncclCommGetAsyncError(comm_, &result);
  }
  if (result != ncclSuccess) {
    fail(::fsdpx::detail::str("fsdpx: ", ctx, step, " failed: ", ncclGetErrorString(result), " (",
                              ncclGetLastError(comm_), ")"));
    throw CommError(health_->cause());
  }
}

FSDPX_DECL void NcclCommState::watch(std::shared_ptr<CudaEvent> done, OpContext ctx) {
  {
    std::lock_guard lock(mutex_);
    pending_.push_back({std::move(done), deadline_after(options_.timeout), std::move(ctx)});
  }
  cv_.notify_one();
}

FSDPX_DECL void NcclCommState::fail(const std::string& cause) {
  health_->mark_broken(cause);
  std::fprintf(stderr, "%s\n", cause.c_str());
  abort_once();
}

FSDPX_DECL void NcclCommState::abort_once() {
  std::lock_guard calls(calls_mutex_);
  if (aborted_) return;
  aborted_ = true;
  ncclCommAbort(comm_);
}

FSDPX_DECL void NcclCommState::watch_loop() {
  c10::cuda::CUDAGuard guard(device_);
  const auto period = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(100),
                                                          options_.timeout / 4 + std::chrono::milliseconds(1));
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    cv_.wait_for(lock, period);
    while (!pending_.empty() && cudaEventQuery(pending_.front().done->get()) == cudaSuccess) pending_.pop_front();
    if (health_->broken()) continue;
    ncclResult_t async = ncclSuccess;
    lock.unlock();  // lock order: calls_mutex_ is never taken while holding mutex_
    {
      std::lock_guard calls(calls_mutex_);
      if (!aborted_) ncclCommGetAsyncError(comm_, &async);
    }
    lock.lock();
    if (async != ncclSuccess && async != ncclInProgress) {
      const OpContext ctx = pending_.empty() ? context("communicator") : pending_.front().context;
      lock.unlock();
      fail(::fsdpx::detail::str("fsdpx: ", ctx, " failed asynchronously: ", ncclGetErrorString(async), " (",
                                ncclGetLastError(comm_), ")"));
      lock.lock();
    } else if (!pending_.empty() && std::chrono::steady_clock::now() > pending_.front().deadline) {
      const std::string cause = ::fsdpx::detail::str(
          "fsdpx: ", pending_.front().context, " did not complete within ", options_.timeout.count(),
          " ms: a peer rank exited, crashed, or did not call the same collective; the communicator was aborted");
      lock.unlock();
      fail(cause);
      lock.lock();
    }
  }
}

FSDPX_DECL ncclResult_t NcclCall::launch(ncclComm_t comm, cudaStream_t stream) const {
  switch (kind) {
    case Kind::all_gather: return ncclAllGather(input, output, count, type, comm, stream);
    case Kind::reduce_scatter: return ncclReduceScatter(input, output, count, type, op, comm, stream);
    case Kind::all_reduce: return ncclAllReduce(output, output, count, type, op, comm, stream);
    case Kind::broadcast: return ncclBroadcast(input, output, count, type, peer, comm, stream);
    case Kind::send: return ncclSend(input, count, type, peer, comm, stream);
    case Kind::recv: return ncclRecv(output, count, type, peer, comm, stream);
    case Kind::device_copy:
      return cudaMemcpyAsync(output, input, count, cudaMemcpyDeviceToDevice, stream) == cudaSuccess
                 ? ncclSuccess
                 : ncclUnhandledCudaError;
  }
  return ncclInvalidArgument;
}

FSDPX_DECL NcclWorkState::~NcclWorkState() {
  // Never waited: the tensors may only go back to the allocator once NCCL is done with them.
  if (!tensors_.empty()) cudaEventSynchronize(done_->get());
}

FSDPX_DECL void NcclWorkState::wait_stream() {
  comm_->health()->check(context_);
  c10::cuda::CUDAGuard guard(comm_->device());
  const auto caller = c10::cuda::getCurrentCUDAStream(comm_->device());
  check_cuda(cudaStreamWaitEvent(caller.stream(), done_->get(), 0), context_, " wait");
  // The caller's stream now runs after the collective: its allocator pool may reuse these blocks.
  std::lock_guard lock(mutex_);
  tensors_.clear();
}

FSDPX_DECL void NcclWorkState::wait_host() {
  comm_->health()->check(context_);
  // A collective that never completes ends when the watchdog aborts the communicator; the check
  // after the wait then names the timeout.
  const cudaError_t synced = cudaEventSynchronize(done_->get());
  comm_->health()->check(context_);  // first: a timeout or NCCL error is the cause of a failed sync
  check_cuda(synced, context_, " wait");
  std::lock_guard lock(mutex_);
  tensors_.clear();
}

}  // namespace fsdpx::dist::detail
