// Weights into a module: whole named tensors loaded by name with the receivers' checks, and a
// receiving module's parameters moved onto huge pages first.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <vector>

#include <torch/nn/module.h>

#include <fsdpx/sync/detail/receive.hpp>
#include <fsdpx/sync/named_tensor.hpp>

namespace fsdpx::sync {

/// Loads whole named tensors into `module`'s parameters and buffers by name, with every receiver's
/// checks (names, shapes, each element exactly once; what does not fit is named).
FSDPX_DECL void load_into(torch::nn::Module& module, const std::vector<NamedTensor>& tensors);

/// Moves `module`'s CPU parameters of memory::huge_page_bytes or more into memory::empty_host() memory
/// (2 MiB-aligned, advised to use huge pages), keeping each Parameter object, its values, shape and
/// requires_grad. For a receiving module (receive_into, load_into, fetch_newer_into): every copy of
/// a sync lands in its parameters, and on 4 KiB pages the broadcast runs slower (docs/sync.md,
/// "Measured", has the figures). Call it once, before anything keeps pointers into the parameters: their
/// storage changes. Tied parameters move once. Pinned, non-CPU and already 2 MiB-aligned ones stay,
/// and so do views into a larger storage (a flat buffer some other code owns, e.g. a module fsdpx
/// shards: moving them would cut them off from it). Returns the bytes moved (0 with
/// FSDPX_HUGE_PAGES=0, or off Linux, where empty_host() is PyTorch's allocator).
FSDPX_DECL int64_t place_on_huge_pages(torch::nn::Module& module);

}  // namespace fsdpx::sync

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/sync/impl/load.ipp>
#endif
