// NCCL backend: collectives over CUDA tensors, one rank per GPU.
//
// Each communicator runs its collectives on its own high-priority CUDA stream. A collective first
// waits (an event, not a host sync) for the caller's current stream, so inputs written there are
// complete; Work::wait_stream() makes the caller's current stream wait for the collective's end, and
// Work::wait_host() blocks the host on it. Tensors are held until one of them (no recordStream), so
// memory is reused deterministically, as in PyTorch's FSDP2.
// A watchdog thread aborts the communicator when a collective outlives CommOptions::timeout or NCCL
// reports an asynchronous error; every later call then throws with that cause.
#pragma once

#if !defined(FSDPX_WITH_NCCL)
#error "fsdpx/dist/nccl.hpp needs FSDPX_WITH_NCCL: configure fsdpx with a CUDA LibTorch and NCCL (docs/building.md)"
#endif

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>

#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/work_pool.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/rendezvous.hpp>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "fsdpx needs NCCL 2.18 or newer (ncclCommSplit, nonblocking communicators)"
#endif

namespace fsdpx::dist {
namespace detail {

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
  NcclCommState(ncclComm_t comm, c10::DeviceIndex device, CommOptions options)
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
  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;
  ~NcclCommState() {
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
  std::shared_ptr<CudaEvent> acquire_event() {
    std::lock_guard lock(events_mutex_);
    for (const auto& event : events_) {
      if (event.use_count() == 1) {
        std::atomic_thread_fence(std::memory_order_acquire);  // after the last holder's use of it
        return event;
      }
    }
    return events_.emplace_back(std::make_shared<CudaEvent>());
  }

  /// Holds off the watchdog's abort while this thread calls NCCL on the communicator (ncclCommAbort
  /// must not run beside another call on it), and refuses once it was aborted. Recursive: a call
  /// that fails aborts from inside.
  [[nodiscard]] std::unique_lock<std::recursive_mutex> lock_calls(const OpContext& ctx) {
    std::unique_lock calls(calls_mutex_);
    if (aborted_) {
      throw CommError(health_->broken() ? health_->cause() : detail::str("fsdpx: ", ctx, ": the communicator was aborted"));
    }
    return calls;
  }

  /// Nonblocking communicators may answer ncclInProgress; wait (bounded) until the call settled.
  /// Call it holding lock_calls().
  void settle(ncclResult_t result, const OpContext& ctx, std::string_view step = {}) {
    const auto deadline = deadline_after(options_.timeout);
    while (result == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline) {
        fail(detail::str("fsdpx: ", ctx, step, " did not complete within ", options_.timeout.count(), " ms"));
        throw TimeoutError(health_->cause());
      }
      std::this_thread::yield();
      ncclCommGetAsyncError(comm_, &result);
    }
    if (result != ncclSuccess) {
      fail(detail::str("fsdpx: ", ctx, step, " failed: ", ncclGetErrorString(result), " (", ncclGetLastError(comm_),
                       ")"));
      throw CommError(health_->cause());
    }
  }

  /// Hands a launched collective to the watchdog.
  void watch(std::shared_ptr<CudaEvent> done, OpContext ctx) {
    {
      std::lock_guard lock(mutex_);
      pending_.push_back({std::move(done), deadline_after(options_.timeout), std::move(ctx)});
    }
    cv_.notify_one();
  }

  /// Marks the communicator broken and aborts NCCL so kernels blocked on dead peers return.
  void fail(const std::string& cause) {
    health_->mark_broken(cause);
    std::fprintf(stderr, "%s\n", cause.c_str());
    abort_once();
  }

 private:
  struct Pending {
    std::shared_ptr<CudaEvent> done;
    std::chrono::steady_clock::time_point deadline;
    OpContext context;
  };

  void abort_once() {
    std::lock_guard calls(calls_mutex_);
    if (aborted_) return;
    aborted_ = true;
    ncclCommAbort(comm_);
  }

  void watch_loop() {
    c10::cuda::CUDAGuard guard(device_);
    const auto period = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(100), options_.timeout / 4 + std::chrono::milliseconds(1));
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
        fail(detail::str("fsdpx: ", ctx, " failed asynchronously: ", ncclGetErrorString(async), " (",
                         ncclGetLastError(comm_), ")"));
        lock.lock();
      } else if (!pending_.empty() && std::chrono::steady_clock::now() > pending_.front().deadline) {
        const std::string cause = detail::str(
            "fsdpx: ", pending_.front().context, " did not complete within ", options_.timeout.count(),
            " ms: a peer rank exited, crashed, or did not call the same collective; the communicator was aborted");
        lock.unlock();
        fail(cause);
        lock.lock();
      }
    }
  }

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
  std::recursive_mutex calls_mutex_;  // NCCL calls on comm_ and its abort never overlap
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
  int peer = 0;                 // broadcast: root; send: destination; recv: source

  ncclResult_t launch(ncclComm_t comm, cudaStream_t stream) const {
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
};

class NcclWorkState final : public WorkState {
 public:
  NcclWorkState(std::shared_ptr<NcclCommState> comm, std::shared_ptr<CudaEvent> done, BatchTensors tensors,
                OpContext ctx)
      : comm_(std::move(comm)), done_(std::move(done)), tensors_(std::move(tensors)), context_(std::move(ctx)) {}
  ~NcclWorkState() override {
    // Never waited: the tensors may only go back to the allocator once NCCL is done with them.
    if (!tensors_.empty()) cudaEventSynchronize(done_->get());
  }

  void wait_stream() override {
    comm_->health()->check(context_);
    c10::cuda::CUDAGuard guard(comm_->device());
    const auto caller = c10::cuda::getCurrentCUDAStream(comm_->device());
    check_cuda(cudaStreamWaitEvent(caller.stream(), done_->get(), 0), context_, " wait");
    // The caller's stream now runs after the collective: its allocator pool may reuse these blocks.
    std::lock_guard lock(mutex_);
    tensors_.clear();
  }
  void wait_host() override {
    comm_->health()->check(context_);
    // A collective that never completes ends when the watchdog aborts the communicator; the check
    // after the wait then names the timeout.
    const cudaError_t synced = cudaEventSynchronize(done_->get());
    comm_->health()->check(context_);  // first: a timeout or NCCL error is the cause of a failed sync
    check_cuda(synced, context_, " wait");
    std::lock_guard lock(mutex_);
    tensors_.clear();
  }
  bool is_completed() override { return cudaEventQuery(done_->get()) == cudaSuccess; }

 private:
  std::shared_ptr<NcclCommState> comm_;
  std::shared_ptr<CudaEvent> done_;
  std::mutex mutex_;
  BatchTensors tensors_;
  OpContext context_;
};

}  // namespace detail

/// Several collectives launched as one NCCL group (one launch, one completion event). A call is
/// recorded with its tensors' addresses: their memory must stay allocated, in place, until launch().
/// Up to four calls and four tensors are held without allocating.
class NcclBatch {
 private:
  friend class NcclCommunicator;
  c10::SmallVector<detail::NcclCall, 4> calls;
  detail::BatchTensors tensors;
  std::string names;  // "all_gather+reduce_scatter": the op in errors
};

class NcclCommunicator : public BlockingCollectives<NcclCommunicator> {
 public:
  static constexpr c10::DeviceType device_type() { return c10::DeviceType::CUDA; }
  static constexpr std::string_view backend_name() { return "nccl"; }

  /// Joins the communicator `id` names as `rank` of `size`, on `device`. Fails with TimeoutError when
  /// not every rank joins within options.timeout.
  static NcclCommunicator create(int rank, int size, c10::DeviceIndex device, const ncclUniqueId& id,
                                 CommOptions options = {}) {
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
        throw TimeoutError(detail::str("fsdpx: ", ctx, " did not complete within ", options.timeout.count(),
                                       " ms: not every rank joined"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ncclCommGetAsyncError(comm, &rc);
    }
    FSDPX_CHECK_AS(CommError, rc == ncclSuccess, ctx, " failed: ", ncclGetErrorString(rc), " (",
                   ncclGetLastError(comm), ")");
    return NcclCommunicator(std::make_shared<detail::NcclCommState>(comm, device, std::move(options)));
  }

  /// All ranks of a torchrun or srun job, one GPU each (LOCAL_RANK picks it). NCCL's unique id
  /// travels through a TCPStore at MASTER_ADDR:MASTER_PORT; a single process needs none. Under
  /// mpirun without those variables, use dist::nccl_world() (<fsdpx/dist/launch.hpp>), which carries
  /// the id over MPI, or world(bootstrap) below.
  static NcclCommunicator world(CommOptions options = {}) {
    const LaunchEnv env = detect_launch_env();
    ncclUniqueId id{};
    if (env.world_size == 1) {
      ncclGetUniqueId(&id);
    } else {
      FSDPX_CHECK(env.has_rendezvous(), "NcclCommunicator::world() at ", env.world_size,
                  " ranks (", to_string(env.launcher), " launch) needs MASTER_ADDR and MASTER_PORT for NCCL's unique "
                  "id; under mpirun, call fsdpx::dist::nccl_world() (<fsdpx/dist/launch.hpp>), which carries it over "
                  "MPI, or export both");
      Rendezvous rendezvous(env, options.timeout);
      id = unique_id(rendezvous, options.name);
    }
    return create(env.rank, env.world_size, static_cast<c10::DeviceIndex>(env.local_rank), id, std::move(options));
  }

  /// The same ranks, with NCCL's unique id broadcast over `bootstrap`: a host communicator over this
  /// job's ranks (an MpiCommunicator under mpirun). It is kept as long as the NCCL world: its last
  /// handle may end its runtime (MPI_Finalize), and a program using it afterwards could not.
  template <Communicator Bootstrap>
  static NcclCommunicator world(Bootstrap bootstrap, CommOptions options = {}) {
    const LaunchEnv env = detect_launch_env();
    FSDPX_CHECK(bootstrap.rank() == env.rank && bootstrap.size() == env.world_size, "the bootstrap communicator '",
                bootstrap.name(), "' is rank ", bootstrap.rank(), " of ", bootstrap.size(), " but the ",
                to_string(env.launcher), " environment says rank ", env.rank, " of ", env.world_size,
                ": bootstrap NCCL's world over a communicator of all the job's ranks");
    const ncclUniqueId id = unique_id(bootstrap);
    auto comm = create(env.rank, env.world_size, static_cast<c10::DeviceIndex>(env.local_rank), id, std::move(options));
    comm.state_->keep_alive(std::make_shared<Bootstrap>(std::move(bootstrap)));
    return comm;
  }

  /// Rank 0 creates the id; the others receive it through the store.
  static ncclUniqueId unique_id(Rendezvous& rendezvous, const std::string& key) {
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

  /// Rank 0 of `bootstrap` (a host communicator: MpiCommunicator, or an AnyCommunicator of one)
  /// creates the id and broadcasts it.
  template <Communicator Bootstrap>
  static ncclUniqueId unique_id(Bootstrap& bootstrap) {
    FSDPX_CHECK(bootstrap.device_type() == c10::DeviceType::CPU, "NCCL's unique id is bootstrapped over a host "
                "communicator, but '", bootstrap.name(), "' is a ", bootstrap.backend_name(), " communicator");
    ncclUniqueId id{};
    auto bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::TensorOptions().dtype(at::kByte));
    if (bootstrap.rank() == 0) {
      ncclGetUniqueId(&id);
      std::memcpy(bytes.data_ptr(), &id, sizeof(id));
    }
    bootstrap.broadcast_async(bytes, 0).wait_host();
    std::memcpy(&id, bytes.const_data_ptr(), sizeof(id));
    return id;
  }

  int rank() const { return state_->rank(); }
  int size() const { return state_->size(); }
  const std::string& name() const { return state_->options().name; }
  c10::DeviceIndex device() const { return state_->device(); }
  /// The stream this communicator's collectives run on.
  cudaStream_t stream() const { return state_->stream(); }
  ncclComm_t native_handle() const { return state_->comm(); }
  bool is_broken() const { return state_->health()->broken(); }

  // ---- batches: record collectives, then launch them as one NCCL group -------------------------
  void add_all_gather(NcclBatch& batch, at::Tensor output, const at::Tensor& input) const {
    const auto ctx = context("all_gather");
    check_pair(ctx, output, input);
    detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
    const auto type = detail::nccl_dtype(ctx, input.scalar_type());
    const auto count = static_cast<size_t>(input.numel());
    note(batch, "all_gather", {output, input});  // first: the batch holds what its calls point into
    batch.calls.push_back({detail::NcclCall::Kind::all_gather, input.const_data_ptr(), output.data_ptr(), count, type});
  }

  /// Grouped send/receive (NCCL has no gather); the root's own slot is a device copy unless in place.
  void add_gather(NcclBatch& batch, at::Tensor output, const at::Tensor& input, int root) const {
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

  void add_reduce_scatter(NcclBatch& batch, at::Tensor output, const at::Tensor& input, ReduceOp op) const {
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

  void add_all_reduce(NcclBatch& batch, at::Tensor tensor, ReduceOp op) const {
    const auto ctx = context("all_reduce");
    detail::check_tensor(ctx, "tensor", tensor, device_type());
    check_device(ctx, tensor);
    detail::check_reduce_dtype(ctx, op == ReduceOp::avg, tensor);
    const auto type = detail::nccl_dtype(ctx, tensor.scalar_type());
    const auto count = static_cast<size_t>(tensor.numel());
    note(batch, "all_reduce", {tensor});
    batch.calls.push_back({detail::NcclCall::Kind::all_reduce, nullptr, tensor.data_ptr(), count, type,
                           detail::nccl_op(op, size())});
  }

  void add_broadcast(NcclBatch& batch, at::Tensor tensor, int root) const {
    const auto ctx = context("broadcast");
    detail::check_tensor(ctx, "tensor", tensor, device_type());
    check_device(ctx, tensor);
    detail::check_root(ctx, root, size());
    const auto type = detail::nccl_dtype(ctx, tensor.scalar_type());
    const auto count = static_cast<size_t>(tensor.numel());
    note(batch, "broadcast", {tensor});
    batch.calls.push_back({detail::NcclCall::Kind::broadcast, tensor.const_data_ptr(), tensor.data_ptr(), count, type,
                           ncclSum, root});
  }

  /// Launches a batch after the caller's current stream's pending work; one Work for all of it.
  Work launch(NcclBatch batch) {
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
    return Work(detail::WorkStatePool::make<detail::NcclWorkState>(state_, std::move(done), std::move(batch.tensors), ctx));
  }

  // ---- the Communicator concept ----------------------------------------------------------------
  Work all_gather_async(at::Tensor output, const at::Tensor& input) {
    NcclBatch b;
    add_all_gather(b, std::move(output), input);
    return launch(std::move(b));
  }
  Work gather_async(at::Tensor output, const at::Tensor& input, int root) {
    NcclBatch b;
    add_gather(b, std::move(output), input, root);
    return launch(std::move(b));
  }
  Work reduce_scatter_async(at::Tensor output, const at::Tensor& input, ReduceOp op = ReduceOp::sum) {
    NcclBatch b;
    add_reduce_scatter(b, std::move(output), input, op);
    return launch(std::move(b));
  }
  Work all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::sum) {
    NcclBatch b;
    add_all_reduce(b, std::move(tensor), op);
    return launch(std::move(b));
  }
  Work broadcast_async(at::Tensor tensor, int root) {
    NcclBatch b;
    add_broadcast(b, std::move(tensor), root);
    return launch(std::move(b));
  }
  /// NCCL has no barrier: an all-reduce of one byte, as c10d does.
  Work barrier_async() {
    c10::cuda::CUDAGuard guard(device());
    auto token = at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device()));
    return all_reduce_async(std::move(token), ReduceOp::sum);
  }

  std::optional<NcclCommunicator> split(int color, int key, std::string_view name = {}) const {
    const auto ctx = context("split");
    FSDPX_CHECK(color >= 0 || color == no_color, ctx, ": color ", color, " must be >= 0 or fsdpx::dist::no_color");
    state_->health()->check(ctx);
    c10::cuda::CUDAGuard guard(device());
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const auto calls = state_->lock_calls(ctx);
    state_->settle(ncclCommSplit(native_handle(), color == no_color ? NCCL_SPLIT_NOCOLOR : color, key, &child,
                                 &config),
                   ctx);
    if (child != nullptr) {
      ncclResult_t rc = ncclInProgress;
      ncclCommGetAsyncError(child, &rc);
      const auto deadline = deadline_after(state_->options().timeout);
      while (rc == ncclInProgress && std::chrono::steady_clock::now() < deadline) ncclCommGetAsyncError(child, &rc);
      FSDPX_CHECK_AS(CommError, rc == ncclSuccess, ctx, " failed: ", ncclGetErrorString(rc));
    }
    if (child == nullptr) return std::nullopt;
    CommOptions options = state_->options();
    options.name = name.empty() ? detail::str(this->name(), "/", color) : std::string(name);
    return NcclCommunicator(std::make_shared<detail::NcclCommState>(child, device(), std::move(options)));
  }

 private:
  explicit NcclCommunicator(std::shared_ptr<detail::NcclCommState> state) : state_(std::move(state)) {}

  detail::OpContext context(std::string_view op) const { return state_->context(std::string(op)); }

  void check_device(const detail::OpContext& ctx, const at::Tensor& t) const {
    FSDPX_CHECK(t.device().index() == device(), ctx, ": tensor is on ", t.device(), " but the communicator uses cuda:",
                static_cast<int>(device()));
  }
  void check_pair(const detail::OpContext& ctx, const at::Tensor& output, const at::Tensor& input) const {
    detail::check_tensor(ctx, "output", output, device_type());
    detail::check_tensor(ctx, "input", input, device_type());
    detail::check_same_dtype(ctx, output, input);
    check_device(ctx, output);
  }
  static void note(NcclBatch& batch, std::string_view op, std::initializer_list<at::Tensor> tensors) {
    if (!batch.names.empty()) batch.names += '+';
    batch.names += op;
    batch.tensors.insert(batch.tensors.end(), tensors.begin(), tensors.end());
  }

  std::shared_ptr<detail::NcclCommState> state_;
};

static_assert(Communicator<NcclCommunicator>);

}  // namespace fsdpx::dist
