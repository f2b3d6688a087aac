// SyncBatchNorm: BatchNorm whose batch statistics are those of every data-parallel rank's batch together,
// as PyTorch's torch.nn.SyncBatchNorm (LibTorch has none). A drop-in for BatchNorm1d, 2d and 3d (any input
// of at least two dimensions, channels second), with their parameters, buffers and names, so state dicts
// and checkpoints are a BatchNorm's. Fsdp hands every SyncBatchNorm of its model a duplicate of the world
// communicator at construction; without one (an unsharded reference, a world of one) it is BatchNorm.
//
// In training, each forward sums [count, sum of x] and then the sum of squared deviations from the global
// mean over the ranks (two all-reduces of C + 1 and C values, the two-pass variance), and its backward sums
// their gradients the same way: every rank's output depends on every rank's input. Every rank must call
// each SyncBatchNorm as often as the others, in the same order (as with PyTorch's). Evaluation uses the
// running statistics and no collective.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <memory>
#include <optional>
#include <ostream>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/core/detail/autograd.hpp>
#include <fsdpx/dist/any.hpp>

namespace fsdpx {

class SyncBatchNormImpl : public torch::nn::NormImplBase<1, SyncBatchNormImpl, torch::nn::BatchNormOptions> {
 public:
  explicit SyncBatchNormImpl(int64_t num_features) : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options) : NormImplBase(options) {}

  FSDPX_DECL at::Tensor forward(const at::Tensor& input);

  /// The ranks whose batches make one batch's statistics (Fsdp sets its world's); none: BatchNorm.
  FSDPX_DECL void set_group(std::optional<dist::AnyCommunicator> group);
  bool synchronized() const { return static_cast<bool>(sum_over_group_); }

  void pretty_print(std::ostream& stream) const override {
    stream << std::boolalpha << "fsdpx::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
           << ", momentum=";
    if (options.momentum()) {
      stream << *options.momentum();
    } else {
      stream << "None";
    }
    stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats()
           << ", synchronized=" << synchronized() << ')';
  }

 protected:
  FSDPX_DECL void _check_input_dim(const at::Tensor& input) override;

 private:
  /// The batch statistics over the group, and the running statistics updated with them.
  FSDPX_DECL at::Tensor synchronized_forward(const at::Tensor& input, double momentum);

  std::shared_ptr<core::detail::SumOverRanks> sum_over_group_;
  int group_size_ = 1;
};
TORCH_MODULE(SyncBatchNorm);

namespace core {
/// Gives every SyncBatchNorm inside `model` the group `group` (Fsdp: a duplicate of its world).
FSDPX_DECL void set_sync_batch_norm_group(torch::nn::Module& model, const dist::AnyCommunicator& group);
}  // namespace core

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/sync_batch_norm.ipp>
#endif
