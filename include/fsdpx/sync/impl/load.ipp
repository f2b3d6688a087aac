// Out-of-line functions of fsdpx/sync/load.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/memory/host.hpp>
#include <fsdpx/sync/load.hpp>

namespace fsdpx::sync {

FSDPX_DECL void load_into(torch::nn::Module& module, const std::vector<NamedTensor>& tensors) {
  detail::ModuleLoader loader(module);
  for (const auto& t : tensors) {
    detail::BucketEntry e{t.name, t.tensor.scalar_type(), t.tensor.sizes().vec(), 0, t.tensor.numel(), 0};
    loader.accept(e, t.tensor.reshape({-1}));
  }
  loader.finish();
}

FSDPX_DECL int64_t place_on_huge_pages(torch::nn::Module& module) {
  if (!memory::host_huge_pages()) return 0;
  at::NoGradGuard no_grad;
  int64_t moved = 0;
  for (auto& param : module.parameters(/*recurse=*/true)) {
    const int64_t bytes = param.numel() * static_cast<int64_t>(param.element_size());
    const bool whole_storage = param.storage_offset() == 0 && param.storage().nbytes() == static_cast<size_t>(bytes);
    if (!param.device().is_cpu() || param.is_pinned() || bytes < memory::huge_page_bytes ||
        memory::on_huge_page_boundary(param) || !whole_storage) {
      continue;
    }
    const at::Tensor home = memory::empty_host(param.numel(), param.scalar_type()).view(param.sizes());
    home.copy_(param.detach());
    param.set_data(home);  // the same Parameter (optimisers, tied names) now on the new storage
    moved += bytes;
  }
  return moved;
}

}  // namespace fsdpx::sync
