// The C++ side of merge_interop.py:
//   fsdpx_merge_fixture write <dir>      a world-size-3 checkpoint at step 12 (and an older one, world
//                                        size 2, at step 5) under <dir>/ckpt, and the original tensors
//                                        in <dir>/expected.pt (a plain dict, written without merging)
//   fsdpx_merge_fixture compare <safetensors file or dir> <expected.pt>
//                                        exit 0 when load_safetensors reads exactly the expected tensors
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/hf/safetensors.hpp>

#include "merge_fixture.hpp"

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "write" && argc == 3) {
      const fs::path dir = argv[2];
      fs::remove_all(dir);
      fs::create_directories(dir);
      const auto full = merge_fixture::originals();
      // the older step first: latest_checkpointed_iteration.txt ends at 12
      merge_fixture::write_checkpoint(dir / "ckpt", 5, merge_fixture::shard(full, 2));
      merge_fixture::write_checkpoint(dir / "ckpt", 12, merge_fixture::shard(full, 3));
      c10::impl::GenericDict expected(c10::StringType::get(), c10::AnyType::get());
      for (const auto& [name, t] : full) expected.insert(name, t);
      ckpt::detail::save_ivalue(dir / "expected.pt", expected);
      std::cout << "wrote " << (dir / "ckpt").string() << "\n";
      return 0;
    }
    if (mode == "compare" && argc == 4) {
      const auto got = fsdpx::hf::load_safetensors(argv[2]);
      const c10::IValue want = ckpt::detail::load_ivalue(argv[3]);
      const auto& dict = want.toGenericDict();
      std::map<std::string, at::Tensor> by_name(got.begin(), got.end());
      bool ok = by_name.size() == got.size() && got.size() == dict.size();
      for (const auto& item : dict) {
        const auto it = by_name.find(item.key().toStringRef());
        const bool same = it != by_name.end() && it->second.sizes() == item.value().toTensor().sizes() &&
                          it->second.scalar_type() == item.value().toTensor().scalar_type() &&
                          at::equal(it->second, item.value().toTensor());
        if (!same) std::cerr << "differs: " << item.key().toStringRef() << "\n";
        ok = ok && same;
      }
      std::cout << (ok ? "equal" : "NOT equal") << " (" << got.size() << " tensors)\n";
      return ok ? 0 : 1;
    }
    std::cerr << "usage: fsdpx_merge_fixture write <dir> | compare <safetensors> <expected.pt>\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
