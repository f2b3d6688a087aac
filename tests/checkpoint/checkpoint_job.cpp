// A training job that checkpoints and resumes, run by the resume and crash tests as separate
// processes (tests/checkpoint/*.sh):
//   checkpoint_job train --steps N [--root R] [--save-every K] [--keep K] [--resume] [--out F] [--hybrid] [--dcp]
//                        [--fatal-save-errors] [--slow-save RANK:MS] [--throw-at STEP:RANK] [--memory-every K]
//                        [--step-ms MS]
//       --memory-every       every K steps the step is kept in the memory tier too (save_to_memory)
//       --step-ms            each step takes at least MS milliseconds (a kill lands at a known pace)
//       --fatal-save-errors  a failed save ends the job (by default it is reported and training goes on)
//       --slow-save          that rank prints "rank R pid P writing step S" and sleeps before each file
//       --throw-at           that rank throws after that step (a failure between steps)
//       --dcp                the coordinator saves PyTorch Distributed Checkpoint (CheckpointFormat::dcp)
//   checkpoint_job verify --root R          loads the newest committed step (checksums on)
//   checkpoint_job compare A B [--tol T]    two full state dict files, equal (or within T)
//   checkpoint_job dcp-save --root R --steps N --out F [--hybrid] [--fail-rank K]
//                                           trains N steps, saves the model as PyTorch DCP in R and the
//                                           AdamW state in R/optim_states (dcp/state_dict_saver.hpp), reads
//                                           that back into another AdamW (equal, bit for bit), and writes the
//                                           full parameters as a plain dict (torch.load) in F;
//                                           --fail-rank: that rank's disk is full
//   checkpoint_job dcp-cover                cover_flat_range on every range of small shapes
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

#include <fsdpx/checkpoint.hpp>
#include <fsdpx/dcp.hpp>
#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/dist/mpi.hpp>

#include "checkpoint_common.hpp"

using namespace fsdpx;
using namespace fsdpx::test;

namespace {

struct Args {
  std::string mode;
  std::string root, out, a, b;
  int64_t steps = 0;
  int64_t save_every = 0;
  int64_t memory_every = 0;
  int step_ms = 0;
  int keep = 0;
  bool resume = false;
  bool hybrid = false;
  bool dcp = false;  // train: the coordinator writes PyTorch Distributed Checkpoint (CheckpointFormat::dcp)
  bool fatal_save_errors = false;
  int slow_rank = -1, slow_ms = 0;
  int64_t throw_step = -1;
  int throw_rank = -1;
  int fail_rank = -1;
  double tol = 0;
};

/// "A:B" as two integers.
std::pair<int64_t, int64_t> pair_arg(const std::string& k, const std::string& v) {
  const auto colon = v.find(':');
  if (colon == std::string::npos) throw std::invalid_argument(k + " takes A:B, got '" + v + "'");
  return {std::stoll(v.substr(0, colon)), std::stoll(v.substr(colon + 1))};
}

Args parse(int argc, char** argv) {
  Args args;
  args.mode = argc > 1 ? argv[1] : "";
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&] { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (k == "--root") args.root = next();
    else if (k == "--out") args.out = next();
    else if (k == "--steps") args.steps = std::stoll(next());
    else if (k == "--save-every") args.save_every = std::stoll(next());
    else if (k == "--keep") args.keep = std::stoi(next());
    else if (k == "--memory-every") args.memory_every = std::stoll(next());
    else if (k == "--step-ms") args.step_ms = std::stoi(next());
    else if (k == "--resume") args.resume = true;
    else if (k == "--hybrid") args.hybrid = true;
    else if (k == "--dcp") args.dcp = true;
    else if (k == "--fatal-save-errors") args.fatal_save_errors = true;
    else if (k == "--slow-save") std::tie(args.slow_rank, args.slow_ms) = pair_arg(k, next());
    else if (k == "--throw-at") std::tie(args.throw_step, args.throw_rank) = pair_arg(k, next());
    else if (k == "--tol") args.tol = std::stod(next());
    else if (k == "--fail-rank") args.fail_rank = std::stoi(next());
    else if (args.a.empty()) args.a = k;
    else args.b = k;
  }
  return args;
}

template <class Model>
int train(Model& model, dist::AnyCommunicator world, const Args& args) {
  auto opt = make_adamw(model, adamw_options());
  torch::manual_seed(42);  // the data stream; a resume restores its state from extra_state
  int64_t start = 0;
  ExtraState extra;
  if (args.resume) {
    if (const auto info = load_checkpoint(model, args.root, opt)) {
      start = info->step;
      if (world.rank() == 0)
        std::printf("resumed from step %lld (saved by %d ranks) from %s\n", static_cast<long long>(start),
                    info->saved_world_size, info->from_memory ? "memory" : "disk");
    }
  }
  std::optional<CheckpointCoordinator> ckpt;
  if (!args.root.empty() && (args.save_every > 0 || args.memory_every > 0))
    ckpt.emplace(args.root, model,
                 CheckpointOptions{.max_to_keep = args.keep,
                                   .format = args.dcp ? CheckpointFormat::dcp : CheckpointFormat::fsdpx});
  if (ckpt && world.rank() == args.slow_rank) {
    CheckpointMonitor slow;
    slow.before_save = [&args, r = world.rank()](int64_t step, checkpoint::Component) {
      std::printf("rank %d pid %d writing step %lld\n", r, static_cast<int>(::getpid()), static_cast<long long>(step));
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::milliseconds(args.slow_ms));
    };
    ckpt->add_monitor(std::move(slow));
  }
  // A failed save is reported and training goes on (as a trainer would); the job's exit code says it.
  bool save_failed = false;
  const auto checkpoint_call = [&](auto&& call) {
    if (args.fatal_save_errors) return call();
    try {
      call();
    } catch (const IoError& e) {
      save_failed = true;
      std::fprintf(stderr, "rank %d: checkpoint error: %s\n", world.rank(), e.what());
    }
  };
  for (int64_t step = start + 1; step <= args.steps; ++step) {
    const auto began = std::chrono::steady_clock::now();
    const double loss = train_step(model, opt, world);
    std::this_thread::sleep_until(began + std::chrono::milliseconds(args.step_ms));
    // The loss to 9 digits and how far another world size's reduction order may move it (resume_test.sh).
    if (world.rank() == 0) {
      std::printf("step %lld loss %.9g bound %.3g\n", static_cast<long long>(step), loss,
                  step_loss_bound() * std::abs(loss));
    }
    if (step == args.throw_step && world.rank() == args.throw_rank) {
      throw std::runtime_error("the injected failure after step " + std::to_string(step));
    }
    extra.client.insert_or_assign("samples_seen", step * 12);
    if (ckpt && args.save_every > 0 && step % args.save_every == 0) {
      checkpoint_call([&] { ckpt->save(step, model, opt, extra); });
    }
    if (ckpt && args.memory_every > 0 && step % args.memory_every == 0) ckpt->save_to_memory(step, model, opt, extra);
  }
  if (ckpt) checkpoint_call([&] { ckpt->wait(); });
  if (!args.out.empty()) {
    const StateDict full = full_state_dict(model.sharded());
    if (world.rank() == 0) checkpoint::save_state_dict(args.out, full);
  }
  auto failed = at::full({1}, save_failed ? 1 : 0, at::kInt);
  world.all_reduce(failed, dist::ReduceOp::max);
  return failed.item<int>() != 0 ? 3 : 0;
}

/// Trains, then saves DCP (the model's parameters and buffers) and the reference the Python side reads.
template <class Model>
int dcp_save(Model& model, dist::AnyCommunicator world, const Args& args) {
  auto opt = make_adamw(model, adamw_options());
  torch::manual_seed(42);
  for (int64_t step = 1; step <= args.steps; ++step) train_step(model, opt, world);
  if (world.rank() == args.fail_rank) ::fsdpx::detail::inject_write_error(ENOSPC, 100);
  try {
    dcp::save_model(model, args.root);
    dcp::save_optimizer(model, opt, std::filesystem::path(args.root) / "optim_states");
  } catch (const IoError& e) {
    std::fprintf(stderr, "rank %d: DCP save failed: %s\n", world.rank(), e.what());
    return 3;
  }
  // The optimizer's state read back into another AdamW (other hyperparameters, no state): equal to the
  // saved one, bit for bit, and so are the hyperparameters and the step counts.
  auto back = make_adamw(model, torch::optim::AdamWOptions(0.5));
  dcp::load_optimizer(model, back, std::filesystem::path(args.root) / "optim_states");
  int64_t states = 0;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& want = dynamic_cast<const torch::optim::AdamWOptions&>(opt.param_groups()[g].options());
    const auto& got = dynamic_cast<const torch::optim::AdamWOptions&>(back.param_groups()[g].options());
    if (!(want == got)) {
      std::fprintf(stderr, "rank %d: param group %zu's hyperparameters differ after the DCP round trip\n", world.rank(),
                   g);
      return 1;
    }
    for (size_t i = 0; i < opt.param_groups()[g].params().size(); ++i) {
      const auto& saved = dynamic_cast<torch::optim::AdamWParamState&>(
          *opt.state().at(opt.param_groups()[g].params()[i].unsafeGetTensorImpl()));
      const auto& read = dynamic_cast<torch::optim::AdamWParamState&>(
          *back.state().at(back.param_groups()[g].params()[i].unsafeGetTensorImpl()));
      if (saved.step() != read.step() || !at::equal(saved.exp_avg(), read.exp_avg()) ||
          !at::equal(saved.exp_avg_sq(), read.exp_avg_sq())) {
        std::fprintf(stderr, "rank %d: an AdamW state differs after the DCP round trip\n", world.rank());
        return 1;
      }
      ++states;
    }
  }
  std::printf("rank %d: %lld AdamW states read back from DCP equal\n", world.rank(), static_cast<long long>(states));
  // An AdamW whose groups are the saved ones swapped (decayed parameters in group 1) is refused, naming a
  // parameter, by every rank that holds a view of a swapped group (each rank checks the groups it steps).
  std::vector<torch::optim::OptimizerParamGroup> swapped;
  swapped.emplace_back(model.parameters(false), std::make_unique<torch::optim::AdamWOptions>(adamw_options()));
  swapped.emplace_back(model.parameters(true), std::make_unique<torch::optim::AdamWOptions>(adamw_options()));
  torch::optim::AdamW wrong(std::move(swapped), adamw_options());
  bool refused = false;
  try {
    dcp::load_optimizer(model, wrong, std::filesystem::path(args.root) / "optim_states");
  } catch (const std::exception& e) {
    refused = std::strstr(e.what(), "but not in the checkpoint's") != nullptr;
    if (!refused) {
      std::fprintf(stderr, "rank %d: swapped param groups refused for another reason: %s\n", world.rank(), e.what());
      return 1;
    }
  }
  auto any_refused = at::full({1}, refused ? 1 : 0, at::kInt);
  world.all_reduce(any_refused, dist::ReduceOp::max);
  if (any_refused.item<int>() != 1) {
    std::fprintf(stderr, "rank %d: an AdamW with its param groups swapped loaded the DCP state\n", world.rank());
    return 1;
  }
  if (refused) std::printf("rank %d: swapped param groups refused\n", world.rank());
  const StateDict full = full_state_dict(model.sharded());
  if (world.rank() == 0) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const TensorSlice& t : full.entries) dict.insert(t.name, t.data());
    checkpoint::detail::save_ivalue(args.out, dict);
    std::printf("saved DCP of %zu tensors at %d ranks\n", full.entries.size(), world.size());
  }
  return 0;
}

/// Every range of every shape of up to 3 dimensions of sizes 0 to 3 (and 0-d): the boxes lie within the
/// shape, follow one another in flat order without gap or overlap, cover the range, and are few.
int dcp_cover() {
  int64_t checked = 0;
  const auto check = [&](const std::vector<int64_t>& shape) {
    int64_t numel = 1;
    for (const int64_t d : shape) numel *= d;
    std::vector<int64_t> strides(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
    for (int64_t b = 0; b <= numel; ++b) {
      for (int64_t e = b; e <= numel; ++e) {
        const auto boxes = dcp::cover_flat_range(shape, b, e);
        int64_t at = b;
        for (const auto& c : boxes) {
          int64_t first = 0, n = 1;
          for (size_t d = 0; d < shape.size(); ++d) {
            if (c.offsets[d] < 0 || c.sizes[d] < 1 || c.offsets[d] + c.sizes[d] > shape[d]) return false;
            first += c.offsets[d] * strides[d];
            n *= c.sizes[d];
          }
          // contiguous in flat order: every dimension after the first that is not whole has size 1 before it
          for (size_t d = 1; d < shape.size(); ++d) {
            if (c.sizes[d] != shape[d]) {
              for (size_t k = 0; k < d; ++k)
                if (c.sizes[k] != 1) return false;
            }
          }
          if (first != at) return false;
          at += n;
          ++checked;
        }
        const size_t most = shape.empty() ? 1 : 2 * shape.size() - 1;
        if (at != e || boxes.size() > most) return false;
      }
    }
    return true;
  };
  std::vector<std::vector<int64_t>> shapes{{}};
  for (int64_t a = 0; a <= 3; ++a) {
    shapes.push_back({a});
    for (int64_t b = 0; b <= 3; ++b) {
      shapes.push_back({a, b});
      for (int64_t c = 0; c <= 3; ++c) shapes.push_back({a, b, c});
    }
  }
  shapes.push_back({5, 7, 3, 2});
  for (const auto& shape : shapes) {
    if (!check(shape)) {
      std::fprintf(stderr, "dcp-cover: wrong boxes for a shape of %zu dimensions\n", shape.size());
      return 1;
    }
  }
  // A range that is a box already is one box.
  if (dcp::cover_flat_range(std::vector<int64_t>{4, 3}, 3, 9).size() != 1) return 1;
  std::printf("dcp-cover: %zu shapes, %lld boxes, all exact\n", shapes.size(), static_cast<long long>(checked));
  return 0;
}

int compare(const Args& args) {
  const StateDict a = checkpoint::load_state_dict_file(args.a), b = checkpoint::load_state_dict_file(args.b);
  if (a.entries.size() != b.entries.size()) {
    std::fprintf(stderr, "compare: %zu vs %zu tensors\n", a.entries.size(), b.entries.size());
    return 1;
  }
  double worst = 0;
  for (size_t i = 0; i < a.entries.size(); ++i) {
    if (a.entries[i].name != b.entries[i].name) {
      std::fprintf(stderr, "compare: '%s' vs '%s'\n", a.entries[i].name.c_str(), b.entries[i].name.c_str());
      return 1;
    }
    worst = std::max(worst, (a.entries[i].data() - b.entries[i].data()).abs().max().template item<double>());
  }
  std::printf("compare: %zu tensors, largest difference %.3g (allowed %.3g)\n", a.entries.size(), worst, args.tol);
  return worst <= args.tol ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  if (args.mode == "compare") return compare(args);
  if (args.mode == "dcp-cover") return dcp_cover();
  auto mpi = dist::MpiCommunicator::world();
  dist::AnyCommunicator world(mpi);
  try {
    torch::manual_seed(1234);
    if (args.mode == "train") {
      if (args.hybrid) {
        CkptModel<HybridShard<2>> model(ResMlp(), world);
        return train(model, world, args);
      }
      CkptModel<> model(ResMlp(), world);
      return train(model, world, args);
    }
    if (args.mode == "dcp-save") {
      if (args.hybrid) {
        CkptModel<HybridShard<2>> model(ResMlp(), world);
        return dcp_save(model, world, args);
      }
      CkptModel<> model(ResMlp(), world);
      return dcp_save(model, world, args);
    }
    if (args.mode == "verify") {
      CkptModel<> model(ResMlp(), world);
      auto opt = make_adamw(model, adamw_options());
      const auto info = load_checkpoint(model, args.root, opt);
      if (!info) {
        std::printf("verify: no committed checkpoint in %s\n", args.root.c_str());
        return 3;
      }
      if (world.rank() == 0) std::printf("verified step %lld\n", static_cast<long long>(info->step));
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_job rank %d: %s\n", world.rank(), e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: checkpoint_job train|verify|compare|dcp-save|dcp-cover ...\n");
  return 64;
}
