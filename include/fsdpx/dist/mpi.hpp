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

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/mpi_engine.hpp>
#include <fsdpx/dist/detail/mpi_types.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/memory/host.hpp>

namespace fsdpx::dist {

/// Owns MPI's lifetime in this process: MPI_Init_thread, the progress engine, datatypes and ops.
/// Shared by every MpiCommunicator; MPI is finalized when the last one goes away.
class MpiRuntime {
 public:
  FSDPX_DECL static std::shared_ptr<MpiRuntime> acquire();

  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  /// Tells the other ranks that this one leaves (so collectives waiting for it fail at once instead
  /// of at their timeout), then ends MPI:
  /// - after a failed collective, MPI_Abort ends the job: peers may sit in collectives that will never
  ///   match, so MPI_Finalize would hang with them. When the failure was a peer leaving, this rank
  ///   first gives that peer a moment to print its own error and end the job;
  /// - while an exception propagates (the program is failing, and the handler that prints the cause
  ///   has not run yet), both are left to the process's exit, after the handler;
  /// - otherwise MPI_Finalize.
  FSDPX_DECL ~MpiRuntime();

  /// Engine thread, collective over MPI_COMM_WORLD on first use: the channel departure notices use.
  FSDPX_DECL void open_control_channel(std::chrono::milliseconds heartbeat_timeout);

  /// How a process's MPI ends: MPI_Abort after a failed collective, else MPI_Finalize when fsdpx
  /// initialized MPI.
  struct EndOfMpi {
    bool failed = false;
    bool failed_by_departure = false;
    std::string cause;
    bool finalize = false;

    void run() const {
      if (failed) {
        // The peer that left reports the cause itself and ends the job; give it a moment to.
        if (failed_by_departure) std::this_thread::sleep_for(departed_peer_grace);
        std::fprintf(stderr, "fsdpx: aborting the MPI job after a failed collective: %s\n", cause.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalize && finalized == 0) MPI_Finalize();
    }
  };

  /// How long a rank whose collective failed because a peer left waits before ending the job, so the
  /// peer's own error (the cause) is printed first.
  static constexpr std::chrono::milliseconds departed_peer_grace{2000};

  detail::MpiEngine& engine() { return *engine_; }
  /// The id of the next communicator world() makes (every rank calls world() equally often).
  FSDPX_DECL std::uint64_t next_world_id();
  const detail::MpiTypes& types() const { return types_; }

 private:
  FSDPX_DECL MpiRuntime();

  bool owns_mpi_ = false;
  std::atomic<std::uint64_t> world_count_{0};
  detail::MpiTypes types_;
  std::unique_ptr<detail::MpiEngine> engine_;
};

class MpiCommunicator : public BlockingCollectives<MpiCommunicator> {
 public:
  static constexpr c10::DeviceType device_type() { return c10::DeviceType::CPU; }
  static constexpr std::string_view backend_name() { return "mpi"; }

  /// All processes of the job (a private duplicate of MPI_COMM_WORLD). Initialises MPI when needed and
  /// checks the launcher's variables against MPI's view of the job.
  FSDPX_DECL static MpiCommunicator world(CommOptions options = {});

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  const std::string& name() const { return state_->options.name; }
  const CommOptions& options() const { return state_->options; }
  MPI_Comm native_handle() const { return state_->comm; }
  /// True after a collective on this communicator failed or timed out.
  /// True after a collective on this communicator failed or timed out, or once one of its ranks left
  /// the job after an error or stopped answering (its collectives can no longer complete).
  FSDPX_DECL bool is_broken() const;

  /// A ring of W - 1 send/receive stages straight into the output's slots: Open MPI 4's nonblocking
  /// MPI_Iallgather is up to 5x slower than its blocking form at FSDP's message sizes.
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

  FSDPX_DECL Work all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::sum);

  FSDPX_DECL Work broadcast_async(at::Tensor tensor, int root);

  FSDPX_DECL Work barrier_async();

  /// Splits like MPI_Comm_split: ranks with equal `color` form a group ordered by `key`. Ranks passing
  /// no_color get std::nullopt. First a bounded barrier, so a missing peer times out instead of hanging.
  FSDPX_DECL std::optional<MpiCommunicator> split(int color, int key, std::string_view name = {}) const;

 private:
  struct State {
    State(std::shared_ptr<MpiRuntime> rt, MPI_Comm c, CommOptions opts, std::uint64_t comm_id)
        : runtime(std::move(rt)), comm(c), options(std::move(opts)), id(comm_id),
          started(runtime->engine().control().counter(comm_id)) {
      runtime->engine().run([&] {
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        members = world_ranks_of(comm, size);
      });
    }
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() {
      // A broken communicator may still have requests inside MPI; freeing it could block.
      if (comm == MPI_COMM_NULL || health->broken()) return;
      try {
        runtime->engine().run([c = comm]() mutable { MPI_Comm_free(&c); });
      } catch (...) {
      }
    }
    std::shared_ptr<MpiRuntime> runtime;
    MPI_Comm comm;
    CommOptions options;
    int rank = 0;
    int size = 1;
    std::shared_ptr<detail::CommHealth> health = std::make_shared<detail::CommHealth>();
    std::shared_ptr<const std::string> label = std::make_shared<const std::string>(options.name);  // in errors
    std::shared_ptr<const std::vector<int>> members;  // world ranks, sorted: whose departure fails our collectives
    std::uint64_t id;                                   // the same on every member (see derive_comm_id)
    std::shared_ptr<std::atomic<std::uint64_t>> started;  // collectives submitted: each one's sequence number
    std::atomic<std::uint64_t> splits{0};
    std::atomic<std::uint64_t> sequence{0};
  };

  FSDPX_DECL static std::shared_ptr<const std::vector<int>> all_ranks(int n);

  /// Engine thread.
  FSDPX_DECL static std::shared_ptr<const std::vector<int>> world_ranks_of(MPI_Comm comm, int n);

  explicit MpiCommunicator(std::shared_ptr<State> state) : state_(std::move(state)) {}

  detail::OpContext context(std::string_view op) const { return {std::string(op), state_->label, rank(), size()}; }

  /// See gather_async.
  static constexpr int64_t gather_piece_bytes = int64_t{4} << 20;

  FSDPX_DECL static int checked_count(const detail::OpContext& ctx, int64_t numel);

  FSDPX_DECL static bool overlaps(const at::Tensor& a, const at::Tensor& b);

  FSDPX_DECL detail::MpiTask::Finish average_after(ReduceOp op, const at::Tensor& result) const;

  FSDPX_DECL Work submit(detail::OpContext ctx, detail::MpiTask::Start start, detail::MpiTask::Finish finish = {});
  FSDPX_DECL Work submit_steps(detail::OpContext ctx, detail::MpiTask::Step step, detail::MpiTask::Finish finish);

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
