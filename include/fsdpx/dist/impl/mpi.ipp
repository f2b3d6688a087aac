// The MPI backend's communicator, out of line: included by fsdpx/dist/mpi.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp). Its parts, each in its own
// file: the control channel (mpi_control.ipp), the progress engine (mpi_engine.ipp) and the runtime
// (mpi_runtime.ipp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/mpi_runtime.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/impl/mpi_control.ipp>
#include <fsdpx/dist/impl/mpi_engine.ipp>
#include <fsdpx/dist/impl/mpi_runtime.ipp>
#include <fsdpx/dist/mpi.hpp>
#include <fsdpx/memory/host.hpp>

namespace fsdpx::dist {

struct MpiCommunicator::State {
  State(std::shared_ptr<detail::MpiRuntime> rt, MPI_Comm c, CommOptions opts, std::uint64_t comm_id)
      : runtime(std::move(rt)),
        comm(c),
        options(std::move(opts)),
        id(comm_id),
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
  std::shared_ptr<detail::MpiRuntime> runtime;
  MPI_Comm comm;
  CommOptions options;
  int rank = 0;
  int size = 1;
  std::shared_ptr<detail::CommHealth> health = std::make_shared<detail::CommHealth>();
  std::shared_ptr<const std::string> label = std::make_shared<const std::string>(options.name);  // in errors
  std::shared_ptr<const std::vector<int>> members;      // world ranks, sorted: whose departure fails our collectives
  std::uint64_t id;                                     // the same on every member (see derive_comm_id)
  std::shared_ptr<std::atomic<std::uint64_t>> started;  // collectives submitted: each one's sequence number
  std::atomic<std::uint64_t> splits{0};
  std::atomic<std::uint64_t> sequence{0};
};

FSDPX_DECL int MpiCommunicator::rank() const { return state_->rank; }
FSDPX_DECL int MpiCommunicator::size() const { return state_->size; }
FSDPX_DECL const std::string& MpiCommunicator::name() const { return state_->options.name; }
FSDPX_DECL const CommOptions& MpiCommunicator::options() const { return state_->options; }
FSDPX_DECL MPI_Comm MpiCommunicator::native_handle() const { return state_->comm; }

FSDPX_DECL detail::OpContext MpiCommunicator::context(std::string_view op) const {
  return {std::string(op), state_->label, rank(), size()};
}

FSDPX_DECL MpiCommunicator MpiCommunicator::world(CommOptions options) {
  const auto heartbeat_timeout = default_heartbeat_timeout();  // a bad value fails before any collective
  auto runtime = detail::MpiRuntime::acquire();
  const LaunchEnv env = detect_launch_env();
  const auto [world_rank, world_size] = runtime->engine().run([] {
    int r = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return std::pair{r, n};
  });
  // A bounded barrier first: MPI_Comm_dup blocks without a deadline if a rank never arrives.
  runtime->engine()
      .submit({detail::OpContext{"join", std::make_shared<const std::string>(options.name), world_rank, world_size},
               detail::MpiTask::single([](MPI_Request* r) { return MPI_Ibarrier(MPI_COMM_WORLD, r); }),
               {},
               options.timeout,
               std::make_shared<detail::CommHealth>(),
               all_ranks(world_size),
               detail::CollectiveId{},
               options.report_interval})
      .wait_host();
  auto comm = runtime->engine().run([&runtime, heartbeat_timeout] {
    runtime->open_control_channel(heartbeat_timeout);
    MPI_Comm dup = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed: ", detail::mpi_error_string(rc));
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    return dup;
  });
  const std::uint64_t id = runtime->next_world_id();
  MpiCommunicator world(std::make_shared<State>(std::move(runtime), comm, std::move(options), id));
  FSDPX_CHECK(env.launcher == Launcher::single_process || (env.rank == world.rank() && env.world_size == world.size()),
              "the ", to_string(env.launcher), " environment says rank ", env.rank, " of ", env.world_size,
              " but MPI says rank ", world.rank(), " of ", world.size(), ": ", launcher_mismatch_hint(env.launcher));
  return world;
}

FSDPX_DECL Work MpiCommunicator::all_gather_async(at::Tensor output, const at::Tensor& input) {
  const auto ctx = context("all_gather");
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_tensor(ctx, "input", input, device_type());
  detail::check_same_dtype(ctx, output, input);
  detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
  const int count = checked_count(ctx, input.numel());
  const int W = size(), r = rank(), tag = next_tag();
  const auto mod = [W](int c) { return ((c % W) + W) % W; };
  // Slots as addresses, not tensor views: a view is a heap allocation, and this runs per unit per step.
  // The step keeps `output` and `input` alive until the collective ends.
  const auto bytes = static_cast<std::size_t>(input.nbytes());
  const auto slot = [base = static_cast<char*>(output.data_ptr()), bytes](int c) { return base + c * bytes; };
  // In place when the input already is this rank's slot of the output (FSDP's copy-in layout).
  const bool in_place = input.const_data_ptr() == slot(r);
  FSDPX_CHECK(in_place || !detail::overlaps(output, input), ctx,
              ": the input overlaps the output but is not this rank's slot of it");
  // Stage s forwards slot r-s to rank r+1 and receives slot r-s-1 from rank r-1.
  auto step = [=, comm = native_handle(), stage = 0, keep_output = output](
                  std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>& receives) mutable {
    if (stage == 0 && !in_place && bytes > 0) std::memcpy(slot(r), input.const_data_ptr(), bytes);
    if (stage == W - 1) return MPI_SUCCESS;
    char* const send = slot(mod(r - stage));
    char* const recv = slot(mod(r - stage - 1));
    ++stage;
    requests.resize(2, MPI_REQUEST_NULL);
    receives = {{type, count}, {}};
    if (const int rc = MPI_Irecv(recv, count, type, mod(r - 1), tag, comm, &requests[0]); rc != MPI_SUCCESS) {
      return rc;
    }
    return MPI_Isend(send, count, type, mod(r + 1), tag, comm, &requests[1]);
  };
  return submit_steps(ctx, std::move(step), {});
}

FSDPX_DECL Work MpiCommunicator::gather_async(at::Tensor output, const at::Tensor& input, int root) {
  const auto ctx = context("gather");
  detail::check_root(ctx, root, size());
  detail::check_tensor(ctx, "input", input, device_type());
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
  checked_count(ctx, input.numel());
  const int W = size(), r = rank();
  const int64_t n = input.numel();
  const int64_t piece = std::max<int64_t>(1, gather_piece_bytes / static_cast<int64_t>(input.element_size()));
  const int64_t pieces = (n + piece - 1) / piece;
  const auto part = [piece, n](const at::Tensor& flat, int64_t j) {
    return flat.narrow(0, j * piece, std::min(piece, n - j * piece));
  };
  if (r != root) {
    // Every piece at once: the root takes them in order (same source and tag).
    auto step = [=, comm = native_handle(), tag = next_tag(), flat = input.view({-1}), started = false](
                    std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>&) mutable {
      if (started) return MPI_SUCCESS;
      started = true;
      for (int64_t j = 0; j < pieces; ++j) {
        const at::Tensor p = part(flat, j);
        requests.emplace_back(MPI_REQUEST_NULL);
        if (const int rc =
                MPI_Isend(p.const_data_ptr(), static_cast<int>(p.numel()), type, root, tag, comm, &requests.back());
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
  FSDPX_CHECK(in_place || !detail::overlaps(output, input), ctx,
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

FSDPX_DECL Work MpiCommunicator::reduce_scatter_async(at::Tensor output, const at::Tensor& input, ReduceOp op) {
  const auto ctx = context("reduce_scatter");
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_tensor(ctx, "input", input, device_type());
  detail::check_same_dtype(ctx, output, input);
  detail::check_scatter_sizes(ctx, input, "input", output, "output", size());
  detail::check_reduce_dtype(ctx, op == ReduceOp::avg, input);
  FSDPX_CHECK(input.scalar_type() != at::kBool, ctx, ": reductions over bool tensors are not supported");
  FSDPX_CHECK(!detail::overlaps(output, input), ctx, ": the output overlaps the input");
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
    if (const int rc = MPI_Irecv(recv.data_ptr(), count, type, mod(r - 1), tag, comm, &requests[0]);
        rc != MPI_SUCCESS) {
      return rc;
    }
    return MPI_Isend(send.const_data_ptr(), count, type, mod(r + 1), tag, comm, &requests[1]);
  };
  return submit_steps(ctx, std::move(step), average_after(op, output));
}

FSDPX_DECL Work MpiCommunicator::all_to_all_v_async(at::Tensor output, const at::Tensor& input,
                                                    at::IntArrayRef output_splits, at::IntArrayRef input_splits) {
  const auto ctx = context("all_to_all");
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_tensor(ctx, "input", input, device_type());
  detail::check_same_dtype(ctx, output, input);
  const int W = size(), r = rank();
  // The blocks, and the tensors they point into, live as long as the collective.
  struct Exchange {
    detail::AllToAllPlan plan;
    at::Tensor output, input;
  };
  auto x = std::make_shared<const Exchange>(
      Exchange{detail::all_to_all_plan(ctx, output, input, output_splits, input_splits, r, W), output, input});
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
  for (int c = 0; c < W; ++c) checked_count(ctx, std::max(x->plan.send_count[c], x->plan.recv_count[c]));
  // The tag is taken after every check, so a rejected call leaves the ranks' sequences in step.
  auto step = [=, comm = native_handle(), tag = next_tag(), started = false](
                  std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>& receives) mutable {
    if (started) return MPI_SUCCESS;
    started = true;
    const auto bytes = static_cast<int64_t>(x->input.element_size());
    char* const out = static_cast<char*>(x->output.data_ptr());
    const char* const in = static_cast<const char*>(x->input.const_data_ptr());
    const auto& p = x->plan;
    if (p.send_count[r] > 0)
      std::memcpy(out + p.recv_offset[r] * bytes, in + p.send_offset[r] * bytes, p.send_count[r] * bytes);
    // Every peer gets a receive and a send, empty blocks too: a peer that sends another count is named.
    for (int c = 0; c < W; ++c) {
      if (c == r) continue;
      const int count = static_cast<int>(p.recv_count[c]);
      requests.emplace_back(MPI_REQUEST_NULL);
      receives.push_back({type, count});
      if (const int rc = MPI_Irecv(out + p.recv_offset[c] * bytes, count, type, c, tag, comm, &requests.back());
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    for (int c = 0; c < W; ++c) {
      if (c == r) continue;
      requests.emplace_back(MPI_REQUEST_NULL);
      receives.push_back({});
      if (const int rc = MPI_Isend(in + p.send_offset[c] * bytes, static_cast<int>(p.send_count[c]), type, c, tag, comm,
                                   &requests.back());
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    return MPI_SUCCESS;
  };
  return submit_steps(ctx, std::move(step), {});
}

FSDPX_DECL Work MpiCommunicator::all_to_all_async(at::Tensor output, const at::Tensor& input) {
  const auto splits = detail::equal_all_to_all_splits(context("all_to_all"), output, input, size());
  return all_to_all_v_async(output.view({-1}), input.view({-1}), splits, splits);
}

FSDPX_DECL Work MpiCommunicator::all_reduce_async(at::Tensor tensor, ReduceOp op) {
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

FSDPX_DECL Work MpiCommunicator::broadcast_async(at::Tensor tensor, int root) {
  const auto ctx = context("broadcast");
  detail::check_tensor(ctx, "tensor", tensor, device_type());
  detail::check_root(ctx, root, size());
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, tensor.scalar_type());
  const int count = checked_count(ctx, tensor.numel());
  return submit(
      ctx,
      [=, comm = native_handle()](MPI_Request* r) { return MPI_Ibcast(tensor.data_ptr(), count, type, root, comm, r); },
      {});
}

FSDPX_DECL std::optional<MpiCommunicator> MpiCommunicator::split(int color, int key, std::string_view name) const {
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
  return MpiCommunicator(
      std::make_shared<State>(state_->runtime, child, std::move(options),
                              detail::derive_comm_id(state_->id, split_index, static_cast<std::uint64_t>(color))));
}

FSDPX_DECL std::shared_ptr<const std::vector<int>> MpiCommunicator::world_ranks_of(MPI_Comm comm, int n) {
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

FSDPX_DECL Work MpiCommunicator::submit_steps(detail::OpContext ctx, detail::MpiStep step, detail::MpiFinish finish) {
  return state_->runtime->engine().submit(
      {std::move(ctx), std::move(step), std::move(finish), state_->options.timeout, state_->health, state_->members,
       detail::CollectiveId{state_->id, ++*state_->started}, state_->options.report_interval});
}

FSDPX_DECL void MpiCommunicator::combine(ReduceOp op, const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: at::add_out(const_cast<at::Tensor&>(out), a, b); break;
    case ReduceOp::max: at::maximum_out(const_cast<at::Tensor&>(out), a, b); break;
    case ReduceOp::min: at::minimum_out(const_cast<at::Tensor&>(out), a, b); break;
  }
}

FSDPX_DECL std::uint64_t detail::MpiRuntime::next_world_id() {
  return detail::derive_comm_id(0x776f726c64ULL, world_count_++, 0);
}

FSDPX_DECL bool MpiCommunicator::is_broken() const {
  return state_->health->broken() || state_->runtime->engine().control().lost_any(*state_->members);
}

FSDPX_DECL Work MpiCommunicator::barrier_async() {
  return submit(context("barrier"), [comm = native_handle()](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, {});
}

FSDPX_DECL std::shared_ptr<const std::vector<int>> MpiCommunicator::all_ranks(int n) {
  std::vector<int> ranks(static_cast<size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  return std::make_shared<const std::vector<int>>(std::move(ranks));
}

FSDPX_DECL int MpiCommunicator::checked_count(const detail::OpContext& ctx, int64_t numel) {
  FSDPX_CHECK(numel <= INT_MAX, ctx, ": ", numel, " elements exceed MPI's int count limit (", INT_MAX,
              "); split the tensor");
  return static_cast<int>(numel);
}

FSDPX_DECL detail::MpiFinish MpiCommunicator::average_after(ReduceOp op, const at::Tensor& result) const {
  if (op != ReduceOp::avg) return {};
  return [result, n = size()]() mutable { result.div_(n); };
}

FSDPX_DECL Work MpiCommunicator::submit(detail::OpContext ctx, detail::MpiStart start, detail::MpiFinish finish) {
  return submit_steps(std::move(ctx), detail::MpiTask::single(std::move(start)), std::move(finish));
}

FSDPX_DECL int MpiCommunicator::next_tag() const { return 1 + static_cast<int>(state_->sequence.fetch_add(1) % 32000); }

}  // namespace fsdpx::dist
