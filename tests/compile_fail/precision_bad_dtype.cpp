// Must not compile: an integer "dtype" in a precision policy.
#include <fsdpx/fsdp.hpp>

struct int8_dtype {};
int main() { return fsdpx::MixedPrecision<int8_dtype>::param_dtype == c10::ScalarType::Float; }
