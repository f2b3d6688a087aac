// torch's names of its dtypes ("bfloat16", as `torch.bfloat16` prints and pickles): the one table of them
// in fsdpx, for every file that names a dtype the way torch does (a DCP `.metadata`, dcp/metadata.hpp; a
// Hugging Face config.json's "dtype", models/config.hpp).
#pragma once

#include <optional>
#include <string_view>

#include <c10/core/ScalarType.h>

namespace fsdpx {

namespace detail {

struct TorchDtypeName {
  std::string_view name;
  std::optional<c10::ScalarType> type;  // nullopt: a dtype torch has and fsdpx does not map
};

/// Every dtype torch has, by the name it pickles as (torch.<name>); the quantized, bit-packed and sub-byte
/// ones are named (so that an error can say which) but not mapped.
inline constexpr TorchDtypeName torch_dtype_names[] = {
    {"float32", c10::kFloat},
    {"bfloat16", c10::kBFloat16},
    {"float16", c10::kHalf},
    {"float64", c10::kDouble},
    {"int64", c10::kLong},
    {"int32", c10::kInt},
    {"int16", c10::kShort},
    {"int8", c10::kChar},
    {"uint8", c10::kByte},
    {"bool", c10::kBool},
    {"uint16", c10::ScalarType::UInt16},
    {"uint32", c10::ScalarType::UInt32},
    {"uint64", c10::ScalarType::UInt64},
    {"complex32", c10::kComplexHalf},
    {"complex64", c10::kComplexFloat},
    {"complex128", c10::kComplexDouble},
    {"float8_e4m3fn", c10::ScalarType::Float8_e4m3fn},
    {"float8_e5m2", c10::ScalarType::Float8_e5m2},
    {"float8_e4m3fnuz", c10::ScalarType::Float8_e4m3fnuz},
    {"float8_e5m2fnuz", c10::ScalarType::Float8_e5m2fnuz},
    {"float8_e8m0fnu", c10::ScalarType::Float8_e8m0fnu},
    {"float4_e2m1fn_x2", c10::ScalarType::Float4_e2m1fn_x2},
    {"qint8", std::nullopt},
    {"quint8", std::nullopt},
    {"qint32", std::nullopt},
    {"quint4x2", std::nullopt},
    {"quint2x4", std::nullopt},
    {"bits1x8", std::nullopt},
    {"bits2x4", std::nullopt},
    {"bits4x2", std::nullopt},
    {"bits8", std::nullopt},
    {"bits16", std::nullopt},
    {"int1", std::nullopt},
    {"int2", std::nullopt},
    {"int3", std::nullopt},
    {"int4", std::nullopt},
    {"int5", std::nullopt},
    {"int6", std::nullopt},
    {"int7", std::nullopt},
    {"uint1", std::nullopt},
    {"uint2", std::nullopt},
    {"uint3", std::nullopt},
    {"uint4", std::nullopt},
    {"uint5", std::nullopt},
    {"uint6", std::nullopt},
    {"uint7", std::nullopt},
};

}  // namespace detail

/// torch's name of `t` ("bfloat16"); nullptr for a dtype the table does not map (a quantized one).
constexpr const char* torch_dtype_name(c10::ScalarType t) noexcept {
  for (const auto& d : detail::torch_dtype_names) {
    if (d.type == t) return d.name.data();  // the table's literals end in a NUL
  }
  return nullptr;
}

/// Whether torch has a dtype of this name, mapped or not (so that an error can tell "a dtype fsdpx does not
/// map" from "no dtype at all").
constexpr bool is_torch_dtype_name(std::string_view name) noexcept {
  for (const auto& d : detail::torch_dtype_names) {
    if (d.name == name) return true;
  }
  return false;
}

/// The dtype of torch's name `name`; nullopt for a name fsdpx does not map (torch.qint8) or no dtype at all.
constexpr std::optional<c10::ScalarType> torch_dtype_from_name(std::string_view name) noexcept {
  for (const auto& d : detail::torch_dtype_names) {
    if (d.name == name) return d.type;
  }
  return std::nullopt;
}

}  // namespace fsdpx
