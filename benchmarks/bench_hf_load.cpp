// bench_hf_load: a Hugging Face model folder loaded into a sharded fsdpx model (from_pretrained:
// deferred_init, sharding, then each rank's positioned reads of its own shards, cast to float32).
// benchmarks/hf_load_bench.py runs it beside transformers' from_pretrained and a plain read of the files.
//
//   mpiexec -n 2 bench_hf_load <model folder>
//
// Prints one RESULT line: the slowest rank's wall time (and the part spent reading the files), the
// largest peak RSS of a rank, and the bytes read by all ranks together.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

namespace models = fsdpx::models;
using Sharded = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                            fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;

int main(int argc, char** argv) try {
  FSDPX_CHECK(argc >= 2, "usage: bench_hf_load <model folder>");
  auto world = fsdpx::dist::MpiCommunicator::world();
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  fsdpx::SafetensorsLoadReport report;
  auto model = models::from_pretrained<Sharded>(argv[1], world, {}, {}, &report);
  const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto stats =
      at::tensor({mine, report.seconds, static_cast<double>(fsdpx::memory_report().host_peak_rss_bytes)}, at::kDouble);
  world.all_reduce(stats, fsdpx::dist::ReduceOp::max);
  auto bytes = at::full({1}, static_cast<double>(report.bytes_read), at::kDouble);
  world.all_reduce(bytes, fsdpx::dist::ReduceOp::sum);
  int64_t params = 0;
  for (const auto& t : models::hf_tensors(model->config)) params += c10::multiply_integers(t.shape);
  if (world.rank() == 0) {
    std::printf(
        "RESULT contender=fsdpx world=%d params=%lld seconds=%.3f read_seconds=%.3f peak_rss_mib=%.0f "
        "bytes_read=%.0f\n",
        world.size(), static_cast<long long>(params), stats[0].item<double>(), stats[1].item<double>(),
        stats[2].item<double>() / 1048576.0, bytes.item<double>());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_hf_load: %s\n", e.what());
  return 1;
}
