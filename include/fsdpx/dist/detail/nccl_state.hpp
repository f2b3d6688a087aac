// The NCCL backend's parts: CUDA errors and dtypes in NCCL's terms, pooled CUDA events, one
// communicator's state (its stream, its watchdog, its abort), a recorded call, and the Work of a
// launched batch. Declarations; the definitions are in fsdpx/dist/impl/nccl_state.ipp.
#pragma once

#if !defined(FSDPX_WITH_NCCL)
#error \
    "fsdpx/dist/detail/nccl_state.hpp needs FSDPX_WITH_NCCL: configure fsdpx with a CUDA LibTorch and NCCL (docs/building.md)"
#endif

#include <fsdpx/detail/config.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/SmallVector.h>

#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/work_pool.hpp>
#include <fsdpx/dist/types.hpp>
#include <fsdpx/dist/work.hpp>
#include <fsdpx/error.hpp>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "fsdpx needs NCCL 2.18 or newer (ncclCommSplit, nonblocking communicators)"
#endif

namespace fsdpx::dist::detail {

/// `ctx` (an OpContext, or text) and `step` make the message only when `e` is an error.
template <class Context>
inline void check_cuda(cudaError_t e, const Context& ctx, std::string_view step = {}) {
  FSDPX_CHECK_AS(CommError, e == cudaSuccess, ctx, step, " failed: CUDA error ", cudaGetErrorName(e), ": ",
                 cudaGetErrorString(e));
}

template <class Context>
inline ncclDataType_t nccl_dtype(const Context& ctx, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kChar: return ncclInt8;
    case at::kByte:
    case at::kBool: return ncclUint8;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default: break;
  }
  FSDPX_FAIL(ConfigError, ctx, ": dtype ", dtype, " is not supported by the NCCL backend");
}

/// Averaging over one rank is the identity: a sum, never NCCL's AVG.
constexpr ncclRedOp_t nccl_op(ReduceOp op, int group_size) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return group_size == 1 ? ncclSum : ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

class CudaEvent {
 public:
  CudaEvent() { check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { cudaEventDestroy(event_); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

/// One NCCL communicator, its stream and its watchdog.
class NcclCommState {
 public:
  FSDPX_DECL NcclCommState(ncclComm_t comm, c10::DeviceIndex device, CommOptions options);
  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;
  FSDPX_DECL ~NcclCommState();

  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  /// Something that must live as long as this communicator (the MPI world that bootstrapped it).
  void keep_alive(std::shared_ptr<void> owner) { keep_alive_ = std::move(owner); }
  c10::DeviceIndex device() const { return device_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommOptions& options() const { return options_; }
  const std::shared_ptr<CommHealth>& health() const { return health_; }
  OpContext context(std::string op) const { return {std::move(op), label_, rank_, size_}; }

  /// A CUDA event for a collective's ready or done mark, reused: an event is free again once only
  /// this pool holds it (no Work, no watchdog entry refers to it). Re-recording an event a stream
  /// already waits on is safe: cudaStreamWaitEvent waits for the record made before it was called.
  /// Call it with the communicator's device current.
  FSDPX_DECL std::shared_ptr<CudaEvent> acquire_event();

  /// Holds off the watchdog's abort while this thread calls NCCL on the communicator (ncclCommAbort
  /// must not run beside another call on it), and refuses once it was aborted. Recursive: a call
  /// that fails aborts from inside.
  [[nodiscard]] FSDPX_DECL std::unique_lock<std::recursive_mutex> lock_calls(const OpContext& ctx);

  /// Nonblocking communicators may answer ncclInProgress; wait (bounded) until the call settled.
  /// Call it holding lock_calls().
  FSDPX_DECL void settle(ncclResult_t result, const OpContext& ctx, std::string_view step = {});

  /// Hands a launched collective to the watchdog.
  FSDPX_DECL void watch(std::shared_ptr<CudaEvent> done, OpContext ctx);

  /// Marks the communicator broken and aborts NCCL so kernels blocked on dead peers return.
  FSDPX_DECL void fail(const std::string& cause);

 private:
  struct Pending {
    std::shared_ptr<CudaEvent> done;
    std::chrono::steady_clock::time_point deadline;
    OpContext context;
  };

  FSDPX_DECL void abort_once();
  FSDPX_DECL void watch_loop();

  ncclComm_t comm_;
  c10::DeviceIndex device_;
  CommOptions options_;
  int rank_ = 0;
  int size_ = 1;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<CommHealth> health_ = std::make_shared<CommHealth>();
  std::shared_ptr<const std::string> label_ = std::make_shared<const std::string>(options_.name);  // in errors
  std::mutex events_mutex_;
  std::vector<std::shared_ptr<CudaEvent>> events_;  // acquire_event()'s pool
  std::recursive_mutex calls_mutex_;                // NCCL calls on comm_ and its abort never overlap
  bool aborted_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stopping_ = false;
  std::thread watchdog_;
  std::shared_ptr<void> keep_alive_;  // released after the destructor's body has destroyed comm_
};

/// The tensors a batch's collectives use: kept alive (and away from the caching allocator) until the
/// caller's stream is ordered after the batch. Most batches hold one to four.
using BatchTensors = c10::SmallVector<at::Tensor, 4>;

/// One NCCL call of a batch, as data: recording it copies a few words (no closure, no allocation).
struct NcclCall {
  enum class Kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, send, recv, device_copy };
  Kind kind;
  const void* input = nullptr;  // all_gather, reduce_scatter, broadcast (root), send, device_copy
  void* output = nullptr;       // all_gather, reduce_scatter, all_reduce, broadcast, recv, device_copy
  size_t count = 0;             // elements; device_copy: bytes
  ncclDataType_t type = ncclInt8;
  ncclRedOp_t op = ncclSum;
  int peer = 0;  // broadcast: root; send: destination; recv: source

  FSDPX_DECL ncclResult_t launch(ncclComm_t comm, cudaStream_t stream) const;
};

class NcclWorkState final : public WorkState {
 public:
  NcclWorkState(std::shared_ptr<NcclCommState> comm, std::shared_ptr<CudaEvent> done, BatchTensors tensors,
                OpContext ctx)
      : comm_(std::move(comm)), done_(std::move(done)), tensors_(std::move(tensors)), context_(std::move(ctx)) {}
  FSDPX_DECL ~NcclWorkState() override;

  FSDPX_DECL void wait_stream() override;
  FSDPX_DECL void wait_host() override;
  bool is_completed() override { return cudaEventQuery(done_->get()) == cudaSuccess; }

 private:
  std::shared_ptr<NcclCommState> comm_;
  std::shared_ptr<CudaEvent> done_;
  std::mutex mutex_;
  BatchTensors tensors_;
  OpContext context_;
};

}  // namespace fsdpx::dist::detail
