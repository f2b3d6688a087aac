// libFuzzer harness: a torch.save archive (checkpoint/detail/torch_io.hpp's load_ivalue: LibTorch's zip reader,
// then fsdpx's own archive reader, never LibTorch's unpickler) on any bytes, written to a file as every checkpoint
// file is read from one. It must end in a value or an fsdpx::Error.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <fsdpx/checkpoint/detail/torch_io.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("fsdpx_fuzz_archive_" + std::to_string(::getpid()) + ".pt");
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)fsdpx::checkpoint::detail::load_ivalue(file);
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
  return 0;
}
