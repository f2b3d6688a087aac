// libFuzzer harness: a step's commit record (fsdp_config.json, checkpoint::parse_commit_record) and an
// iteration file (read_iteration_file) on any bytes, written to a file as they are read from one. Each must
// end in its value or an fsdpx::Error.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <fsdpx/checkpoint/layout.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("fsdpx_fuzz_record_" + std::to_string(::getpid()));
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)fsdpx::checkpoint::parse_commit_record(file);
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
  try {
    (void)fsdpx::checkpoint::read_iteration_file(file);
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
  return 0;
}
