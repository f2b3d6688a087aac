// NCCL backend: collectives over CUDA tensors, one rank per GPU.
//
// Each communicator runs its collectives on its own high-priority CUDA stream. A collective first
// waits (an event, not a host sync) for the caller's current stream, so inputs written there are
// complete; Work::wait_stream() makes the caller's current stream wait for the collective's end, and
// Work::wait_host() blocks the host on it. Tensors are held until one of them (no recordStream), so
// memory is reused deterministically, as in PyTorch's FSDP2.
// A watchdog thread aborts the communicator when a collective outlives CommOptions::timeout or NCCL
// reports an asynchronous error; every later call then throws with that cause.
//
// The backend's shape, as MPI's (docs/architecture.md): this header declares the communicator, its
// parts are declared in dist/detail/nccl_state.hpp, and the definitions are in dist/impl/nccl.ipp
// and dist/impl/nccl_state.ipp.
#pragma once

#if !defined(FSDPX_WITH_NCCL)
#error "fsdpx/dist/nccl.hpp needs FSDPX_WITH_NCCL: configure fsdpx with a CUDA LibTorch and NCCL (docs/building.md)"
#endif

#include <fsdpx/detail/config.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/SmallVector.h>

#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/detail/nccl_state.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/rendezvous.hpp>

namespace fsdpx::dist {

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
  FSDPX_DECL static NcclCommunicator create(int rank, int size, c10::DeviceIndex device, const ncclUniqueId& id,
                                            CommOptions options = {});

  /// All ranks of a torchrun or srun job, one GPU each (LOCAL_RANK picks it). NCCL's unique id
  /// travels through a TCPStore at MASTER_ADDR:MASTER_PORT; a single process needs none. Under
  /// mpirun without those variables, use dist::nccl_world() (<fsdpx/dist/launch.hpp>), which carries
  /// the id over MPI, or world(bootstrap) below.
  FSDPX_DECL static NcclCommunicator world(CommOptions options = {});

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
  FSDPX_DECL static ncclUniqueId unique_id(Rendezvous& rendezvous, const std::string& key);

  /// Rank 0 of `bootstrap` (a host communicator: MpiCommunicator, or an AnyCommunicator of one)
  /// creates the id and broadcasts it.
  template <Communicator Bootstrap>
  static ncclUniqueId unique_id(Bootstrap& bootstrap) {
    FSDPX_CHECK(bootstrap.device_type() == c10::DeviceType::CPU,
                "NCCL's unique id is bootstrapped over a host "
                "communicator, but '",
                bootstrap.name(), "' is a ", bootstrap.backend_name(), " communicator");
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
  FSDPX_DECL void add_all_gather(NcclBatch& batch, at::Tensor output, const at::Tensor& input) const;
  /// Grouped send/receive (NCCL has no gather); the root's own slot is a device copy unless in place.
  FSDPX_DECL void add_gather(NcclBatch& batch, at::Tensor output, const at::Tensor& input, int root) const;
  FSDPX_DECL void add_reduce_scatter(NcclBatch& batch, at::Tensor output, const at::Tensor& input, ReduceOp op) const;
  /// Grouped send/receive with every other rank (blocks of zero rows are skipped on both sides); this
  /// rank's own block is a device copy. NCCL cannot check that a peer sends what output_splits expects.
  FSDPX_DECL void add_all_to_all_v(NcclBatch& batch, at::Tensor output, const at::Tensor& input,
                                   at::IntArrayRef output_splits, at::IntArrayRef input_splits) const;
  FSDPX_DECL void add_all_reduce(NcclBatch& batch, at::Tensor tensor, ReduceOp op) const;
  FSDPX_DECL void add_broadcast(NcclBatch& batch, at::Tensor tensor, int root) const;

  /// Launches a batch after the caller's current stream's pending work; one Work for all of it.
  FSDPX_DECL Work launch(NcclBatch batch);

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
  Work all_to_all_v_async(at::Tensor output, const at::Tensor& input, at::IntArrayRef output_splits,
                          at::IntArrayRef input_splits) {
    NcclBatch b;
    add_all_to_all_v(b, std::move(output), input, output_splits, input_splits);
    return launch(std::move(b));
  }
  Work all_to_all_async(at::Tensor output, const at::Tensor& input) {
    const auto splits = detail::equal_all_to_all_splits(context("all_to_all"), output, input, size());
    return all_to_all_v_async(output.view({-1}), input.view({-1}), splits, splits);
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
  FSDPX_DECL Work barrier_async();

  FSDPX_DECL std::optional<NcclCommunicator> split(int color, int key, std::string_view name = {}) const;

 private:
  explicit NcclCommunicator(std::shared_ptr<detail::NcclCommState> state) : state_(std::move(state)) {}

  detail::OpContext context(std::string_view op) const { return state_->context(std::string(op)); }
  FSDPX_DECL void check_device(const detail::OpContext& ctx, const at::Tensor& t) const;
  FSDPX_DECL void check_pair(const detail::OpContext& ctx, const at::Tensor& output, const at::Tensor& input) const;
  FSDPX_DECL static void note(NcclBatch& batch, std::string_view op, std::initializer_list<at::Tensor> tensors);

  std::shared_ptr<detail::NcclCommState> state_;
};

static_assert(Communicator<NcclCommunicator>);

}  // namespace fsdpx::dist

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dist/impl/nccl.ipp>
#endif
