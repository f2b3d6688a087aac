// MPI datatypes and reduction ops for tensor dtypes. MPI has no bfloat16/float16, so those travel as
// 2-byte derived types reduced by user-defined ops that compute in float and round once per step.
#pragma once

#include <mpi.h>

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist::detail {

struct MpiHalfTypes {
  // Set once by MpiTypes::create(); read by the user-defined ops (which only get the datatype).
  static inline MPI_Datatype bfloat16 = MPI_DATATYPE_NULL;
  static inline MPI_Datatype float16 = MPI_DATATYPE_NULL;
};

template <class T, class Combine>
void combine_half(const void* in, void* inout, int len, Combine combine) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < len; ++i) b[i] = T(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

template <class Combine>
void half_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  if (*type == MpiHalfTypes::bfloat16) {
    combine_half<c10::BFloat16>(in, inout, *len, Combine{});
  } else if (*type == MpiHalfTypes::float16) {
    combine_half<c10::Half>(in, inout, *len, Combine{});
  }
}

struct HalfSum {
  float operator()(float a, float b) const { return a + b; }
};
struct HalfMax {
  float operator()(float a, float b) const { return a > b || b != b ? a : b; }
};
struct HalfMin {
  float operator()(float a, float b) const { return a < b || b != b ? a : b; }
};

/// Datatypes and ops, created after MPI_Init and freed before MPI_Finalize.
class MpiTypes {
 public:
  void create() {
    MPI_Type_contiguous(2, MPI_BYTE, &MpiHalfTypes::bfloat16);
    MPI_Type_commit(&MpiHalfTypes::bfloat16);
    MPI_Type_contiguous(2, MPI_BYTE, &MpiHalfTypes::float16);
    MPI_Type_commit(&MpiHalfTypes::float16);
    MPI_Op_create(&half_op<HalfSum>, /*commute=*/1, &half_sum_);
    MPI_Op_create(&half_op<HalfMax>, 1, &half_max_);
    MPI_Op_create(&half_op<HalfMin>, 1, &half_min_);
  }
  void destroy() {
    for (MPI_Op* op : {&half_sum_, &half_max_, &half_min_}) {
      if (*op != MPI_OP_NULL) MPI_Op_free(op);
    }
    for (MPI_Datatype* t : {&MpiHalfTypes::bfloat16, &MpiHalfTypes::float16}) {
      if (*t != MPI_DATATYPE_NULL) MPI_Type_free(t);
    }
  }

  static MPI_Datatype datatype(const OpContext& ctx, at::ScalarType dtype) {
    switch (dtype) {
      case at::kFloat: return MPI_FLOAT;
      case at::kDouble: return MPI_DOUBLE;
      case at::kBFloat16: return MpiHalfTypes::bfloat16;
      case at::kHalf: return MpiHalfTypes::float16;
      case at::kInt: return MPI_INT32_T;
      case at::kLong: return MPI_INT64_T;
      case at::kChar: return MPI_INT8_T;
      case at::kByte: return MPI_UINT8_T;
      case at::kBool: return MPI_C_BOOL;
      default: break;
    }
    FSDPX_FAIL(ConfigError, ctx, ": dtype ", dtype,
               " is not supported by the MPI backend (float32, float64, bfloat16, "
               "float16, int8, uint8, int32, int64, bool are)");
  }

  /// The MPI op that implements `op` (avg is a sum followed by a division).
  MPI_Op reduction(const OpContext& ctx, ReduceOp op, at::ScalarType dtype) const {
    FSDPX_CHECK(dtype != at::kBool, ctx, ": reductions over bool tensors are not supported");
    const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: return half ? half_sum_ : MPI_SUM;
      case ReduceOp::max: return half ? half_max_ : MPI_MAX;
      case ReduceOp::min: return half ? half_min_ : MPI_MIN;
    }
    return MPI_OP_NULL;
  }

 private:
  MPI_Op half_sum_ = MPI_OP_NULL;
  MPI_Op half_max_ = MPI_OP_NULL;
  MPI_Op half_min_ = MPI_OP_NULL;
};

}  // namespace fsdpx::dist::detail
