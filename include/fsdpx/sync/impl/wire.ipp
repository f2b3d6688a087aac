// Out-of-line functions of fsdpx/sync/detail/wire.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/detail/wire.hpp>

namespace fsdpx::sync::detail {

FSDPX_DECL uint8_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 1;
    case at::kDouble: return 2;
    case at::kBFloat16: return 3;
    case at::kHalf: return 4;
    case at::kChar: return 5;
    case at::kByte: return 6;
    case at::kInt: return 7;
    case at::kLong: return 8;
    case at::kBool: return 9;
    default: break;
  }
  FSDPX_FAIL(ConfigError, "weight sync cannot send tensors of dtype ", t,
             " (float32, float64, bfloat16, float16, int8, uint8, int32, int64 and bool can travel)");
}

FSDPX_DECL std::optional<at::ScalarType> dtype_from_code(uint8_t code) {
  static constexpr at::ScalarType types[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kChar,
                                             at::kByte,  at::kInt,    at::kLong,     at::kBool};
  if (code < 1 || code > 9) return std::nullopt;
  return types[code - 1];
}

FSDPX_DECL std::string bookkeeping_problem(int64_t bookkeeping, int64_t arrived, int64_t floor, std::string_view what) {
  if (bookkeeping - arrived <= floor) return {};  // both at most a few GiB: no overflow
  return ::fsdpx::detail::str(what, " would make this receiver hold ", bookkeeping, " bytes of bookkeeping for ",
                              arrived, " bytes that arrived (at most ", floor,
                              " more than the bytes): too many entries or tensors for their bytes");
}

}  // namespace fsdpx::sync::detail
