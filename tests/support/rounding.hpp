// How far apart two floating-point computations of the same math may be: bounds derived from the
// arithmetic (the dtype's unit roundoff, the length of the sums, how many of them lie one after another),
// not from what one machine's kernels happened to produce. docs/numerics.md has the derivation and the
// margins measured on two CPU kernel sets.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <c10/core/ScalarType.h>

namespace fsdpx::test::rounding {

/// u: the largest relative error of rounding one real result to `dtype` (half its machine epsilon).
inline double unit_roundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return std::ldexp(1.0, -53);
    case at::kFloat: return std::ldexp(1.0, -24);
    case at::kHalf: return std::ldexp(1.0, -11);
    case at::kBFloat16: return std::ldexp(1.0, -8);
    default: throw std::invalid_argument(std::string("no unit roundoff for ") + c10::toString(dtype));
  }
}

/// The computation behind a compared value, as far as rounding sees it: `depth` sums one after another
/// (a layer's products, its norms' means, a softmax's denominator...), each of at most `length` terms,
/// whose summation order two computations may choose differently (another kernel set, another world
/// size's reduction, another chunking). Sums accumulate in float32; each result is stored in `storage`
/// (bfloat16 compute rounds every stage's result once more). A value that is the mean of `averaged`
/// values of one sign, each computed along the path from its own data (a loss over its tokens), averages
/// their independent errors, and its own mean is one more stage.
struct Path {
  int64_t length = 1;
  int64_t depth = 1;
  at::ScalarType storage = at::kFloat;
  int64_t averaged = 1;
};

/// How many standard deviations a bound allows: for independent Gaussian errors, the largest of 10^6
/// compared elements stays within 6 with probability 0.998 (and rounding errors are bounded, so their
/// sums have lighter tails than the Gaussian).
inline constexpr double confidence = 6;

/// The standard deviation of the difference of two computations along `path`, relative to the value's
/// scale. Each rounding is an independent relative error uniform in [-u, u] (variance u^2 / 3: Higham
/// and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019). A sum
/// of n terms rounds n partial sums no larger than its result's scale in a well-conditioned sum: variance
/// at most n u^2 / 3 of the scale squared; storing the result in a coarser dtype adds u_s^2 / 3. Stages in
/// sequence add their variances (a residual stream or a normalization passes relative error on without
/// gain), and the two computations' errors are independent: twice that.
inline double spread(const Path& path) {
  const double ua = unit_roundoff(at::kFloat), us = unit_roundoff(path.storage);
  const bool coarse = path.storage != at::kFloat && path.storage != at::kDouble;
  const auto stage = [&](int64_t length) {  // one stage's variance, both computations
    return 2 * (ua * ua * static_cast<double>(length) / 3 + (coarse ? us * us / 3 : 0.0));
  };
  const double along = static_cast<double>(path.depth) * stage(path.length);
  if (path.averaged <= 1) return std::sqrt(along);
  return std::sqrt(along / static_cast<double>(path.averaged) + stage(path.averaged));
}

/// Bound on max |a - b| / max |b| for two computations of the same value along `path`.
inline double relative(const Path& path) { return confidence * spread(path); }

/// The backward pass of a forward path: every forward sum has its mirror (the gradient with respect to
/// its input), and each weight's gradient is one more sum over the tokens of the batch.
inline Path backward(const Path& forward, int64_t tokens) {
  return {std::max(forward.length, tokens), 2 * forward.depth + 1, forward.storage};
}

/// A loss over `tokens`: the mean of each token's value along the forward path.
inline Path loss(const Path& forward, int64_t tokens) {
  return {forward.length, forward.depth, forward.storage, tokens};
}

/// The largest |m_hat| / sqrt(v_hat) Adam's bias-corrected moments can reach after `step` steps, for any
/// gradients: by Cauchy-Schwarz over the moments' weights,
///   kappa^2 = (1 - b1)^2 (1 - b2^t) / ((1 - b2) (1 - b1^t)^2) * sum_{j<t} (b1^2 / b2)^j   (1 at t = 1).
inline double adam_moment_ratio(double beta1, double beta2, int64_t step) {
  double sum = 0, term = 1;
  for (int64_t j = 0; j < step; ++j, term *= beta1 * beta1 / beta2) sum += term;
  const double t = static_cast<double>(step);
  const double k2 =
      (1 - beta1) * (1 - beta1) * (1 - std::pow(beta2, t)) / ((1 - beta2) * std::pow(1 - std::pow(beta1, t), 2)) * sum;
  return std::sqrt(k2);
}

}  // namespace fsdpx::test::rounding
