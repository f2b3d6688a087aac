// MPI backend: collectives over CPU tensors between processes started by mpirun, mpiexec or srun.
//
//   auto world = fsdpx::dist::MpiCommunicator::world();      // initialises MPI on first use
//   world.all_gather(full, shard);                           // blocking
//   auto work = world.reduce_scatter_async(grad_shard, grad, ReduceOp::avg);
//   ...                                                      // compute overlaps the reduction
//   work.wait_host();
#pragma once

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
  static std::shared_ptr<MpiRuntime> acquire() {
    static std::mutex mutex;
    static std::weak_ptr<MpiRuntime> current;
    std::lock_guard lock(mutex);
    if (auto rt = current.lock()) return rt;
    auto rt = std::shared_ptr<MpiRuntime>(new MpiRuntime());
    current = rt;
    return rt;
  }

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
  ~MpiRuntime() {
    const bool unwinding = std::uncaught_exceptions() > 0;
    engine_->stop(/*failing=*/unwinding || engine_->any_failure());
    types_.destroy();
    EndOfMpi end{engine_->any_failure(), engine_->first_failure_was_departure(), engine_->first_failure(), owns_mpi_};
    if (!unwinding) {
      end.run();
      return;
    }
    static EndOfMpi at_exit;
    at_exit = std::move(end);
    std::atexit([] { at_exit.run(); });
  }

  /// Engine thread, collective over MPI_COMM_WORLD on first use: the channel departure notices use.
  void open_control_channel(std::chrono::milliseconds heartbeat_timeout) {
    if (engine_->control().is_open()) return;
    MPI_Comm control = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &control);
    FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed: ", detail::mpi_error_string(rc));
    MPI_Comm_set_errhandler(control, MPI_ERRORS_RETURN);
    engine_->open_control(control, heartbeat_timeout);
  }

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
  std::uint64_t next_world_id() { return detail::derive_comm_id(0x776f726c64ULL, world_count_++, 0); }
  const detail::MpiTypes& types() const { return types_; }

 private:
  MpiRuntime() {
    int initialized = 0;
    int finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    FSDPX_CHECK(finalized == 0, "MPI was already finalized in this process; keep one MpiCommunicator alive for "
                "as long as the program communicates");
    int provided = MPI_THREAD_SINGLE;
    if (initialized == 0) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Init_thread failed: ", detail::mpi_error_string(rc));
      owns_mpi_ = true;
    } else {
      MPI_Query_thread(&provided);
    }
    FSDPX_CHECK(provided >= MPI_THREAD_SERIALIZED, "the MPI library provides thread level ", provided,
                " but fsdpx needs MPI_THREAD_SERIALIZED (its progress thread makes the MPI calls); "
                "if you call MPI_Init yourself, use MPI_Init_thread with MPI_THREAD_SERIALIZED or higher");
    types_.create();
    engine_ = std::make_unique<detail::MpiEngine>();
  }

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
  static MpiCommunicator world(CommOptions options = {}) {
    const auto heartbeat_timeout = default_heartbeat_timeout();  // a bad value fails before any collective
    auto runtime = MpiRuntime::acquire();
    const LaunchEnv env = detect_launch_env();
    const auto [world_rank, world_size] = runtime->engine().run([] {
      int r = 0, n = 1;
      MPI_Comm_rank(MPI_COMM_WORLD, &r);
      MPI_Comm_size(MPI_COMM_WORLD, &n);
      return std::pair{r, n};
    });
    // A bounded barrier first: MPI_Comm_dup blocks without a deadline if a rank never arrives.
    runtime->engine()
        .submit({detail::op_context("join", options.name, world_rank, world_size),
                 detail::MpiTask::single([](MPI_Request* r) { return MPI_Ibarrier(MPI_COMM_WORLD, r); }), {},
                 options.timeout,
                 std::make_shared<detail::CommHealth>(), all_ranks(world_size), detail::CollectiveId{}, options.report_interval})
        .wait_host();
    auto comm = runtime->engine().run([&runtime, heartbeat_timeout] {
      runtime->open_control_channel(heartbeat_timeout);
      MPI_Comm dup = MPI_COMM_NULL;
      const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
      FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed: ",
                     detail::mpi_error_string(rc));
      MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
      return dup;
    });
    const std::uint64_t id = runtime->next_world_id();
    MpiCommunicator world(std::make_shared<State>(std::move(runtime), comm, std::move(options), id));
    FSDPX_CHECK(env.launcher == Launcher::single_process ||
                    (env.rank == world.rank() && env.world_size == world.size()),
                "the ", to_string(env.launcher), " environment says rank ", env.rank, " of ", env.world_size,
                " but MPI says rank ", world.rank(), " of ", world.size(), ": ", launcher_mismatch_hint(env.launcher));
    return world;
  }

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  const std::string& name() const { return state_->options.name; }
  const CommOptions& options() const { return state_->options; }
  MPI_Comm native_handle() const { return state_->comm; }
  /// True after a collective on this communicator failed or timed out.
  /// True after a collective on this communicator failed or timed out, or once one of its ranks left
  /// the job after an error or stopped answering (its collectives can no longer complete).
  bool is_broken() const {
    return state_->health->broken() || state_->runtime->engine().control().lost_any(*state_->members);
  }

  /// A ring of W - 1 send/receive stages straight into the output's slots: Open MPI 4's nonblocking
  /// MPI_Iallgather is up to 5x slower than its blocking form at FSDP's message sizes.
  Work all_gather_async(at::Tensor output, const at::Tensor& input) {
    const auto ctx = context("all_gather");
    detail::check_tensor(ctx, "output", output, device_type());
    detail::check_tensor(ctx, "input", input, device_type());
    detail::check_same_dtype(ctx, output, input);
    detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
    const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
    const int count = checked_count(ctx, input.numel());
    const int W = size(), r = rank(), tag = next_tag();
    const auto mod = [W](int c) { return ((c % W) + W) % W; };
    // In place when the input already is this rank's slot of the output (FSDP's copy-in layout).
    const auto slot = [flat = output.view({-1}), n = input.numel()](int c) { return flat.narrow(0, c * n, n); };
    const bool in_place = input.const_data_ptr() == slot(r).const_data_ptr();
    FSDPX_CHECK(in_place || !overlaps(output, input), ctx,
                ": the input overlaps the output but is not this rank's slot of it");
    // Stage s forwards slot r-s to rank r+1 and receives slot r-s-1 from rank r-1.
    auto step = [=, comm = native_handle(), stage = 0](std::vector<MPI_Request>& requests,
                                                       std::vector<detail::ReceiveSize>& receives) mutable {
      if (stage == 0 && !in_place) slot(r).copy_(input.view({-1}));
      if (stage == W - 1) return MPI_SUCCESS;
      const at::Tensor send = slot(mod(r - stage)), recv = slot(mod(r - stage - 1));
      ++stage;
      requests.resize(2, MPI_REQUEST_NULL);
      receives = {{type, count}, {}};
      if (const int rc = MPI_Irecv(recv.data_ptr(), count, type, mod(r - 1), tag, comm, &requests[0]); rc != MPI_SUCCESS) {
        return rc;
      }
      return MPI_Isend(send.const_data_ptr(), count, type, mod(r + 1), tag, comm, &requests[1]);
    };
    return submit_steps(ctx, std::move(step), {});
  }

  /// Point to point, in pieces of at most gather_piece_bytes, one piece per stage: with shared memory
  /// the receiving process makes the copy inside an MPI call, so a root that received a whole large
  /// input in one message would hold its progress thread for that long, and every other collective
  /// waiting to be started or finished on it (e.g. a weight broadcast) would wait too.
  Work gather_async(at::Tensor output, const at::Tensor& input, int root) {
    const auto ctx = context("gather");
    detail::check_root(ctx, root, size());
    detail::check_tensor(ctx, "input", input, device_type());
    const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
    checked_count(ctx, input.numel());
    const int W = size(), r = rank();
    const int64_t n = input.numel();
    const int64_t piece = std::max<int64_t>(1, gather_piece_bytes / static_cast<int64_t>(input.element_size()));
    const int64_t pieces = (n + piece - 1) / piece;
    const auto part = [piece, n](const at::Tensor& flat, int64_t j) { return flat.narrow(0, j * piece, std::min(piece, n - j * piece)); };
    if (r != root) {
      // Every piece at once: the root takes them in order (same source and tag).
      auto step = [=, comm = native_handle(), tag = next_tag(), flat = input.view({-1}), started = false](
                      std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>&) mutable {
        if (started) return MPI_SUCCESS;
        started = true;
        for (int64_t j = 0; j < pieces; ++j) {
          const at::Tensor p = part(flat, j);
          requests.emplace_back(MPI_REQUEST_NULL);
          if (const int rc = MPI_Isend(p.const_data_ptr(), static_cast<int>(p.numel()), type, root, tag, comm, &requests.back());
              rc != MPI_SUCCESS) {
            return rc;
          }
        }
        return MPI_SUCCESS;
      };
      return submit_steps(ctx, std::move(step), {});
    }
    detail::check_tensor(ctx, "output", output, device_type());
    detail::check_same_dtype(ctx, output, input);
    detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
    const auto slot = [flat = output.view({-1}), n](int c) { return flat.narrow(0, c * n, n); };
    const bool in_place = input.const_data_ptr() == slot(r).const_data_ptr();
    FSDPX_CHECK(in_place || !overlaps(output, input), ctx,
                ": the input overlaps the output but is not the root's slot of it");
    // The tag is taken after every check, so a rejected call leaves the ranks' sequences in step.
    auto step = [=, comm = native_handle(), tag = next_tag(), j = int64_t{0}](
                    std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>& receives) mutable {
      if (j == 0 && !in_place) slot(r).copy_(input.view({-1}));
      if (j == pieces) return MPI_SUCCESS;
      for (int c = 0; c < W; ++c) {
        if (c == r) continue;
        const at::Tensor p = part(slot(c), j);
        requests.emplace_back(MPI_REQUEST_NULL);
        receives.push_back({type, static_cast<int>(p.numel())});
        if (const int rc = MPI_Irecv(p.data_ptr(), static_cast<int>(p.numel()), type, c, tag, comm, &requests.back());
            rc != MPI_SUCCESS) {
          return rc;
        }
      }
      ++j;
      return MPI_SUCCESS;
    };
    return submit_steps(ctx, std::move(step), {});
  }

  /// A ring (W - 1 stages of send/receive with the neighbours) whose reductions run as vectorised
  /// ATen kernels: Open MPI 4's reduce_scatter_block reduces to one root and scatters, several times
  /// slower, and reduces bfloat16/float16 through a scalar user op.
  Work reduce_scatter_async(at::Tensor output, const at::Tensor& input, ReduceOp op = ReduceOp::sum) {
    const auto ctx = context("reduce_scatter");
    detail::check_tensor(ctx, "output", output, device_type());
    detail::check_tensor(ctx, "input", input, device_type());
    detail::check_same_dtype(ctx, output, input);
    detail::check_scatter_sizes(ctx, input, "input", output, "output", size());
    detail::check_reduce_dtype(ctx, op == ReduceOp::avg, input);
    FSDPX_CHECK(input.scalar_type() != at::kBool, ctx, ": reductions over bool tensors are not supported");
    FSDPX_CHECK(!overlaps(output, input), ctx, ": the output overlaps the input");
    const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
    const int count = checked_count(ctx, output.numel());
    const int W = size(), r = rank(), tag = next_tag();
    const auto mod = [W](int c) { return ((c % W) + W) % W; };
    const auto flat_out = output.view({-1});
    const auto chunk = [flat_in = input.view({-1}), n = output.numel()](int c) { return flat_in.narrow(0, c * n, n); };
    // Stage s sends the partial reduction of chunk r-s-1 to rank r+1 and receives chunk r-s-2's from
    // rank r-1; the partial received last (stage W-2) is chunk r, which only lacks our own share.
    auto buffers = W > 1 ? std::array{memory::empty_step_buffer(flat_out.numel(), flat_out.options()),
                                      memory::empty_step_buffer(flat_out.numel(), flat_out.options())}
                      : std::array<at::Tensor, 2>{};
    auto step = [=, comm = native_handle(), stage = 0](std::vector<MPI_Request>& requests,
                                                       std::vector<detail::ReceiveSize>& receives) mutable {
      if (W == 1) {
        flat_out.copy_(chunk(0));
        return MPI_SUCCESS;
      }
      if (stage > 0) {
        at::Tensor& got = buffers[(stage - 1) % 2];
        const auto own = chunk(mod(r - stage - 1));
        if (stage == W - 1) {
          combine(op, flat_out, got, own);
          return MPI_SUCCESS;
        }
        combine(op, got, got, own);
      }
      const at::Tensor send = stage == 0 ? chunk(mod(r - 1)) : buffers[(stage - 1) % 2];
      const at::Tensor& recv = buffers[stage % 2];
      ++stage;
      requests.resize(2, MPI_REQUEST_NULL);
      receives = {{type, count}, {}};
      if (const int rc = MPI_Irecv(recv.data_ptr(), count, type, mod(r - 1), tag, comm, &requests[0]); rc != MPI_SUCCESS) {
        return rc;
      }
      return MPI_Isend(send.const_data_ptr(), count, type, mod(r + 1), tag, comm, &requests[1]);
    };
    return submit_steps(ctx, std::move(step), average_after(op, output));
  }

  Work all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::sum) {
    const auto ctx = context("all_reduce");
    detail::check_tensor(ctx, "tensor", tensor, device_type());
    detail::check_reduce_dtype(ctx, op == ReduceOp::avg, tensor);
    const MPI_Datatype type = detail::MpiTypes::datatype(ctx, tensor.scalar_type());
    const MPI_Op mpi_op = state_->runtime->types().reduction(ctx, op, tensor.scalar_type());
    const int count = checked_count(ctx, tensor.numel());
    return submit(
        ctx,
        [=, comm = native_handle()](MPI_Request* r) {
          return MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), count, type, mpi_op, comm, r);
        },
        average_after(op, tensor));
  }

  Work broadcast_async(at::Tensor tensor, int root) {
    const auto ctx = context("broadcast");
    detail::check_tensor(ctx, "tensor", tensor, device_type());
    detail::check_root(ctx, root, size());
    const MPI_Datatype type = detail::MpiTypes::datatype(ctx, tensor.scalar_type());
    const int count = checked_count(ctx, tensor.numel());
    return submit(ctx, [=, comm = native_handle()](MPI_Request* r) {
      return MPI_Ibcast(tensor.data_ptr(), count, type, root, comm, r);
    });
  }

  Work barrier_async() {
    return submit(context("barrier"), [comm = native_handle()](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
  }

  /// Splits like MPI_Comm_split: ranks with equal `color` form a group ordered by `key`. Ranks passing
  /// no_color get std::nullopt. First a bounded barrier, so a missing peer times out instead of hanging.
  std::optional<MpiCommunicator> split(int color, int key, std::string_view name = {}) const {
    const auto ctx = context("split");
    FSDPX_CHECK(color >= 0 || color == no_color, ctx, ": color ", color, " must be >= 0 or fsdpx::dist::no_color");
    MpiCommunicator(*this).barrier();
    const std::uint64_t split_index = state_->splits++;  // on every rank of the parent, in the same order
    MPI_Comm parent = native_handle();
    MPI_Comm child = state_->runtime->engine().run([&] {
      MPI_Comm c = MPI_COMM_NULL;
      const int rc = MPI_Comm_split(parent, color == no_color ? MPI_UNDEFINED : color, key, &c);
      FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, ctx, " failed: ", detail::mpi_error_string(rc));
      if (c != MPI_COMM_NULL) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
      return c;
    });
    if (child == MPI_COMM_NULL) return std::nullopt;
    CommOptions options = state_->options;
    options.name = name.empty() ? detail::str(this->name(), "/", color) : std::string(name);
    return MpiCommunicator(std::make_shared<State>(state_->runtime, child, std::move(options),
                                                   detail::derive_comm_id(state_->id, split_index, static_cast<std::uint64_t>(color))));
  }

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
    std::shared_ptr<const std::vector<int>> members;  // world ranks, sorted: whose departure fails our collectives
    std::uint64_t id;                                   // the same on every member (see derive_comm_id)
    std::shared_ptr<std::atomic<std::uint64_t>> started;  // collectives submitted: each one's sequence number
    std::atomic<std::uint64_t> splits{0};
    std::atomic<std::uint64_t> sequence{0};
  };

  static std::shared_ptr<const std::vector<int>> all_ranks(int n) {
    std::vector<int> ranks(static_cast<size_t>(n));
    std::iota(ranks.begin(), ranks.end(), 0);
    return std::make_shared<const std::vector<int>>(std::move(ranks));
  }

  /// Engine thread.
  static std::shared_ptr<const std::vector<int>> world_ranks_of(MPI_Comm comm, int n) {
    MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> local(static_cast<size_t>(n)), ranks(static_cast<size_t>(n), MPI_UNDEFINED);
    std::iota(local.begin(), local.end(), 0);
    MPI_Group_translate_ranks(group, n, local.data(), world, ranks.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    std::erase(ranks, MPI_UNDEFINED);  // not in MPI_COMM_WORLD (dynamic processes): not watched
    std::sort(ranks.begin(), ranks.end());
    return std::make_shared<const std::vector<int>>(std::move(ranks));
  }

  explicit MpiCommunicator(std::shared_ptr<State> state) : state_(std::move(state)) {}

  std::string context(std::string_view op) const { return detail::op_context(op, name(), rank(), size()); }

  /// See gather_async.
  static constexpr int64_t gather_piece_bytes = int64_t{4} << 20;

  static int checked_count(const std::string& ctx, int64_t numel) {
    FSDPX_CHECK(numel <= INT_MAX, ctx, ": ", numel, " elements exceed MPI's int count limit (", INT_MAX,
                "); split the tensor");
    return static_cast<int>(numel);
  }

  static bool overlaps(const at::Tensor& a, const at::Tensor& b) {
    const auto* a0 = static_cast<const char*>(a.const_data_ptr());
    const auto* b0 = static_cast<const char*>(b.const_data_ptr());
    return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  }

  std::function<void()> average_after(ReduceOp op, const at::Tensor& result) const {
    if (op != ReduceOp::avg) return {};
    return [result, n = size()]() mutable { result.div_(n); };
  }

  Work submit(std::string ctx, std::function<int(MPI_Request*)> start, std::function<void()> finish = {}) {
    return submit_steps(std::move(ctx), detail::MpiTask::single(std::move(start)), std::move(finish));
  }
  Work submit_steps(std::string ctx, detail::MpiTask::Step step, std::function<void()> finish) {
    return state_->runtime->engine().submit(
        {std::move(ctx), std::move(step), std::move(finish), state_->options.timeout, state_->health, state_->members,
         detail::CollectiveId{state_->id, ++*state_->started}, state_->options.report_interval});
  }

  /// out = a (op) b, elementwise; `out` may alias `a`.
  static void combine(ReduceOp op, const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: at::add_out(const_cast<at::Tensor&>(out), a, b); break;
      case ReduceOp::max: at::maximum_out(const_cast<at::Tensor&>(out), a, b); break;
      case ReduceOp::min: at::minimum_out(const_cast<at::Tensor&>(out), a, b); break;
    }
  }

  /// Tags keep the point-to-point messages of concurrent ring collectives apart. Every rank submits
  /// collectives in the same order, so the sequence agrees across ranks.
  int next_tag() const { return 1 + static_cast<int>(state_->sequence.fetch_add(1) % 32000); }

  std::shared_ptr<State> state_;
};

static_assert(Communicator<MpiCommunicator>);

}  // namespace fsdpx::dist
