// libFuzzer harness: a DCP `.metadata` (dcp::parse_metadata: the pickle machine, then DCP's schema and its
// checks) on any bytes. It must end in a Metadata or an fsdpx::Error.
#include <cstddef>
#include <cstdint>
#include <span>

#include <fsdpx/dcp/metadata.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdpx::dcp::MetadataLimits limits;
  limits.max_values = 1 << 20;
  limits.max_text_bytes = 16 << 20;
  try {
    (void)fsdpx::dcp::parse_metadata(std::as_bytes(std::span(data, size)), "fuzz input", limits);
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
  return 0;
}
