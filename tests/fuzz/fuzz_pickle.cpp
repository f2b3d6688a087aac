// libFuzzer harness: the pickle machine (fsdpx/pickle/pickle.hpp) on any bytes, every global admitted and
// persistent ids on, so that every opcode it reads is reached. It must end in a Pickle or an fsdpx::Error.
#include <cstddef>
#include <cstdint>
#include <span>

#include <fsdpx/pickle/pickle.hpp>

namespace {
bool any_global(std::string_view, std::string_view) { return true; }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdpx::pickle::Limits limits;
  limits.max_values = 1 << 20;
  limits.persistent_ids = true;
  try {
    const auto p = fsdpx::pickle::parse(std::as_bytes(std::span(data, size)), "fuzz input", any_global, limits);
    (void)p;
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
  return 0;
}
