// Where fsdpx reaches into autograd's internals (torch/csrc/autograd); core/detail/storage.hpp is its
// twin for LibTorch's storage and allocator. Everything here was checked against LibTorch's sources and
// is exercised by the parity tests (tests/core): LibTorch modules have no hooks, so the unit protocol
// runs from a call-site function plus these autograd triggers. docs/core.md ("The unit boundary") explains the design.
// The definitions are in core/impl/autograd.ipp, so a translation unit that includes this header does not compile
// autograd's custom-function machinery.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdpx::core::detail {

// ---- pre-backward: runs when the gradient of a unit's output arrives, before the unit's backward --

using BackwardHook = std::function<void()>;

/// Registers `hook` on `x` (which must require grad). The graph owns the hook, so a graph that is
/// dropped without a backward pass frees it.
FSDPX_DECL void add_pre_backward_hook(const at::Tensor& x, std::shared_ptr<BackwardHook> hook);

// ---- post-backward: after a parameter's gradient is accumulated -----------------------------------

/// What LibTorch hands out for a gradient accumulator: std::shared_ptr<Node> up to 2.11, an intrusive
/// pointer in later releases; the hooks' owners keep whichever it is.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// Runs `fn` each time autograd has accumulated `param`'s gradient (as PyTorch's C++ DDP reducer does).
/// The returned node must be kept alive: the parameter only holds it weakly.
FSDPX_DECL NodePtr add_post_accumulate_hook(const at::Tensor& param, std::function<void()> fn);

// ---- post-backward: after the backward of one unit call has reached the call's inputs --------------
// FSDP2's RegisterPostBackwardFunction in C++: one identity node over every input of a unit call that
// requires grad. Autograd runs it once the gradients of all those inputs are complete, which is when
// the call's backward (and the accumulation of the parameter gradients on the way) is done.

/// Returns `inputs` (each requiring grad) routed through one node that runs `hook` in backward.
FSDPX_DECL std::vector<at::Tensor> add_post_backward_hook(std::vector<at::Tensor> inputs,
                                                          std::shared_ptr<BackwardHook> hook);

// ---- end of backward --------------------------------------------------------------------------------

/// Runs `fn` once the current backward pass has finished. Valid only while a backward pass runs.
/// Autograd drops it, unrun, when the pass ends with an exception.
FSDPX_DECL void at_end_of_backward(std::function<void()> fn);

/// The backward pass (graph task) this thread is running, or -1 outside backward. Each pass has its
/// own id, so a pass that began and never ended is told apart from the one running now.
FSDPX_DECL int current_backward_pass_id();

// ---- activation checkpointing: a unit call recomputed inside backward --------------------------------
// The reentrant form (torch.utils.checkpoint's use_reentrant=True): LibTorch's saved-tensor default
// hooks take only Python objects, so one custom node runs the call with gradients off, keeping only
// its inputs, and its backward runs the call again with gradients on and differentiates that.

/// What a checkpointed call is to autograd.
class Recomputation {
 public:
  virtual ~Recomputation() = default;
  /// Runs the call on `inputs` (its tensors, in the order given to run_checkpointed) and returns its
  /// output tensors in a fixed order: once in forward (gradients off), once inside backward.
  virtual std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) = 0;
  /// Where the call computes: its generator's state is kept besides the CPU's.
  virtual at::Device device() const = 0;
  /// The parameters whose gradients the recomputation's backward computes.
  virtual std::vector<at::Tensor> parameters() const = 0;
  /// Those gradients, in the same order (undefined for a parameter the call did not use).
  virtual void accept_parameter_gradients(std::vector<at::Tensor> grads) = 0;
  /// The buffers the call may change (BatchNorm's running statistics and counter): the recomputation runs
  /// on their values of the forward and leaves them as it found them, so a checkpointed call changes them
  /// once, as an unchecked one does.
  virtual std::vector<at::Tensor> buffers() const { return {}; }
};

/// Runs `call` on `inputs` without keeping its activations and returns its outputs, which carry one
/// node whose backward sets the random generators (CPU, and the call's device) and the call's buffers to
/// their states of this forward, recomputes the call with gradients on, puts the buffers back, and
/// differentiates it for the inputs and the parameters. With `anchor`, the outputs require grad even when no input does
/// (the parameters do). Undefined inputs and outputs pass around the node in their places.
FSDPX_DECL std::vector<at::Tensor> run_checkpointed(const std::vector<at::Tensor>& inputs,
                                                    std::shared_ptr<Recomputation> call, bool anchor);

// ---- a collective inside the graph: SyncBatchNorm's statistics --------------------------------------

/// Adds, in place, every rank's tensor of a group into each (an all-reduce of sums).
using SumOverRanks = std::function<void(at::Tensor&)>;

/// The sum of `x` over the ranks of `sum_in_place`'s group, differentiable: every rank's result depends
/// on every rank's `x`, so its backward sums the result's gradients over the group the same way. Every
/// rank must run it, and its backward, as often as the others and in the same order.
FSDPX_DECL at::Tensor sum_over_ranks(const at::Tensor& x, std::shared_ptr<SumOverRanks> sum_in_place);

/// Adds `grad` to `param`'s gradient as autograd's AccumulateGrad does (taking `grad` over when
/// nothing else refers to it, else copying it).
FSDPX_DECL void accumulate_grad(const at::Tensor& param, at::Tensor grad);

}  // namespace fsdpx::core::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/autograd.ipp>
#endif
