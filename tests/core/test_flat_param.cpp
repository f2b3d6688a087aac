// The flat parameter layout and the host buffers it lives in, without communication.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fsdpx/core/flat_param.hpp>
#include <fsdpx/memory/host.hpp>

#include "../support/process_memory.hpp"

using namespace fsdpx::core;
using namespace fsdpx::memory;

namespace {
std::vector<ParamInfo> params_of(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<ParamInfo> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    // Matrices decay (what ShardedModel decides by default).
    out.push_back({.name = "p" + std::to_string(i), .param = at::zeros(shapes[i]), .decay = shapes[i].size() >= 2});
  }
  return out;
}
}  // namespace

TEST_CASE("flat layout: every parameter and shard starts aligned, and the padding is listed", "[layout]") {
  constexpr int64_t A = FlatParamLayout::alignment_elements;
  // Odd sizes: a 7x13 matrix, a 5-element bias, a 50257-element vector, a 3x3 matrix (decayed first).
  for (const int shards : {1, 2, 3, 8}) {
    INFO(shards << " shards");
    const FlatParamLayout layout(params_of({{7, 13}, {5}, {50257}, {3, 3}}), shards);
    int64_t numel = 0, covered = 0;
    for (const ParamInfo& p : layout.params()) {
      CHECK(p.offset % A == 0);
      numel += p.numel;
    }
    CHECK(layout.numel() == numel);
    CHECK(layout.shard_numel() % A == 0);
    CHECK(layout.padded_numel() == layout.shard_numel() * shards);
    CHECK(layout.padded_numel() >= numel);
    // Parameters and padding tile the flat buffer exactly, without overlap.
    std::vector<std::pair<int64_t, int64_t>> pieces;
    for (const ParamInfo& p : layout.params()) pieces.push_back({p.offset, p.offset + p.numel});
    for (const FlatRange& gap : layout.padding()) pieces.push_back({gap.begin, gap.end});
    std::sort(pieces.begin(), pieces.end());
    for (const auto& [begin, end] : pieces) {
      CHECK(begin == covered);
      covered = end;
    }
    CHECK(covered == layout.padded_numel());
    // The two matrices come first and the decayed range ends where the second one does.
    CHECK(layout.params()[0].shape == std::vector<int64_t>{7, 13});
    CHECK(layout.params()[1].shape == std::vector<int64_t>{3, 3});
    CHECK(layout.decay_numel() == layout.params()[1].offset + 9);
    // At most A - 1 padding elements per parameter, plus the rounding of each shard.
    CHECK(layout.padded_numel() - numel < A * (4 + shards));
  }
}

TEST_CASE("host buffers: large ones 2 MiB-aligned, small ones ordinary, both usable", "[layout]") {
  const at::Tensor big = empty_host((int64_t{3} << 20) + 5, at::kFloat);  // 12 MiB and a bit
  CHECK(big.numel() == (int64_t{3} << 20) + 5);
  CHECK(big.scalar_type() == at::kFloat);
  CHECK(big.is_cpu());
  if (host_huge_pages()) CHECK(on_huge_page_boundary(big));
  big.fill_(2.5f);
  CHECK(big.sum().item<double>() == 2.5 * static_cast<double>(big.numel()));
  const at::Tensor small = empty_host(100, at::kBFloat16);
  CHECK(small.numel() == 100);
  CHECK(small.scalar_type() == at::kBFloat16);
  CHECK(empty_host(0, at::kFloat).numel() == 0);
  CHECK(empty_buffer(1 << 20, at::TensorOptions().dtype(at::kFloat)).numel() == 1 << 20);
  CHECK_THROWS_WITH(empty_host(-1, at::kFloat), Catch::Contains("numel must be >= 0"));
}

TEST_CASE("step buffers: a block given back is reused, the cache never holds more than the peak in use",
          "[layout][memory]") {
  auto& cache = HostBufferCache::instance();
  release_cached_host_buffers();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const int64_t n = int64_t{3} << 20;  // 12 MiB
  const void* first = nullptr;
  {
    at::Tensor a = empty_step_buffer(n, f32);
    CHECK(a.numel() == n);
    CHECK(a.is_cpu());
    if (host_huge_pages()) CHECK(on_huge_page_boundary(a));
    a.fill_(1.5f);
    CHECK(a.sum().item<double>() == 1.5 * static_cast<double>(n));
    first = a.const_data_ptr();
  }
  CHECK(cache.free_bytes() >= static_cast<size_t>(n * 4));
  {
    // The same size again (in another dtype): the block just given back, with its pages resident.
    at::Tensor b = empty_step_buffer(2 * n, at::TensorOptions().dtype(at::kBFloat16));
    CHECK(b.const_data_ptr() == first);
    CHECK(cache.free_bytes() == 0);
  }
  // Units of different sizes one after the other: older free blocks are freed, not accumulated.
  const int64_t step = int64_t{1} << 19;  // 2 MiB more each time
  for (int64_t k = 1; k <= 6; ++k) {
    at::Tensor c = empty_step_buffer(n + k * step, f32);
    INFO("size " << k << ": free " << cache.free_bytes());
    CHECK(cache.free_bytes() <= static_cast<size_t>((n + k * step) * 4));
  }
  CHECK(cache.free_bytes() <= static_cast<size_t>((n + 6 * step) * 4));
  // Small ones come from PyTorch's allocator: the cache is not touched.
  const size_t cached = cache.free_bytes();
  CHECK(empty_step_buffer(16, f32).numel() == 16);
  CHECK(cache.free_bytes() == cached);
  // The end of a step keeps what that step had in use at most: a step that used nothing frees all.
  cache.end_step();  // the step of the loop above: its blocks stay
  CHECK(cache.free_bytes() == cached);
  cache.end_step();  // a step that used none
  CHECK(cache.free_bytes() == 0);
  // A one-off peak outside a step (every unit gathered for an export) is trimmed to the last step's.
  {
    at::Tensor whole = empty_step_buffer(4 * n, f32);
  }
  CHECK(cache.free_bytes() >= static_cast<size_t>(16 * n));
  cache.trim();
  CHECK(cache.free_bytes() == 0);
  release_cached_host_buffers();
  CHECK(cache.free_bytes() == 0);
  CHECK_THROWS_WITH(empty_step_buffer(-1, f32), Catch::Contains("numel must be >= 0"));
}

#if defined(__linux__)
namespace {
int64_t resident_bytes() { return fsdpx::test::status_bytes("VmRSS"); }
}  // namespace

TEST_CASE(
    "step buffers: freed blocks go back to the system at once, and within a step the cache holds no more "
    "free bytes than are in use or the last forward used",
    "[layout][memory]") {
  auto& cache = HostBufferCache::instance();
  release_cached_host_buffers();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const int64_t n = int64_t{16} << 20;  // 64 MiB
  const int64_t before = resident_bytes();
  {
    at::Tensor a = empty_step_buffer(n, f32);
    a.fill_(1.0f);
    CHECK(resident_bytes() - before >= (n * 4) * 9 / 10);
    at::Tensor kept = empty_host(n, at::kFloat).fill_(2.0f);  // a shard: not a step buffer
  }
  // Outside a step the step buffer is held for reuse (resident); the shard's memory went back with it.
  CHECK(cache.free_bytes() >= static_cast<size_t>(n * 4));
  CHECK(resident_bytes() - before < (n * 4) * 3 / 2);
  // A step: its forward uses a quarter of the block's size, its backward the whole.
  cache.begin_forward();  // nothing in use, no forward before: every free block goes, and its pages
  CHECK(cache.free_bytes() == 0);
  CHECK(resident_bytes() - before < (n * 4) / 4);
  {
    at::Tensor gathered = empty_step_buffer(n / 4, f32).fill_(1.0f);
  }
  cache.end_forward();
  CHECK(cache.free_bytes() == static_cast<size_t>(n));  // what the forward used: reused by the next one
  {
    at::Tensor gradient = empty_step_buffer(n, f32).fill_(1.0f);
    at::Tensor reduced = empty_step_buffer(n / 4, f32).fill_(1.0f);  // the forward's block again
    CHECK(cache.free_bytes() == 0);
  }
  // Backward gave both back: no more than the forward's use stays free (the oldest blocks go first).
  CHECK(cache.free_bytes() <= static_cast<size_t>(n));
  cache.end_step();
  release_cached_host_buffers();
}
#endif
