// core/detail/autograd.hpp's definitions: included by that header (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cstring>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <fsdpx/core/detail/autograd.hpp>

namespace fsdpx::core::detail {

FSDPX_DECL void add_pre_backward_hook(const at::Tensor& x, std::shared_ptr<BackwardHook> hook) {
  x.register_hook([hook = std::move(hook)](const at::Tensor&) { (*hook)(); });
}

class PostAccumulateHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

FSDPX_DECL NodePtr add_post_accumulate_hook(const at::Tensor& param, std::function<void()> fn) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<PostAccumulateHook>(std::move(fn)));
  return accumulator;
}

// An autograd Function keeps a C++ object in its context as a capsule (saved_data holds IValues).
template <class T>
class SharedHolder final : public torch::CustomClassHolder {
 public:
  explicit SharedHolder(std::shared_ptr<T> value) : value(std::move(value)) {}
  std::shared_ptr<T> value;
};

template <class T>
void save_shared(torch::autograd::AutogradContext* ctx, const std::string& key, std::shared_ptr<T> value) {
  ctx->saved_data[key] = c10::IValue::make_capsule(c10::make_intrusive<SharedHolder<T>>(std::move(value)));
}

template <class T>
std::shared_ptr<T> saved_shared(torch::autograd::AutogradContext* ctx, const std::string& key) {
  const auto capsule = ctx->saved_data[key].toCapsule();
  return static_cast<SharedHolder<T>*>(capsule.get())->value;
}

struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                std::shared_ptr<BackwardHook> hook) {
    ctx->set_materialize_grads(false);  // an input without a gradient passes an undefined one on
    save_shared(ctx, "hook", std::move(hook));
    return inputs.vec();  // autograd returns views of them with this node as their grad_fn
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    (*saved_shared<BackwardHook>(ctx, "hook"))();
    grads.emplace_back();  // no gradient for the hook argument
    return grads;
  }
};

FSDPX_DECL std::vector<at::Tensor> add_post_backward_hook(std::vector<at::Tensor> inputs,
                                                          std::shared_ptr<BackwardHook> hook) {
  // A TensorList argument (not a std::vector) is what autograd records as differentiable inputs.
  return PostBackwardFunction::apply(at::TensorList(inputs), std::move(hook));
}

struct SumOverRanksFunction : torch::autograd::Function<SumOverRanksFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::shared_ptr<SumOverRanks> sum) {
    at::Tensor out = x.detach().contiguous().clone();
    (*sum)(out);
    save_shared(ctx, "sum", std::move(sum));
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor g = grads[0].contiguous().clone();  // materialized: every rank takes part, with zeros if need be
    (*saved_shared<SumOverRanks>(ctx, "sum"))(g);
    return {g, at::Tensor()};
  }
};

FSDPX_DECL at::Tensor sum_over_ranks(const at::Tensor& x, std::shared_ptr<SumOverRanks> sum_in_place) {
  return SumOverRanksFunction::apply(x, std::move(sum_in_place));
}

FSDPX_DECL void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

FSDPX_DECL int current_backward_pass_id() { return torch::autograd::get_current_graph_task_id(); }

/// The states of the default generators a call may draw from: the CPU's, and its device's.
struct RngStates {
  at::Tensor cpu;
  std::optional<at::Device> device;
  at::Tensor on_device;

  static RngStates capture(at::Device where) {
    RngStates s;
    if (!where.is_cpu()) s.device = where;
    const std::optional<at::Device> device = s.device;
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard lock(gen.mutex());
      s.cpu = gen.get_state();
    }
    if (device) {
      at::Generator gen = at::globalContext().defaultGenerator(*device);
      std::lock_guard lock(gen.mutex());
      s.on_device = gen.get_state();
    }
    return s;
  }
  void restore() const {
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard lock(gen.mutex());
      gen.set_state(cpu);
    }
    if (device) {
      at::Generator gen = at::globalContext().defaultGenerator(*device);
      std::lock_guard lock(gen.mutex());
      gen.set_state(on_device);
    }
  }
};

/// The generators set to `saved` for the scope's lifetime, then back to where they were, so a
/// recomputation draws what its forward drew and the program's own stream does not move (fork_rng).
class RngFork {
 public:
  explicit RngFork(const RngStates& saved)
      : previous_(RngStates::capture(saved.device.value_or(at::Device(at::kCPU)))) {
    saved.restore();
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;
  ~RngFork() { previous_.restore(); }

 private:
  RngStates previous_;
};

struct CheckpointState {
  std::shared_ptr<Recomputation> call;
  std::vector<bool> input_defined;   // the call's inputs that are defined: only those enter the node
  std::vector<bool> output_defined;  // its forward's outputs that are defined: only those leave it
  bool anchored = false;             // an anchor follows the inputs in the node's inputs
  RngStates rng;
  std::vector<at::Tensor> buffers_before;  // the call's buffers as its forward found them
};

/// Copies of `buffers`' values.
inline std::vector<at::Tensor> buffer_values(const std::vector<at::Tensor>& buffers) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  out.reserve(buffers.size());
  for (const at::Tensor& b : buffers) out.push_back(b.defined() ? b.clone() : at::Tensor());
  return out;
}

/// Writes `values` into `buffers` in place (the module keeps its tensors).
inline void set_buffer_values(const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers.size() && i < values.size(); ++i) {
    if (buffers[i].defined() && values[i].defined()) buffers[i].copy_(values[i]);
  }
}

// Autograd's Function records the device of every tensor it takes or returns, so an undefined one
// (an optional argument, an entropy not asked for) stays outside the node and is put back around it.
inline std::vector<at::Tensor> with_undefined(const std::vector<at::Tensor>& defined, const std::vector<bool>& mask) {
  std::vector<at::Tensor> all;
  all.reserve(mask.size());
  size_t next = 0;
  for (const bool d : mask) all.push_back(d ? defined.at(next++) : at::Tensor());
  return all;
}

inline std::vector<at::Tensor> defined_only(std::vector<at::Tensor> all, const std::vector<bool>& mask) {
  std::vector<at::Tensor> defined;
  for (size_t i = 0; i < all.size(); ++i) {
    if (mask[i]) defined.push_back(std::move(all[i]));
  }
  return defined;
}

inline std::vector<bool> defined_mask(const std::vector<at::Tensor>& tensors) {
  std::vector<bool> mask;
  mask.reserve(tensors.size());
  for (const at::Tensor& t : tensors) mask.push_back(t.defined());
  return mask;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList all,
                                                std::shared_ptr<CheckpointState> state) {
    ctx->set_materialize_grads(false);  // outputs without a gradient stay undefined: nothing to recompute for
    const std::vector<at::Tensor> inputs(all.begin(), all.end() - (state->anchored ? 1 : 0));
    state->rng = RngStates::capture(state->call->device());
    state->buffers_before = buffer_values(state->call->buffers());
    std::vector<at::Tensor> outputs = state->call->run(with_undefined(inputs, state->input_defined));  // gradients off
    state->output_defined = defined_mask(outputs);
    outputs = defined_only(std::move(outputs), state->output_defined);
    ctx->save_for_backward(inputs);
    for (const at::Tensor& t : outputs) {
      if (!(t.is_floating_point() || t.is_complex())) ctx->mark_non_differentiable({t});
    }
    save_shared(ctx, "state", std::move(state));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::shared_ptr<CheckpointState> state = saved_shared<CheckpointState>(ctx, "state");
    FSDPX_CHECK(!at::GradMode::is_enabled(),
                "a checkpointed unit cannot be differentiated twice (backward with "
                "create_graph): turn activation checkpointing off for this pass (set_activation_checkpointing(false))");
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (const at::Tensor& x : saved) inputs.push_back(x.detach().requires_grad_(x.requires_grad()));
    // The buffers as this forward found them while it runs again, and as every later forward left them once
    // the recomputation is differentiated (its graph saved them: they change only after that, on every way out).
    struct BuffersBack {
      std::vector<at::Tensor> buffers, values;
      ~BuffersBack() {
        try {
          set_buffer_values(buffers, values);
        } catch (const std::exception& e) {
          TORCH_WARN("fsdpx: a checkpointed unit's buffers could not be put back after its recomputation: ", e.what());
        }
      }
    } buffers_back{state->call->buffers(), {}};
    buffers_back.values = buffer_values(buffers_back.buffers);
    set_buffer_values(buffers_back.buffers, state->buffers_before);
    std::vector<at::Tensor> outputs;
    {
      RngFork fork(state->rng);
      at::AutoGradMode grad_on(true);
      outputs = state->call->run(with_undefined(inputs, state->input_defined));
    }
    FSDPX_CHECK(defined_mask(outputs) == state->output_defined, "a checkpointed unit's recomputation returned ",
                outputs.size(), " tensors (or undefined ones in other places) where its forward returned ",
                state->output_defined.size(), " (the call is not deterministic in its outputs)");
    outputs = defined_only(std::move(outputs), state->output_defined);
    torch::autograd::variable_list roots, root_grads, targets;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    std::vector<size_t> input_slots;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) {
        input_slots.push_back(i);
        targets.push_back(inputs[i]);
      }
    }
    const std::vector<at::Tensor> params = state->call->parameters();
    targets.insert(targets.end(), params.begin(), params.end());
    torch::autograd::variable_list result(targets.size());
    if (!roots.empty() && !targets.empty()) {
      result = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
    }
    state->call->accept_parameter_gradients(
        {std::make_move_iterator(result.begin() + static_cast<std::ptrdiff_t>(input_slots.size())),
         std::make_move_iterator(result.end())});
    // One gradient per tensor of the list (the defined inputs, then the anchor's, undefined), one for the state.
    torch::autograd::variable_list out(inputs.size() + (state->anchored ? 1 : 0));
    for (size_t k = 0; k < input_slots.size(); ++k) out[input_slots[k]] = std::move(result[k]);
    out.emplace_back();
    return out;
  }
};

FSDPX_DECL std::vector<at::Tensor> run_checkpointed(const std::vector<at::Tensor>& inputs,
                                                    std::shared_ptr<Recomputation> call, bool anchor) {
  auto state = std::make_shared<CheckpointState>();
  state->call = std::move(call);
  state->input_defined = defined_mask(inputs);
  state->anchored = anchor;
  std::vector<at::Tensor> all = defined_only(inputs, state->input_defined);
  if (anchor) all.push_back(at::empty({0}).requires_grad_(true));
  const std::shared_ptr<CheckpointState> owner = state;  // without gradients the node is gone after apply
  std::vector<at::Tensor> outputs = CheckpointFunction::apply(at::TensorList(all), std::move(state));
  return with_undefined(outputs, owner->output_defined);
}

FSDPX_DECL void accumulate_grad(const at::Tensor& param, at::Tensor grad) {
  if (!grad.defined()) return;
  at::NoGradGuard no_grad;
  at::Tensor& current = param.mutable_grad();
  if (current.defined()) {
    current.add_(grad);
    return;
  }
  // Taken over only when nothing else can see its bytes, as AccumulateGrad steals a fresh gradient.
  const bool owned = grad.use_count() == 1 && grad.storage().use_count() == 1 && grad.is_contiguous() &&
                     grad.storage_offset() == 0 && grad.storage().nbytes() == grad.nbytes() &&
                     grad.sizes() == param.sizes() && grad.scalar_type() == param.scalar_type();
  current =
      owned ? std::move(grad) : grad.to(param.scalar_type()).clone(at::MemoryFormat::Contiguous).view(param.sizes());
}

}  // namespace fsdpx::core::detail
