// The trainer side of benchmarks/delta_sync_bench.py: a Qwen2-shaped model (float32, AdamW) publishes
// each version in bfloat16 to two synchronizer servers of its own over loopback TCP: through a client
// that cuts deltas (server A) and through one that always sends full versions (server B). The Python
// script drives it over stdin/stdout and receives with python/fsdpx_sync, timing both side by side.
//
//   commands: train <lr> | perturb | publish delta|full <version> | quit
//   replies:  ports <A> <B> (once) | trained <seconds> | published <t0> <t1> <bytes> <full bytes>
// t0/t1: CLOCK_MONOTONIC seconds around publish(); Python's time.monotonic() reads the same clock.
#include <time.h>

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

#include <torch/torch.h>

#include <fsdpx/models.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

namespace fxs = fsdpx::sync;

namespace {

double monotonic() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

int main(int argc, char** argv) {
  // Qwen2.5-0.5B's shape (494M parameters, tied head); --layers N for a smaller trial.
  int64_t layers = 24;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--layers") layers = std::stoll(argv[i + 1]);
  }
  const fsdpx::detail::Json config = {{"model_type", "qwen2"},       {"architectures", {"Qwen2ForCausalLM"}},
                                      {"vocab_size", 151936},        {"hidden_size", 896},
                                      {"intermediate_size", 4864},   {"num_hidden_layers", layers},
                                      {"num_attention_heads", 14},   {"num_key_value_heads", 2},
                                      {"tie_word_embeddings", true}, {"max_position_embeddings", 32768},
                                      {"rope_theta", 1000000.0}};
  torch::manual_seed(0);
  fsdpx::models::CausalLM model(fsdpx::models::parse_decoder_config(config, "config.json"));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-6).weight_decay(0.0));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  std::fprintf(stderr, "bench_delta_sync: %lld parameters, %lld layers\n", static_cast<long long>(params),
               static_cast<long long>(layers));

  fxs::SynchronizerServer server_a({.bucket_bytes = 64 << 20, .limits = {.max_bucket_bytes = 256 << 20}});
  fxs::SynchronizerServer server_b({.bucket_bytes = 64 << 20, .limits = {.max_bucket_bytes = 256 << 20}});
  fxs::SynchronizerClient delta_publisher("127.0.0.1", server_a.port(), {.bucket_bytes = 64 << 20});
  fxs::SynchronizerClient full_publisher("127.0.0.1", server_b.port(),
                                         {.bucket_bytes = 64 << 20, .delta = {.enabled = false}});
  std::printf("ports %d %d\n", server_a.port(), server_b.port());
  std::fflush(stdout);

  std::vector<fxs::NamedTensor> weights;
  const auto prepare = [&] {
    weights.clear();
    for (const auto& p : model->named_parameters())
      weights.push_back({p.key(), p.value().detach().to(torch::kBFloat16)});
  };
  prepare();
  std::string line;
  int64_t step = 0;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "train") {
      double lr = 0;
      in >> lr;
      for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      const double t0 = monotonic();
      torch::manual_seed(1000 + step++);
      const auto ids = torch::randint(0, 151936, {1, 16}, torch::kLong);
      opt.zero_grad();
      model->loss(ids, ids).backward();
      opt.step();
      prepare();
      std::printf("trained %.3f\n", monotonic() - t0);
    } else if (cmd == "perturb") {
      // Every weight moves by about 1%: every bfloat16 element changes (the delta's worst case).
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.mul_(1.0 + 0.01 * torch::randn_like(p));
      prepare();
      std::printf("perturbed\n");
    } else if (cmd == "publish") {
      std::string how;
      int64_t version = 0;
      in >> how >> version;
      auto& client = how == "delta" ? delta_publisher : full_publisher;
      const double t0 = monotonic();
      client.publish(version, std::vector<fxs::NamedTensor>(weights));  // handed over: kept as the base as is
      const double t1 = monotonic();
      const auto t = client.last_transfer();
      std::printf("published %.6f %.6f %lld %lld\n", t0, t1, static_cast<long long>(t.bytes),
                  static_cast<long long>(t.full_bytes));
    } else if (cmd == "phases") {
      // Where one delta's time goes, outside the network: a fraction of the elements moves by one unit
      // in the last place; cut (publisher), accept (server, owned), commit (publisher), accept in place.
      double fraction = 0.14;
      in >> fraction;
      std::vector<fxs::NamedTensor> next;
      for (const auto& w : weights) {
        at::Tensor t = w.tensor.clone();
        auto bits = t.view({-1}).view(torch::kShort);
        bits.add_((torch::rand({bits.numel()}) < fraction).to(torch::kShort));
        next.push_back({w.name, t});
      }
      fxs::detail::VersionStore publisher, server, receiver;
      auto first = publisher.cut(1, weights);
      server.accept(first.tensors, fxs::detail::VersionStore::Apply::owned, "bench");
      receiver.accept(first.tensors, fxs::detail::VersionStore::Apply::owned, "bench");
      publisher.commit(std::move(first));
      double t = monotonic();
      auto delta = publisher.cut(2, next);
      const double cut = monotonic() - t;
      t = monotonic();
      server.accept(delta.tensors, fxs::detail::VersionStore::Apply::owned, "bench");
      const double owned = monotonic() - t;
      t = monotonic();
      receiver.accept(delta.tensors, fxs::detail::VersionStore::Apply::in_place, "bench");
      const double in_place = monotonic() - t;
      t = monotonic();
      publisher.commit(std::move(delta));
      const double commit = monotonic() - t;
      std::printf("phases cut %.3f accept_owned %.3f accept_in_place %.3f commit %.3f\n", cut, owned, in_place, commit);
    } else if (cmd == "quit") {
      break;
    } else {
      std::printf("error unknown command '%s'\n", line.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
