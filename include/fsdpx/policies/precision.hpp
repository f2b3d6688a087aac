// Mixed-precision policies: the dtype parameters are gathered and computed in, the dtype gradients
// are reduced in, and optionally the dtype of the unit's outputs. Sharded master parameters and
// optimizer state always stay float32.
#pragma once

#include <concepts>
#include <optional>

#include <c10/core/ScalarType.h>

namespace fsdpx {

/// Compile-time dtype names for policies.
namespace dtype {
struct f32 {
  static constexpr c10::ScalarType value = c10::ScalarType::Float;
};
struct bf16 {
  static constexpr c10::ScalarType value = c10::ScalarType::BFloat16;
};
struct f16 {
  static constexpr c10::ScalarType value = c10::ScalarType::Half;
};
/// "Leave as is" (output dtype only).
struct keep {};
}  // namespace dtype

template <class T>
concept FloatDtype = std::same_as<T, dtype::f32> || std::same_as<T, dtype::bf16> || std::same_as<T, dtype::f16>;

template <class Param, class Reduce = dtype::f32, class Output = dtype::keep>
struct MixedPrecision {
  static_assert(FloatDtype<Param>, "MixedPrecision<Param, ...>: Param must be fsdpx::dtype::f32, bf16 or f16");
  static_assert(FloatDtype<Reduce>, "MixedPrecision<..., Reduce, ...>: Reduce must be fsdpx::dtype::f32, bf16 or f16");
  static_assert(FloatDtype<Output> || std::same_as<Output, dtype::keep>,
                "MixedPrecision<..., Output>: Output must be fsdpx::dtype::f32, bf16, f16 or keep");
  static constexpr c10::ScalarType param_dtype = Param::value;
  static constexpr c10::ScalarType reduce_dtype = Reduce::value;
  static constexpr std::optional<c10::ScalarType> output_dtype = [] {
    if constexpr (std::same_as<Output, dtype::keep>) {
      return std::optional<c10::ScalarType>{};
    } else {
      return std::optional<c10::ScalarType>{Output::value};
    }
  }();
};

/// Everything in float32.
using FullPrecision = MixedPrecision<dtype::f32, dtype::f32>;
/// Compute in bfloat16, reduce gradients in float32 (the usual choice on recent GPUs).
using BF16Mixed = MixedPrecision<dtype::bf16, dtype::f32>;

template <class P>
concept PrecisionPolicy = requires {
  { P::param_dtype } -> std::convertible_to<c10::ScalarType>;
  { P::reduce_dtype } -> std::convertible_to<c10::ScalarType>;
  { P::output_dtype } -> std::convertible_to<std::optional<c10::ScalarType>>;
};

}  // namespace fsdpx
