// Heap allocations per collective on the MPI backend, counted by replacing the global operator new.
//
// The engine's own path (the task and its steps, the Work handle's state, the queue to the engine
// thread, the request lists, the error context) allocates nothing once warm, and neither do the
// collectives that need no arithmetic: all_reduce, broadcast, barrier and all_gather (FSDP's unshard)
// must average well under one allocation per call (the control channel's heartbeats on the engine
// thread are the only background allocations). reduce_scatter sums on the host with ATen, whose
// temporaries are counted: a bound per call plus one per stage.
//   mpiexec -n 2 fsdpx_engine_allocations      (exits 1 when a bound is exceeded)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // these replacements pair malloc with free

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <fsdpx/dist/mpi.hpp>

namespace {
std::atomic<long long> allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  const auto align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

/// Mean heap allocations (all threads) per call of `collective`, after a warm-up.
template <class Fn>
double allocations_per_call(fsdpx::dist::MpiCommunicator& world, Fn collective, int calls = 2000) {
  for (int i = 0; i < 200; ++i) collective();
  world.barrier();
  const long long before = allocations.load();
  for (int i = 0; i < calls; ++i) collective();
  const long long after = allocations.load();
  world.barrier();
  return static_cast<double>(after - before) / calls;
}

}  // namespace

int main() {
  auto world = fsdpx::dist::MpiCommunicator::world();
  const int W = world.size();
  auto small = at::ones({16});
  auto shard = at::ones({64});
  auto full = at::zeros({64 * W});

  const double all_reduce = allocations_per_call(world, [&] { world.all_reduce_async(small).wait_host(); });
  const double broadcast = allocations_per_call(world, [&] { world.broadcast_async(small, 0).wait_host(); });
  const double barrier = allocations_per_call(world, [&] { world.barrier_async().wait_host(); });
  const double all_gather = allocations_per_call(world, [&] { world.all_gather_async(full, shard).wait_host(); });
  const double reduce_scatter =
      allocations_per_call(world, [&] { world.reduce_scatter_async(shard, full).wait_host(); });

  // reduce_scatter: its two step buffers and flat views per call, a sum per stage (W - 1 stages).
  const double reduce_scatter_bound = 16.0 + 3.0 * W;
  const bool ok = all_reduce < 0.5 && broadcast < 0.5 && barrier < 0.5 && all_gather < 0.5 &&
                  reduce_scatter <= reduce_scatter_bound;
  if (world.rank() == 0) {
    std::printf(
        "RESULT ranks=%d allocations_per_call all_reduce=%.2f broadcast=%.2f barrier=%.2f all_gather=%.2f "
        "reduce_scatter=%.2f (bounds: 0.5, reduce_scatter %.0f)\n",
        W, all_reduce, broadcast, barrier, all_gather, reduce_scatter, reduce_scatter_bound);
  }
  if (!ok) {
    std::fprintf(stderr, "fsdpx_engine_allocations: rank %d: the MPI engine allocates per collective\n", world.rank());
    return 1;
  }
  return 0;
}
