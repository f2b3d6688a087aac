// MPI backend: collectives over CPU tensors between processes started by mpirun, mpiexec or srun.
//
//   auto world = fsdpx::dist::MpiCommunicator::world();      // initialises MPI on first use
//   world.all_gather(full, shard);                           // blocking
//   auto work = world.reduce_scatter_async(grad_shard, grad, ReduceOp::avg);
//   ...                                                      // compute overlaps the reduction
//   work.wait_host();
#pragma once

#include <fsdpx/detail/config.hpp>

#if !defined(FSDPX_WITH_MPI)
#error "fsdpx/dist/mpi.hpp needs FSDPX_WITH_MPI: configure fsdpx where MPI is installed (docs/building.md)"
#endif

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/detail/mpi_steps.hpp>

namespace fsdpx::dist {

class MpiCommunicator : public BlockingCollectives<MpiCommunicator> {
 public:
  static constexpr c10::DeviceType device_type() { return c10::DeviceType::CPU; }
  static constexpr std::string_view backend_name() { return "mpi"; }

  /// All processes of the job (a private duplicate of MPI_COMM_WORLD). Initialises MPI when needed and
  /// checks the launcher's variables against MPI's view of the job.
  FSDPX_DECL static MpiCommunicator world(CommOptions options = {});

  FSDPX_DECL int rank() const;
  FSDPX_DECL int size() const;
  FSDPX_DECL const std::string& name() const;
  FSDPX_DECL const CommOptions& options() const;
  FSDPX_DECL MPI_Comm native_handle() const;
  /// True after a collective on this communicator failed or timed out, or once one of its ranks left
  /// the job after an error or stopped answering (its collectives can no longer complete).
  FSDPX_DECL bool is_broken() const;

  /// A ring of W - 1 send/receive stages straight into the output's slots: Open MPI 4's nonblocking
  /// MPI_Iallgather is much slower than its blocking form at FSDP's message sizes (docs/benchmarks.md).
  FSDPX_DECL Work all_gather_async(at::Tensor output, const at::Tensor& input);

  /// Point to point, in pieces of at most gather_piece_bytes, one piece per stage: with shared memory
  /// the receiving process makes the copy inside an MPI call, so a root that received a whole large
  /// input in one message would hold its progress thread for that long, and every other collective
  /// waiting to be started or finished on it (e.g. a weight broadcast) would wait too.
  FSDPX_DECL Work gather_async(at::Tensor output, const at::Tensor& input, int root);

  /// A ring (W - 1 stages of send/receive with the neighbours) whose reductions run as vectorised
  /// ATen kernels: Open MPI 4's reduce_scatter_block reduces to one root and scatters, several times
  /// slower, and reduces bfloat16/float16 through a scalar user op.
  FSDPX_DECL Work reduce_scatter_async(at::Tensor output, const at::Tensor& input, ReduceOp op = ReduceOp::sum);

  /// One stage: a receive from and a send to every other rank at once, straight into and out of the
  /// tensors' blocks (no staging copy); each receive checks the size its peer sent.
  FSDPX_DECL Work all_to_all_v_async(at::Tensor output, const at::Tensor& input, at::IntArrayRef output_splits,
                                     at::IntArrayRef input_splits);
  /// all_to_all_v_async with n elements per rank each way, over the flattened tensors.
  FSDPX_DECL Work all_to_all_async(at::Tensor output, const at::Tensor& input);

  FSDPX_DECL Work all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::sum);

  FSDPX_DECL Work broadcast_async(at::Tensor tensor, int root);

  FSDPX_DECL Work barrier_async();

  /// Splits like MPI_Comm_split: ranks with equal `color` form a group ordered by `key`. Ranks passing
  /// no_color get std::nullopt. First a bounded barrier, so a missing peer times out instead of hanging.
  FSDPX_DECL std::optional<MpiCommunicator> split(int color, int key, std::string_view name = {}) const;

 private:
  struct State;  // impl/mpi.ipp: the MPI communicator, its options, health and counters

  FSDPX_DECL static std::shared_ptr<const std::vector<int>> all_ranks(int n);

  /// Engine thread.
  FSDPX_DECL static std::shared_ptr<const std::vector<int>> world_ranks_of(MPI_Comm comm, int n);

  explicit MpiCommunicator(std::shared_ptr<State> state) : state_(std::move(state)) {}

  FSDPX_DECL detail::OpContext context(std::string_view op) const;

  /// See gather_async.
  static constexpr int64_t gather_piece_bytes = int64_t{4} << 20;

  FSDPX_DECL static int checked_count(const detail::OpContext& ctx, int64_t numel);

  FSDPX_DECL detail::MpiFinish average_after(ReduceOp op, const at::Tensor& result) const;

  FSDPX_DECL Work submit(detail::OpContext ctx, detail::MpiStart start, detail::MpiFinish finish);
  FSDPX_DECL Work submit_steps(detail::OpContext ctx, detail::MpiStep step, detail::MpiFinish finish);

  /// out = a (op) b, elementwise; `out` may alias `a`.
  FSDPX_DECL static void combine(ReduceOp op, const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

  /// Tags keep the point-to-point messages of concurrent ring collectives apart. Every rank submits
  /// collectives in the same order, so the sequence agrees across ranks.
  FSDPX_DECL int next_tag() const;

  std::shared_ptr<State> state_;
};

static_assert(Communicator<MpiCommunicator>);

}  // namespace fsdpx::dist

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dist/impl/mpi.ipp>
#endif
