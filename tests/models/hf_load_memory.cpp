// Peak memory per rank while a Hugging Face model is loaded sharded (mpiexec -n 4):
//
//   fsdpx_hf_load_memory <model folder>
//
// Each rank's peak resident memory over its baseline (LibTorch and MPI up, nothing loaded) must stay
// within its share of the model (1/W of the float32 masters) plus the largest unit (materialized
// whole, one at a time, while the model is sharded) plus the loader's read buffer plus 16 MiB.
#include <cstdio>
#include <fstream>
#include <string>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "../support/process_memory.hpp"

namespace models = fsdpx::models;
using Sharded = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                            fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;

using fsdpx::test::status_bytes;

int main(int argc, char** argv) {
  auto world = fsdpx::dist::MpiCommunicator::world();
  const double mib = 1048576.0;
  {
    const at::Tensor warm = at::randn({256, 256});
    (warm.matmul(warm) * 2).sum().item<float>();  // LibTorch's own first-use allocations
  }
  std::ofstream("/proc/self/clear_refs") << "5";  // the peak (VmHWM) starts again from here
  const int64_t baseline = status_bytes("VmRSS");
  auto model = models::from_pretrained<Sharded>(argv[1], world);
  const int64_t peak = status_bytes("VmHWM");
  int64_t params = 0, largest_unit = 0;
  for (const auto& t : models::hf_tensors(model->config)) params += c10::multiply_integers(t.shape);
  for (size_t i = 0; i < model.sharded().num_units(); ++i) {
    largest_unit = std::max(largest_unit, model.sharded().unit(i).layout().padded_numel() * 4);
  }
  const int64_t share = params * 4 / world.size();
  const int64_t bound = share + largest_unit + fsdpx::hf::SafetensorsDir::chunk_bytes + (int64_t{16} << 20);
  std::printf(
      "rank %d: loading %.1fM parameters (%.0f MiB in float32) at %d ranks: peak RSS %.1f MiB over a baseline of %.1f "
      "MiB; "
      "1/%d of the model %.1f MiB, largest unit %.1f MiB, bound %.1f MiB\n",
      world.rank(), params / 1e6, params * 4 / mib, world.size(), (peak - baseline) / mib, baseline / mib, world.size(),
      share / mib, largest_unit / mib, bound / mib);
  const bool ok = peak > 0 && peak - baseline <= bound;
  auto failed = at::full({1}, ok ? 0 : 1, at::kInt);
  world.all_reduce(failed, fsdpx::dist::ReduceOp::max);
  if (failed.item<int>() != 0) {
    std::fprintf(stderr, "rank %d: FAILED: a rank's peak RSS exceeded its bound\n", world.rank());
    return 1;
  }
  if (world.rank() == 0) std::printf("PASSED\n");
  return 0;
}
