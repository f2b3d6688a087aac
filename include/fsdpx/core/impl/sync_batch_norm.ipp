// SyncBatchNorm's member functions, out of line: included by fsdpx/core/sync_batch_norm.hpp (header-only)
// or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION).
#pragma once

#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/batchnorm.h>

#include <fsdpx/core/sync_batch_norm.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

FSDPX_DECL void SyncBatchNormImpl::_check_input_dim(const at::Tensor& input) {
  FSDPX_CHECK(input.dim() >= 2,
              "SyncBatchNorm: expected an input of at least 2 dimensions (batch, channels, ...), got ", input.dim(),
              "D");
  FSDPX_CHECK(input.size(1) == options.num_features(), "SyncBatchNorm(", options.num_features(), "): the input has ",
              input.size(1), " channels (dimension 1)");
}

FSDPX_DECL void SyncBatchNormImpl::set_group(std::optional<dist::AnyCommunicator> group) {
  group_size_ = group ? group->size() : 1;
  if (!group || group_size_ == 1) {
    sum_over_group_.reset();
    return;
  }
  sum_over_group_ = std::make_shared<core::detail::SumOverRanks>(
      [g = *std::move(group)](at::Tensor& t) mutable { g.all_reduce(t, dist::ReduceOp::sum); });
}

FSDPX_DECL at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  _check_input_dim(input);
  // The running statistics' factor, as BatchNorm's: the momentum, or a cumulative average without one.
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats() && num_batches_tracked.defined()) {
    num_batches_tracked += 1;
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();
  }
  const bool batch_statistics = is_training() || !options.track_running_stats();
  if (!batch_statistics || !sum_over_group_) {
    return torch::nn::functional::detail::batch_norm(input, running_mean, running_var, weight, bias, batch_statistics,
                                                     factor, options.eps());
  }
  return synchronized_forward(input, factor);
}

FSDPX_DECL at::Tensor SyncBatchNormImpl::synchronized_forward(const at::Tensor& input, double momentum) {
  const int64_t channels = options.num_features();
  // float32 arithmetic for lower-precision inputs (the statistics of bfloat16 activations), as ATen's
  // BatchNorm kernels accumulate.
  const at::ScalarType compute = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor x = input.to(compute);
  std::vector<int64_t> over{0}, shape(static_cast<size_t>(input.dim()), 1);
  for (int64_t d = 2; d < input.dim(); ++d) over.push_back(d);
  shape[1] = channels;
  // [sum of x, count] over every rank's batch; the count, a constant, takes no gradient.
  const at::Tensor local_count = at::full({1}, static_cast<double>(input.numel() / channels), x.options());
  const at::Tensor sums = core::detail::sum_over_ranks(at::cat({x.sum(over), local_count}), sum_over_group_);
  const at::Tensor count = sums.narrow(0, channels, 1);
  const at::Tensor mean = sums.narrow(0, 0, channels) / count;
  const at::Tensor centered = x - mean.view(shape);
  const at::Tensor variance = core::detail::sum_over_ranks(centered.square().sum(over), sum_over_group_) / count;
  at::Tensor y = centered * (variance + options.eps()).rsqrt().view(shape);
  if (options.affine()) y = y * weight.to(compute).view(shape) + bias.to(compute).view(shape);
  if (options.track_running_stats()) {
    at::NoGradGuard no_grad;
    const at::Tensor unbiased = variance.detach() * count / (count - 1);
    running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.scalar_type()), momentum);
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
  }
  return y.to(input.scalar_type());
}

namespace core {
FSDPX_DECL void set_sync_batch_norm_group(torch::nn::Module& model, const dist::AnyCommunicator& group) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* norm = dynamic_cast<SyncBatchNormImpl*>(m.get())) norm->set_group(group);
  }
}
}  // namespace core

}  // namespace fsdpx
