// Bit equality of tensors (NaN and -0.0 included): what "bit for bit" in the tests means.
#pragma once

#include <ATen/ATen.h>

namespace fsdpx::test {

/// The same bytes viewed as integers of the element's size.
inline at::Tensor bits(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return t.contiguous().view(at::kByte);
    case 2: return t.contiguous().view(at::kShort);
    case 4: return t.contiguous().view(at::kInt);
    default: return t.contiguous().view(at::kLong);
  }
}

inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(bits(a), bits(b));
}

}  // namespace fsdpx::test
