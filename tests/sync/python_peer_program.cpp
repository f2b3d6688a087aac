// The C++ side of the Python receiver's test (tests/sync/python_receiver_test.py), under mpiexec with
// 2 trainer ranks: a GPT with a buffer trains with fsdpx; after every step the full weights (bfloat16
// parameters, float32 buffer) are gathered and trainer rank 0 publishes them to the synchronizer it
// hosts (secret from FSDPX_SYNC_SECRET), and writes what it published to expected_<version>.safetensors
// for the Python side to compare bit for bit. Each version waits until Python acknowledges it
// (ack_<version>), so Python receives every one.
//
//   python_peer_program <work dir> <versions> [Hugging Face model folder]
//   python_peer_program <work dir> <steps> --checkpoints        (saves checkpoints for the Python watcher)
//
// With a model folder the trainer is fsdpx's decoder loaded from it (models::from_pretrained), and
// Python receives into transformers' own class of that model, by name.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <fsdpx/checkpoint.hpp>
#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

#include "../core/models.hpp"

using namespace fsdpx;
namespace fs = std::filesystem;

namespace {

/// Publishes `versions` versions of `fsdp`'s weights (bfloat16 parameters, float32 buffers), one
/// training step apart (`train(v)`), each written to expected_<v>.safetensors first and held until
/// Python acknowledges it.
template <class Sharded, class Train>
void serve(Sharded& fsdp, dist::AnyCommunicator& world, const fs::path& work, int versions, Train&& train) {
  std::unique_ptr<sync::SynchronizerServer> server;
  if (world.rank() == 0) {
    sync::ServerOptions options;  // the secret comes from FSDPX_SYNC_SECRET
    if (const char* cert = std::getenv("FSDPX_TEST_TLS_CERT"); cert != nullptr) {  // TLS, for the Python client's
      options.tls_certificate_file = cert;
      options.tls_private_key_file = std::getenv("FSDPX_TEST_TLS_KEY");
    }
    server = std::make_unique<sync::SynchronizerServer>(options);
    std::ofstream(work / "port.tmp") << server->port() << "\n";
    fs::rename(work / "port.tmp", work / "port");
  }
  for (int v = 1; v <= versions; ++v) {
    train(v);
    const auto weights = sync::gather_full_state_dict(fsdp, world.rank() == 0, {.dtype = at::kBFloat16});
    if (world.rank() == 0) {
      fsdpx::hf::NamedTensors expected;
      for (const auto& t : weights) expected.emplace_back(t.name, t.tensor.contiguous());
      fsdpx::hf::save_safetensors(work, expected, {.name = "expected_" + std::to_string(v)});
      server->publish(v, weights);
      const fs::path ack = work / ("ack_" + std::to_string(v));
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (!fs::exists(ack) && !fs::exists(work / "abort")) {
        if (std::chrono::steady_clock::now() > give_up) {
          throw std::runtime_error("the Python receiver did not acknowledge version " + std::to_string(v));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (fs::exists(work / "abort")) throw std::runtime_error("the Python receiver gave up");
    }
    world.barrier();
  }
}

/// Saves every step's weights with the coordinator (2 kept: older steps are rotated away while Python
/// may be reading them; every fourth step with the optimizer, so its commit record is rewritten), each
/// preceded by side_<step>.safetensors, the full float32 weights gathered outside the checkpoint.
void save_steps(dist::AnyCommunicator& world, const fs::path& work, int steps) {
  const test::GptConfig c{.vocab = 61, .seq = 16, .dim = 32, .heads = 4, .layers = 2, .tied = false};
  at::manual_seed(1);
  test::Gpt model(c);
  Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>> fsdp(model,
                                                                                                            world);
  auto optimizer = make_adamw(fsdp, torch::optim::AdamWOptions(1e-2));
  CheckpointCoordinator ckpt(work / "ckpt", fsdp, {.max_to_keep = 2});
  for (int step = 1; step <= steps; ++step) {
    at::manual_seed(100 + step);
    auto tokens = at::randint(c.vocab, {2 * world.size(), c.seq + 1}, at::kLong).narrow(0, 2 * world.rank(), 2);
    optimizer.zero_grad();
    fsdp(tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()).backward();
    optimizer.step();
    const auto weights = sync::gather_full_state_dict(fsdp, world.rank() == 0);
    if (world.rank() == 0) {
      fsdpx::hf::NamedTensors side;
      for (const auto& t : weights) side.emplace_back(t.name, t.tensor.contiguous());
      fsdpx::hf::save_safetensors(work, side, {.name = "side_" + std::to_string(step)});
    }
    world.barrier();
    if (step % 4 == 0) {
      ckpt.save(step, fsdp, &optimizer);
    } else {
      ckpt.save(step, fsdp);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(40));  // room for the reader between saves
  }
  ckpt.wait();
  if (world.rank() == 0) std::ofstream(work / "done") << steps << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: %s <work dir> <versions> [Hugging Face model folder | --checkpoints]\n", argv[0]);
    return 2;
  }
  const fs::path work = argv[1];
  const int versions = std::stoi(argv[2]);
  try {
    dist::AnyCommunicator world(dist::MpiCommunicator::world());
    if (argc == 4 && std::string(argv[3]) == "--checkpoints") {
      save_steps(world, work, versions);
      return 0;
    }
    if (argc == 4) {  // a pretrained model, fine-tuned; Python receives into transformers' own class
      using Hf = Fsdp<models::CausalLM, FullShard, NoOffload, FullPrecision, ShardedStateDict,
                      WrapModules<models::DecoderLayerImpl>>;
      auto fsdp = models::from_pretrained<Hf>(argv[3], world);
      auto optimizer = make_adamw(fsdp, torch::optim::AdamWOptions(1e-2));
      serve(fsdp, world, work, versions, [&](int v) {
        at::manual_seed(100 + v);
        const auto ids =
            at::randint(1, fsdp->config.vocab_size, {2 * world.size(), 12}, at::kLong).narrow(0, 2 * world.rank(), 2);
        optimizer.zero_grad();
        fsdp.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()).backward();
        optimizer.step();
      });
      return 0;
    }
    const test::GptConfig c{.vocab = 61, .seq = 16, .dim = 32, .heads = 4, .layers = 2, .tied = false};
    at::manual_seed(1);
    test::Gpt model(c);
    model->register_buffer("step_count", at::zeros({2}));
    Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>> fsdp(model,
                                                                                                              world);
    auto optimizer = make_adamw(fsdp, torch::optim::AdamWOptions(1e-2));
    serve(fsdp, world, work, versions, [&](int v) {
      at::manual_seed(100 + v);
      auto tokens = at::randint(c.vocab, {2 * world.size(), c.seq + 1}, at::kLong).narrow(0, 2 * world.rank(), 2);
      optimizer.zero_grad();
      fsdp(tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()).backward();
      optimizer.step();
      model->named_buffers()["step_count"].fill_(v);
    });
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "python_peer_program: %s\n", e.what());
    return 1;
  }
}
