// The trainer's step (label "trainer"): TrainStep against an unsharded reference with accumulation,
// clipping and a schedule; a non-finite gradient skipping exactly one step everywhere; a run resumed
// mid-schedule at another world size; the resume flags; a frozen bfloat16 model. CTest runs it under
// mpiexec at world sizes 2 and 3 (3 also resumes at 2).
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/mpi_world.hpp"
#include "parity.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using fsdpx::test::world;
namespace fs = std::filesystem;

namespace {

using GptFsdp = Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>;
using FrozenGpt = Fsdp<Gpt, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<BlockImpl>>;

constexpr int kMicro = 4;
const LrSchedule kSchedule = LrSchedule::cosine(/*warmup=*/2, /*total=*/8, /*min_lr_ratio=*/0.1);

/// Full parameters by name (collective: every rank of the model's world).
template <class Sharded>
std::map<std::string, at::Tensor> gathered(Sharded& model) {
  auto scope = model.full_parameters();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().to(at::kFloat).clone();
  return out;
}

double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) worst = std::max(worst, (t - b.at(name)).abs().max().item<double>());
  return worst;
}

/// `steps` optimizer steps of the sharded GPT through TrainStep, from step `first`, each over kMicro
/// micro-batches of this rank's rows of the global batch.
template <class Sharded>
std::vector<StepReport> train(Sharded& model, TrainStep<Sharded>& train_step, const dist::AnyCommunicator& comm,
                              int first, int steps, int nan_at_step = -1) {
  const GptConfig c;
  std::vector<StepReport> reports;
  for (int step = first; step < first + steps; ++step) {
    const Batch b = gpt_batches(c)(step);
    for (int m = 0; m < kMicro; ++m) {
      const auto mine = rows(b.x.size(0), comm.size(), m, kMicro, comm.rank());
      auto loss = model(b.x.index_select(0, mine), b.y.index_select(0, mine)) / kMicro;
      // The last rank's last micro-batch of that step goes non-finite.
      if (step == nan_at_step && m == kMicro - 1 && comm.rank() == comm.size() - 1)
        loss = loss * std::numeric_limits<double>::quiet_NaN();
      loss.backward();
      const StepReport r = train_step.optimizer_step();
      CHECK(r.accumulating() == (m < kMicro - 1));
      CHECK(r.micro_step == m + 1);
      if (m == kMicro - 1) reports.push_back(r);
    }
  }
  return reports;
}

/// An unsharded GPT trained in step with a sharded run, on every rank of it: each step is compared with
/// the sharded run's from the same weights (StepParity: the gradient norm and every updated weight, for
/// the gradients the reference computes), then the reference takes the sharded weights. Its optimizer
/// groups as make_adamw's; its schedule, when given, is the run's.
struct ReferenceRun {
  GptConfig config;
  Gpt model;
  torch::optim::AdamW optimizer;
  std::optional<LrScheduler> scheduler;
  StepParity parity;

  ReferenceRun(const GptConfig& c, Gpt m, std::optional<LrSchedule> schedule)
      : config(c),
        model(std::move(m)),
        optimizer(reference_adamw(*model)),
        parity(step_bounds(gpt_path(c), gpt_batches(c)(0).y.numel())) {
    if (schedule) scheduler.emplace(optimizer, *schedule);
  }

  /// The reference's step `step` (the global batch in kMicro micro-batches as a run of comm.size() ranks
  /// takes them, clipped at `max_norm`) against the sharded run's, which `report` describes.
  template <class Sharded>
  void step_with(int step, const dist::AnyCommunicator& comm, Sharded& sharded,
                 torch::optim::Optimizer& sharded_optimizer, const StepReport& report, double max_norm) {
    INFO("step " << step);
    REQUIRE(report.stepped);
    REQUIRE(report.grad_norm.has_value());
    const Batch b = gpt_batches(config)(step);
    optimizer.zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      const auto all = rows(b.x.size(0), comm.size(), m, kMicro, std::nullopt);
      (model->forward(b.x.index_select(0, all), b.y.index_select(0, all)) / kMicro).backward();
    }
    const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
    parity.note_reference_gradients(sharded.sharded(), named_gradients(*model), true);
    parity.check_norm(*report.grad_norm, norm);
    CHECK(report.lr == optimizer.param_groups().front().options().get_lr());
    optimizer.step();
    parity.check_step(sharded_optimizer, sharded.sharded(), named_values(*model), report.lr);
    if (scheduler) scheduler->step();
    take_weights(*model, sharded);
  }

  std::map<std::string, at::Tensor> weights() {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, t] : named_values(*model)) out[name] = t.clone();
    return out;
  }
};

}  // namespace

TEST_CASE("TrainStep: 4 micro-steps, clipping and a cosine schedule equal the unsharded reference", "[trainer]") {
  const GptConfig c;
  for (const bool defer : {true, false}) {
    INFO("defer_gradient_sync " << defer);
    at::manual_seed(42);
    ReferenceRun reference(c, Gpt(c), kSchedule);
    at::manual_seed(42);
    GptFsdp model(Gpt(c), world());
    auto optimizer = make_adamw(model, adamw());
    LrScheduler scheduler(optimizer, kSchedule);
    TrainStep<GptFsdp> train_step(model, optimizer, &scheduler,
                                  {.accumulation_steps = kMicro, .max_grad_norm = 0.5, .defer_gradient_sync = defer});
    const int steps = 5;
    for (int step = 0; step < steps; ++step) {
      const auto reports = train(model, train_step, world(), step, 1);
      CHECK(reports[0].optimizer_steps == step + 1);
      reference.step_with(step, world(), model, optimizer, reports[0], 0.5);
    }
    CHECK(scheduler.last_step() == steps);
    CHECK(scheduler.lr() == reference.scheduler->lr());
    if (world().rank() == 0)
      std::printf("  TrainStep (defer %d) against the reference, %s\n", defer, reference.parity.summary().c_str());
    INFO(reference.parity.summary());
    CHECK(reference.parity.holds());
  }
}

TEST_CASE("TrainStep: a non-finite gradient on one rank skips exactly that step on every rank", "[trainer]") {
  const GptConfig c;
  at::manual_seed(42);
  GptFsdp model(Gpt(c), world());
  auto optimizer = make_adamw(model, adamw());
  LrScheduler scheduler(optimizer, kSchedule);
  TrainStep<GptFsdp> train_step(model, optimizer, &scheduler, {.accumulation_steps = kMicro, .max_grad_norm = 1.0});
  train(model, train_step, world(), 0, 2);
  const auto before = gathered(model);
  const double lr_before = scheduler.lr();
  const auto skipped = train(model, train_step, world(), 2, 1, /*nan_at_step=*/2);
  REQUIRE(skipped.size() == 1);
  CHECK(skipped[0].skipped);
  CHECK_FALSE(skipped[0].stepped);
  CHECK_FALSE(std::isfinite(*skipped[0].grad_norm));
  CHECK(skipped[0].skipped_steps == 1);
  CHECK(skipped[0].optimizer_steps == 2);
  CHECK(max_difference(gathered(model), before) == 0);
  CHECK(scheduler.last_step() == 2);  // the schedule counts updates taken
  CHECK(scheduler.lr() == lr_before);
  CHECK(model.sharded_bytes().gradients == 0);  // nothing left over for the next step
  // Every rank decided the same.
  auto decided = at::full({1}, skipped[0].skipped ? 1 : 0, at::kInt);
  world().all_reduce(decided, dist::ReduceOp::sum);
  CHECK(decided.item<int>() == world().size());
  // The next step trains again.
  const auto next = train(model, train_step, world(), 3, 1);
  CHECK(next[0].stepped);
  CHECK(std::isfinite(*next[0].grad_norm));
  CHECK(scheduler.last_step() == 3);
  CHECK(max_difference(gathered(model), before) > 0);
}

#if defined(FSDPX_WITH_BOOST)
namespace {
fs::path trainer_dir(const std::string& name) {
  const char* base = std::getenv("FSDPX_TEST_TMP");
  const fs::path dir =
      fs::path(base != nullptr ? base : "fsdpx_test_tmp") / ("trainer_w" + std::to_string(world().size())) / name;
  if (world().rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world().barrier();
  return dir;
}

/// The resume tests' run: the GPT from seed 42, its AdamW and schedule, trained `steps` optimizer steps.
struct ScheduledRun {
  explicit ScheduledRun(int steps) { train(model, step, world(), 0, steps); }
  GptFsdp model{(at::manual_seed(42), Gpt(GptConfig{})), world()};  // seeded before it is made
  torch::optim::AdamW opt = make_adamw(model, adamw());
  LrScheduler sched{opt, kSchedule};
  TrainStep<GptFsdp> step{model, opt, &sched, {.accumulation_steps = kMicro}};
};
}  // namespace

TEST_CASE("a run interrupted mid-schedule and resumed at another world size equals an uninterrupted one",
          "[trainer][resume]") {
  const GptConfig c;
  const fs::path root = trainer_dir("resume");
  const TrainStepOptions options{.accumulation_steps = kMicro, .max_grad_norm = 1.0};
  // The uninterrupted run: an unsharded reference, compared step by step with the run before and after
  // the interruption.
  at::manual_seed(42);
  ReferenceRun reference(c, Gpt(c), kSchedule);
  // Interrupted after step 3, saved in the background with its schedule.
  {
    at::manual_seed(42);
    GptFsdp first(Gpt(c), world());
    auto opt = make_adamw(first, adamw());
    LrScheduler sched(opt, kSchedule);
    TrainStep<GptFsdp> step(first, opt, &sched, options);
    for (int s = 0; s < 3; ++s) reference.step_with(s, world(), first, opt, train(first, step, world(), s, 1)[0], 1.0);
    CheckpointCoordinator ckpt(root, first);
    ExtraState extra;
    extra.client.insert("next_step", int64_t{3});
    ckpt.save(3, first, opt, sched, extra);
    ckpt.wait();
  }
  world().barrier();
  // Resumed by one rank fewer (or the same one rank).
  const int resumed_size = std::max(1, world().size() - 1);
  auto group = world().split(world().rank() < resumed_size ? 0 : dist::no_color, world().rank(), "resumed");
  if (group) {
    at::manual_seed(7);  // other initial values: everything must come from the checkpoint
    GptFsdp resumed(Gpt(c), *group);
    auto opt = make_adamw(resumed, adamw());
    LrScheduler sched(opt, kSchedule);
    CHECK(sched.last_step() == 0);
    const auto info = load_checkpoint(resumed, root, opt, sched);
    REQUIRE(info.has_value());
    CHECK(info->step == 3);
    CHECK(info->saved_world_size == world().size());
    CHECK(info->missing.empty());
    CHECK(info->extra.client.at("next_step").toInt() == 3);
    CHECK(sched.last_step() == 3);
    // The weights saved, resharded: exactly the run's at step 3 (which the reference took).
    CHECK(max_difference(gathered(resumed), reference.weights()) == 0);
    TrainStep<GptFsdp> step(resumed, opt, &sched, options);
    for (int s = 3; s < 6; ++s)
      reference.step_with(s, *group, resumed, opt, train(resumed, step, *group, s, 1)[0], 1.0);
    CHECK(sched.last_step() == reference.scheduler->last_step());
    CHECK(sched.lr() == reference.scheduler->lr());
    if (group->rank() == 0) {
      std::printf("  saved at %d ranks, resumed at %d, against the uninterrupted reference, %s\n", world().size(),
                  resumed_size, reference.parity.summary().c_str());
    }
    INFO(reference.parity.summary());
    CHECK(reference.parity.holds());
  }
  world().barrier();
}

TEST_CASE("resume flags: optimizer, scheduler and client state each load or not, and a missing one is named",
          "[trainer][resume]") {
  const GptConfig c;
  const fs::path root = trainer_dir("flags");
  ScheduledRun run(2);
  auto& [model, opt, sched, step] = run;
  {
    CheckpointCoordinator ckpt(root, model);
    ExtraState extra;
    extra.client.insert("tag", std::string("with scheduler"));
    ckpt.save(2, model, opt, sched, extra);  // everything
    train(model, step, world(), 2, 1);
    ExtraState no_scheduler;
    no_scheduler.client.insert("tag", std::string("without scheduler"));
    ckpt.save(3, model, opt, no_scheduler);  // no scheduler state
    ckpt.wait();
  }
  world().barrier();
  const auto fresh = [&](auto&& fn) {
    at::manual_seed(9);
    GptFsdp m(Gpt(c), world());
    auto o = make_adamw(m, adamw());
    LrScheduler s(o, kSchedule);
    fn(m, o, s);
  };
  const auto has_moments = [](torch::optim::Optimizer& o) { return !o.state().empty(); };
  // Everything at step 2.
  fresh([&](GptFsdp& m, torch::optim::Optimizer& o, LrScheduler& s) {
    const auto info = load_checkpoint(m, root, o, s, {.step = 2});
    REQUIRE(info);
    CHECK(s.last_step() == 2);
    CHECK(has_moments(o));
    CHECK(info->extra.client.at("tag").toStringRef() == "with scheduler");
  });
  // Each flag off leaves its part alone.
  fresh([&](GptFsdp& m, torch::optim::Optimizer& o, LrScheduler& s) {
    const auto info = load_checkpoint(
        m, root, o, s, {.step = 2, .load_optimizer = false, .load_scheduler = false, .load_client_state = false});
    REQUIRE(info);
    CHECK(s.last_step() == 0);
    CHECK_FALSE(has_moments(o));
    CHECK_FALSE(info->extra.client.contains("tag"));
    CHECK(info->missing.empty());
  });
  // Step 3 has no scheduler state: an error naming it, or with permission a warning and ResumeInfo::missing.
  fresh([&](GptFsdp& m, torch::optim::Optimizer& o, LrScheduler& s) {
    CHECK_THROWS_WITH(load_checkpoint(m, root, o, s), Catch::Contains("step 3") &&
                                                          Catch::Contains("has no scheduler") &&
                                                          Catch::Contains("load_scheduler = false"));
  });
  fresh([&](GptFsdp& m, torch::optim::Optimizer& o, LrScheduler& s) {
    const auto info = load_checkpoint(m, root, o, s, {.allow_missing = true});
    REQUIRE(info);
    CHECK(info->step == 3);
    CHECK(info->missing == std::vector<std::string>{"scheduler"});
    CHECK(s.last_step() == 0);
    // The optimizer state brought the LRs of step 3; the scheduler, not loaded, still decides them.
    CHECK(s.last_lr() ==
          std::vector<double>{s.base_lrs()[0] * kSchedule.factor(0), s.base_lrs()[1] * kSchedule.factor(0)});
    CHECK(has_moments(o));
    CHECK(info->extra.client.at("tag").toStringRef() == "without scheduler");
  });
  // A malformed scheduler state is refused before anything loads.
  fresh([&](GptFsdp& m, torch::optim::Optimizer& o, LrScheduler& s) {
    auto bad = s.state_dict().toGenericDict();
    bad.insert_or_assign("base_lrs", c10::List<double>({1.0}));
    CHECK_THROWS_WITH(s.check_state_dict(bad), Catch::Contains("1 parameter groups but the optimizer has 2"));
  });
  fresh([&](GptFsdp& m, torch::optim::Optimizer& o, LrScheduler& s) {
    const auto info = load_checkpoint(m, root, o, s, {.load_scheduler = false});
    REQUIRE(info);
    CHECK(info->step == 3);
    CHECK(s.last_step() == 0);
  });
  world().barrier();
}

TEST_CASE("a resume checks the extra state as config values: its step, scheduler, generator and client state",
          "[trainer][resume][security]") {
  // Each file is rewritten with its commit record made to match (size and CRC-32C), as a hostile root would:
  // the values, not the checksums, must be what refuses it, naming the file and the cause, before a model loads.
  namespace ckpt = fsdpx::checkpoint;
  const GptConfig c;
  const fs::path root = trainer_dir("extra_values");
  ScheduledRun run(2);
  auto& [model, opt, sched, step] = run;
  {
    CheckpointCoordinator coordinator(root, model);
    ExtraState extra;
    extra.client.insert("tag", std::string("saved"));
    coordinator.save(2, model, opt, sched, extra);
    coordinator.wait();
  }
  world().barrier();
  const fs::path dir = ckpt::step_dir(root, 2);
  const fs::path record_path = dir / ckpt::config_file;
  const auto read_text = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string record_text = read_text(record_path);
  struct Saved {
    std::string name, bytes;
    c10::IValue value;
  };
  std::vector<Saved> saved;
  for (int r = 0; r < world().size(); ++r) {
    const std::string name = ckpt::shard_file_name(ckpt::Component::extra_state, world().size(), r);
    saved.push_back({name, read_text(dir / name), ckpt::detail::load_ivalue(dir / name)});
  }
  // Rank 0 rewrites every rank's file with `edit` applied and the record to match; every rank resumes.
  const auto refused = [&](const std::string& cause, const std::function<void(c10::impl::GenericDict&)>& edit) {
    INFO(cause);
    if (world().rank() == 0) {
      auto record = nlohmann::json::parse(record_text);
      for (const Saved& file : saved) {
        c10::impl::GenericDict d = file.value.toGenericDict().copy();
        edit(d);
        const auto written = ckpt::detail::save_ivalue(dir / file.name, d);
        record["files"][file.name] = {{"bytes", written.bytes}, {"crc32c", written.crc32c}};
      }
      std::ofstream(record_path, std::ios::trunc) << record.dump();
    }
    world().barrier();
    at::manual_seed(9);
    GptFsdp m(Gpt(c), world());
    auto o = make_adamw(m, adamw());
    LrScheduler s(o, kSchedule);
    const auto before = gathered(m);
    try {
      (void)load_checkpoint(m, root, o, s);
      FAIL("resumed");
    } catch (const IoError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(cause) != std::string::npos);
      CHECK(std::string(e.what()).find(root.string()) != std::string::npos);
    }
    CHECK(max_difference(gathered(m), before) == 0);  // refused before the model loaded
    CHECK(s.last_step() == 0);
    world().barrier();
  };
  refused("says step 5, its folder is step 2", [](auto& d) { d.insert_or_assign("step", int64_t{5}); });
  const auto scheduler = [](auto& d, const char* key, c10::IValue v) {
    auto state = d.at("scheduler").toGenericDict().copy();
    state.insert_or_assign(key, std::move(v));
    d.insert_or_assign("scheduler", state);
  };
  refused("a base_lrs entry is nan, not a finite lr >= 0", [&](auto& d) {
    scheduler(d, "base_lrs", c10::List<double>({std::numeric_limits<double>::quiet_NaN(), 1e-3}));
  });
  refused("no integer last_step in [0, 2^40]", [&](auto& d) { scheduler(d, "last_step", int64_t{1} << 62); });
  refused("rng.cpu is not a generator state of this build's", [](auto& d) {
    auto rng = d.at("rng").toGenericDict().copy();
    rng.insert_or_assign("cpu", at::zeros({3}, at::kByte));
    d.insert_or_assign("rng", rng);
  });
  refused("'client' has the wrong type", [](auto& d) { d.insert_or_assign("client", int64_t{1}); });
  // Put back as saved, byte for byte, it resumes.
  if (world().rank() == 0) {
    for (const Saved& file : saved) std::ofstream(dir / file.name, std::ios::binary | std::ios::trunc) << file.bytes;
    std::ofstream(record_path, std::ios::trunc) << record_text;
  }
  world().barrier();
  GptFsdp m(Gpt(c), world());
  auto o = make_adamw(m, adamw());
  LrScheduler s(o, kSchedule);
  const auto info = load_checkpoint(m, root, o, s);
  REQUIRE(info);
  CHECK(s.last_step() == 2);
  CHECK(info->extra.client.at("tag").toStringRef() == "saved");
  world().barrier();
}
#endif

TEST_CASE("a frozen bf16 model: 2 bytes per parameter over W ranks, the unsharded bf16 model's logits",
          "[trainer][frozen]") {
  const GptConfig c;
  const int W = world().size();
  at::manual_seed(7);
  auto reference = Gpt(c);
  reference->to(at::kBFloat16);
  at::manual_seed(7);
  FrozenGpt frozen(Gpt(c), world(), {.inference_only = true});
  CHECK(frozen.inference_only());

  int64_t numel = 0;
  for (const auto& p : reference->parameters()) numel += p.numel();
  int64_t shard_elements = 0, padding = 0, padding_bound = 0;
  for (size_t i = 0; i < frozen.sharded().num_units(); ++i) {
    const auto& layout = frozen.sharded().unit(i).layout();
    shard_elements += layout.shard_numel();
    padding += layout.padded_numel() - layout.numel();
    const auto align = core::FlatParamLayout::alignment_elements;
    padding_bound += align * (static_cast<int64_t>(layout.params().size()) + W);
    CHECK(frozen.sharded().unit(i).shard().scalar_type() == at::kBFloat16);
  }
  const ShardedBytes bytes = frozen.sharded_bytes();
  CHECK(bytes.parameters == 2 * shard_elements);
  CHECK(bytes.parameters * W == 2 * (numel + padding));
  CHECK(padding <= padding_bound);
  CHECK(bytes.gradients == 0);
  if (world().rank() == 0) {
    std::printf("  frozen bf16: %lld bytes per rank for %lld parameters at %d ranks (2 x params / W = %lld)\n",
                static_cast<long long>(bytes.parameters), static_cast<long long>(numel), W,
                static_cast<long long>(2 * numel / W));
  }
  CHECK_THROWS_WITH(frozen.parameters(), Catch::Contains("inference-only"));

  at::manual_seed(11);
  const at::Tensor idx = at::randint(c.vocab, {3, c.seq}, at::kLong);
  at::Tensor expected;
  {
    at::NoGradGuard no_grad;
    expected = reference->logits(idx).to(at::kFloat);
  }
  const at::Tensor logits = frozen.call(&GptImpl::logits, idx);
  CHECK_FALSE(logits.requires_grad());
  CHECK(at::equal(logits.to(at::kFloat), expected));
  CHECK(frozen.sharded_bytes().gradients == 0);

  // Loading a float32 (actor) state dict casts into the bfloat16 shards.
  at::manual_seed(7);
  GptFsdp actor(Gpt(c), world());
  const StateDict actor_state = sharded_state_dict(actor.sharded());
  at::manual_seed(99);
  FrozenGpt loaded(Gpt(c), world(), {.inference_only = true});
  load_model_state_dict(loaded, actor_state);
  CHECK(at::equal(loaded.call(&GptImpl::logits, idx).to(at::kFloat), expected));
}

TEST_CASE("memory_report and offload: host RSS measured, no device on a CPU rank, offload round trip",
          "[trainer][memory]") {
  const GptConfig c;
  at::manual_seed(3);
  GptFsdp model(Gpt(c), world());
  const MemoryReport r = memory_report();
  CHECK(r.host_rss_bytes > 0);
  CHECK_FALSE(r.device_total_bytes.has_value());
  CHECK(r.allocated_bytes == 0);
  const auto before = gathered(model);
  model.offload_model();  // also returns cached device blocks, a no-op here
  model.reload_model();
  CHECK(max_difference(gathered(model), before) == 0);
}

TEST_CASE("LrSchedule refuses shapes that mean nothing, naming the field", "[trainer]") {
  auto opt =
      torch::optim::SGD(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())}, torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH(LrScheduler(opt, LrSchedule::linear(10, 0)), Catch::Contains("total_steps > 0"));
  CHECK_THROWS_WITH(LrScheduler(opt, LrSchedule::cosine(20, 10)),
                    Catch::Contains("warmup_steps (20) exceeds total_steps (10)"));
  CHECK_THROWS_WITH(LrScheduler(opt, LrSchedule::cosine(1, 10, 1.5)), Catch::Contains("min_lr_ratio"));
  LrScheduler s(opt, LrSchedule::linear(2, 10));
  CHECK(s.lr() == 0.0);  // warmup starts at 0, as transformers' does
  s.step();
  // An LR is a few double operations on the base LR (the ratio, the product), each within an ulp: two
  // ways of computing it differ by at most 2 ulps per operation (tests/core/lr_schedules_test.py).
  const double lr_rounding = 16 * 0x1p-53;
  CHECK(s.lr() == Approx(0.05).epsilon(lr_rounding));
  // A run extended on resume: the saved step and base LR, the new shape (and a warning naming total_steps).
  s.step();
  s.step();
  auto opt2 =
      torch::optim::SGD(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())}, torch::optim::SGDOptions(0.5));
  LrScheduler longer(opt2, LrSchedule::linear(2, 20));
  longer.load_state_dict(s.state_dict());
  CHECK(longer.last_step() == 3);
  CHECK(longer.base_lrs() == std::vector<double>{0.1});
  CHECK(longer.lr() == Approx(0.1 * 17.0 / 18.0).epsilon(lr_rounding));
  auto two =
      torch::optim::SGD(std::vector<at::Tensor>{at::zeros({1}, at::requires_grad())}, torch::optim::SGDOptions(0.1));
  two.add_param_group(torch::optim::OptimizerParamGroup({at::zeros({1}, at::requires_grad())}));
  LrScheduler other(two, LrSchedule::linear(2, 10));
  CHECK_THROWS_WITH(other.load_state_dict(s.state_dict()),
                    Catch::Contains("1 parameter groups but the optimizer has 2"));
}

TEST_CASE("a frozen unit, a tied head and an unused parameter: saved at W ranks, resumed with the optimizer at W-1",
          "[trainer][resume][frozen]") {
  // docs/core.md advises a frozen module as a unit of its own: AdamW never steps its shards, so the
  // saved optimizer state has none of them, and a resume must not expect any.
  GptConfig c;
  c.tied = true;
  const auto build = [&](uint64_t seed) {
    at::manual_seed(seed);
    Gpt gpt(c);
    for (auto& p : gpt->blocks[0]->parameters()) p.set_requires_grad(false);  // a frozen unit
    gpt->register_parameter("never_used", at::zeros({8}));                    // no gradient, ever
    return gpt;
  };
  const auto make = [&](uint64_t seed, const dist::AnyCommunicator& comm) {
    return std::make_unique<GptFsdp>(build(seed), comm);
  };
  const fs::path root = trainer_dir("frozen_resume");
  const TrainStepOptions options{.accumulation_steps = kMicro, .max_grad_norm = 1.0};
  ReferenceRun reference(c, build(42), std::nullopt);
  std::map<std::string, at::Tensor> saved;
  {
    auto first = make(42, world());
    auto opt = make_adamw(*first, adamw());
    TrainStep<GptFsdp> step(*first, opt, nullptr, options);
    for (int s = 0; s < 3; ++s)
      reference.step_with(s, world(), *first, opt, train(*first, step, world(), s, 1)[0], 1.0);
    saved = gathered(*first);
    CheckpointCoordinator ckpt(root, *first);
    ckpt.save(3, *first, opt, ExtraState{});
    ckpt.wait();
  }
  world().barrier();
  const int resumed_size = std::max(1, world().size() - 1);
  auto group = world().split(world().rank() < resumed_size ? 0 : dist::no_color, world().rank(), "resumed");
  if (group) {
    auto resumed = make(7, *group);
    auto opt = make_adamw(*resumed, adamw());
    const auto info = load_checkpoint(*resumed, root, opt);
    REQUIRE(info.has_value());
    CHECK(info->step == 3);
    // Resharded exactly, the frozen block included: the checkpoint's, not the resumed model's own
    // initial values (seed 7).
    CHECK(max_difference(gathered(*resumed), saved) == 0);
    TrainStep<GptFsdp> step(*resumed, opt, nullptr, options);
    for (int s = 3; s < 5; ++s)
      reference.step_with(s, *group, *resumed, opt, train(*resumed, step, *group, s, 1)[0], 1.0);
    const auto got = gathered(*resumed);
    CHECK(at::equal(got.at("h0.qkv.weight"), saved.at("h0.qkv.weight")));  // frozen: never stepped
    if (group->rank() == 0) {
      std::printf("  frozen unit, tied head, unused parameter: resumed at %d ranks against the reference, %s\n",
                  resumed_size, reference.parity.summary().c_str());
    }
    INFO(reference.parity.summary());
    CHECK(reference.parity.holds());
  }
  world().barrier();
}

namespace {
/// Everything written to `f`, which is then closed.
std::string read_and_close(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  std::fclose(f);
  return out;
}
}  // namespace

TEST_CASE("ProgressReporter: rank 0 prints a line per reported step with the ranks' mean loss, ETA and checkpoints",
          "[trainer][progress]") {
  const int W = world().size();
  std::FILE* lines = std::tmpfile();
  std::FILE* bar = std::tmpfile();
  REQUIRE((lines != nullptr && bar != nullptr));
  {
    ProgressReporter progress(world(), {.total_steps = 4, .every = 2, .out = lines});
    for (int64_t step = 1; step <= 4; ++step) {
      // Rank r's loss is r + step: the mean over the ranks is step + (W - 1) / 2.
      progress.step(step, at::scalar_tensor(static_cast<double>(world().rank() + step)), 100, 0.5, 1e-3);
      if (step == 2) {
        progress.saving(2);
        progress.committed(2);
      }
    }
    if (world().rank() == 0) progress.failed(4, "No space left on device");
  }
  {
    // A bar, redrawn in place, ends its line before an event and at the last step.
    ProgressReporter progress(world(), {.total_steps = 2, .out = bar, .style = ProgressOptions::Style::bar});
    progress.step(1, at::scalar_tensor(1.0), 10);
    progress.committed(1);
    progress.step(2, at::scalar_tensor(1.0), 10);
  }
  const std::string text = read_and_close(lines), drawn = read_and_close(bar);
  INFO(text);
  INFO(drawn);
  if (world().rank() != 0) {
    CHECK(text.empty());  // one voice
    CHECK(drawn.empty());
    return;
  }
  const auto has = [&](const std::string& s) { return text.find(s) != std::string::npos; };
  char loss1[32];
  std::snprintf(loss1, sizeof loss1, "step 1  loss %.4f", 1 + (W - 1) / 2.0);
  CHECK(has(loss1));
  CHECK(has("grad-norm 0.500  lr 0.001"));
  CHECK(has("tokens/s"));
  CHECK(has(W == 1 ? "(max of 1 rank)" : "(max of " + std::to_string(W) + " ranks)"));
  CHECK(has("1/4  ETA "));
  CHECK(has("step 2  loss"));
  CHECK_FALSE(has("step 3 "));  // every 2, and step 3 is neither the first nor the last
  CHECK(has("4/4  ETA 0:00:00"));
  CHECK(has("checkpoint: saving step 2 in the background\ncheckpoint: step 2 committed\nstep 4"));
  CHECK(has("checkpoint: step 4 FAILED: No space left on device"));
  CHECK(text.find('\r') == std::string::npos);  // not a terminal: lines
  CHECK(drawn.rfind("\r[############............] step 1", 0) == 0);
  CHECK(drawn.find("\ncheckpoint: step 1 committed\n\r[########################] step 2") != std::string::npos);
  CHECK(drawn.back() == '\n');
}
