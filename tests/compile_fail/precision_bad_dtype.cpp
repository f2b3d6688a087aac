// Must not compile: an integer "dtype" in a precision policy.
#include <fsdpx/policies/precision.hpp>

struct int8_dtype {};
int main() { return fsdpx::MixedPrecision<int8_dtype>::param_dtype == c10::ScalarType::Float; }
