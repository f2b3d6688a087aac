// models/loss.hpp's definitions: included by that header (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <initializer_list>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>

#include <fsdpx/error.hpp>
#include <fsdpx/models/loss.hpp>

namespace fsdpx::models {

namespace detail {

/// [n, H] hidden, [V, H] weight, optional [V] bias, [n] targets: checked and flattened.
struct HeadInputs {
  at::Tensor hidden, weight, bias, targets;
  std::vector<int64_t> leading;  // hidden's shape without its last dimension
};

inline HeadInputs head_inputs(const char* what, const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, const at::Tensor& bias) {
  FSDPX_CHECK(hidden.defined() && weight.defined() && targets.defined(), what,
              ": hidden, weight and targets must be given");
  FSDPX_CHECK(weight.dim() == 2, what, ": the head's weight must be [vocabulary, hidden], not ", weight.sizes());
  FSDPX_CHECK(hidden.dim() >= 1 && hidden.size(-1) == weight.size(1), what, ": hidden states ", hidden.sizes(),
              " do not end in the head's input size ", weight.size(1));
  FSDPX_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), what,
              ": the head's bias must be [", weight.size(0), "], not ", bias.sizes());
  FSDPX_CHECK(targets.scalar_type() == at::kLong, what, ": targets must be int64, not ", targets.scalar_type());
  std::vector<int64_t> leading(hidden.sizes().begin(), hidden.sizes().end() - 1);
  FSDPX_CHECK(targets.sizes().vec() == leading, what, ": targets ", targets.sizes(),
              " must have the hidden states' leading shape ", at::IntArrayRef(leading));
  // Autograd's custom functions take no undefined tensor: no bias is an empty one.
  const at::Tensor no_bias = bias.defined() ? bias : at::empty({0}, weight.options());
  return {hidden.reshape({-1, hidden.size(-1)}), weight, no_bias, targets.reshape({-1}).to(hidden.device()),
          std::move(leading)};
}

/// A check asked earlier, for these labels: as many, this head's vocabulary, the same ignore index.
inline bool read_check(const LabelCheck& check, const at::Tensor& labels, int64_t vocabulary,
                       std::optional<int64_t> ignore_index) {
  FSDPX_CHECK(check.vocabulary() == vocabulary, "a label check asked for a vocabulary of ", check.vocabulary(),
              " was given to a head of ", vocabulary);
  FSDPX_CHECK(check.count() == labels.numel() && check.ignore_index() == ignore_index, "a label check of ",
              check.count(), " labels was given to a head of ", labels.numel(), " (or with another ignore index)");
  return check.passed();
}

inline int64_t chunk_tokens(int64_t chunk_logits, int64_t vocabulary, int64_t tokens) {
  if (chunk_logits <= 0) return std::max<int64_t>(tokens, 1);
  return std::max<int64_t>(1, chunk_logits / std::max<int64_t>(vocabulary, 1));
}

/// One chunk's logits in float32: computed in the weight's dtype, then cast (transformers' logits.float()).
inline at::Tensor chunk_logits_f32(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias) {
  return at::linear(hidden, weight, bias.numel() > 0 ? std::optional<at::Tensor>(bias) : std::nullopt).to(at::kFloat);
}

/// The gradients of hidden, weight and bias from dlogits of one chunk, accumulated (weight and bias in float32).
struct HeadGrads {
  at::Tensor hidden, weight, bias;

  HeadGrads(std::array<bool, 3> wanted, const at::Tensor& hidden_in, const at::Tensor& weight_in,
            const at::Tensor& bias_in) {
    if (wanted[0]) hidden = at::empty_like(hidden_in);
    if (wanted[1]) weight = at::zeros(weight_in.sizes(), weight_in.options().dtype(at::kFloat));
    if (bias_in.numel() > 0 && wanted[2]) bias = at::zeros(bias_in.sizes(), bias_in.options().dtype(at::kFloat));
  }
  HeadGrads(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden_in, const at::Tensor& weight_in,
            const at::Tensor& bias_in)
      : HeadGrads({ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)}, hidden_in, weight_in,
                  bias_in) {}
  void add(int64_t begin, const at::Tensor& dlogits_f32, const at::Tensor& h, const at::Tensor& w) {
    const at::Tensor dz = dlogits_f32.to(w.scalar_type());
    if (hidden.defined()) hidden.narrow(0, begin, h.size(0)).copy_(at::mm(dz, w));
    if (weight.defined()) {
      if (dz.scalar_type() == at::kFloat) {
        weight.addmm_(dz.t(), h);
      } else {
        weight.add_(at::mm(dz.t(), h));
      }
    }
    if (bias.defined()) bias.add_(dlogits_f32.sum(0));
  }
  torch::autograd::variable_list finish(const at::Tensor& w, const at::Tensor& b) {
    return {hidden, weight.defined() ? weight.to(w.scalar_type()) : weight,
            bias.defined() ? bias.to(b.scalar_type()) : bias};
  }
};

/// d(cross-entropy)/d(logits) of one chunk, unscaled, from its softmax `p` (overwritten): p - one-hot(label),
/// zero where the label is ignored.
inline at::Tensor minus_one_hot(at::Tensor p, const at::Tensor& labels, const at::Tensor& valid) {
  const at::Tensor v = valid.to(at::kFloat).unsqueeze(1);
  p.scatter_add_(1, labels.unsqueeze(1), -v);
  return p.mul_(v);
}

// The loss is a scalar, so its gradients are known in forward up to the one factor backward brings:
// when autograd records the call (gradients on, an input that requires them: exactly when backward
// can run), forward computes them chunk by chunk right after each chunk's logits (Liger-Kernel's fused
// linear cross-entropy) and backward only scales them. The head's matrix products run three times per
// chunk, as without chunks; recomputing the logits in backward would be a fourth. The gradients held
// between forward and backward are those backward would make at once, and nothing runs in between.
struct ChunkedCrossEntropy : torch::autograd::Function<ChunkedCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& labels, int64_t chunk, int64_t ignore_index,
                            bool mean, bool recorded) {
    const int64_t n = hidden.size(0);
    const at::Tensor valid = labels != ignore_index;
    const at::Tensor safe = at::where(valid, labels, at::zeros_like(labels));
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    std::optional<HeadGrads> grads;
    if (recorded) {
      grads.emplace(std::array<bool, 3>{hidden.requires_grad(), weight.requires_grad(), bias.requires_grad()}, hidden,
                    weight, bias);
    }
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t len = std::min(chunk, n - begin);
      const at::Tensor h = hidden.narrow(0, begin, len);
      at::Tensor z = chunk_logits_f32(h, weight, bias);
      const at::Tensor target = z.gather(1, safe.narrow(0, begin, len).unsqueeze(1)).squeeze(1);
      // log-sum-exp and softmax in place: one chunk-sized buffer (at::logsumexp would make a second).
      const at::Tensor row_max = at::amax(z, {1}, /*keepdim=*/true);
      const at::Tensor sum = z.sub_(row_max).exp_().sum(1);
      const at::Tensor l = sum.log() + row_max.squeeze(1);
      total.add_(((l - target) * valid.narrow(0, begin, len)).sum());
      if (grads) {
        at::Tensor p = z.div_(sum.unsqueeze(1));
        grads->add(begin, minus_one_hot(std::move(p), safe.narrow(0, begin, len), valid.narrow(0, begin, len)), h,
                   weight);
      }
    }
    const at::Tensor count = valid.sum().to(at::kFloat);
    if (grads) {
      // The mean's factor now (no label counted: the loss is NaN, as torch's, and the gradients zero).
      if (mean) scale_defined({grads->hidden, grads->weight, grads->bias}, 1 / count.clamp_min(1));
      ctx->save_for_backward({grads->hidden, grads->weight, grads->bias});
      ctx->saved_data["weight_dtype"] = weight.scalar_type();  // dtypes only: the head's tensors are not held
      ctx->saved_data["bias_dtype"] = bias.scalar_type();
      ctx->saved_data["consumed"] = false;
    }
    return mean ? total / count : total;
  }

  // Scales the gradients in place and hands them on: autograd releases the saved copies right after
  // this returns, so the weight's gradient is taken over, not copied (a second weight-sized buffer).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    FSDPX_CHECK(
        !ctx->saved_data["consumed"].toBool(),
        "linear_cross_entropy: a chunked loss cannot be differentiated "
        "twice (retain_graph): its gradients were made in forward and handed on; use chunk_logits = 0 for that");
    ctx->saved_data["consumed"] = true;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gh = saved[0], &gw = saved[1], &gb = saved[2];
    scale_defined({gh, gw, gb}, grads[0].to(at::kFloat));
    const at::Tensor none;
    return {gh,
            gw.defined() ? gw.to(ctx->saved_data["weight_dtype"].toScalarType()) : none,
            gb.defined() ? gb.to(ctx->saved_data["bias_dtype"].toScalarType()) : none,
            none,
            none,
            none,
            none,
            none};
  }

 private:
  static void scale_defined(std::initializer_list<at::Tensor> tensors, const at::Tensor& factor) {
    for (const at::Tensor& t : tensors) {
      if (t.defined()) t.mul_(factor);  // ATen's in-place operations are const on the handle
    }
  }
};

struct ChunkedLogProbs : torch::autograd::Function<ChunkedLogProbs> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight, const at::Tensor& bias,
                                                const at::Tensor& targets, int64_t chunk, double temperature,
                                                bool entropy) {
    ctx->set_materialize_grads(false);
    const int64_t n = hidden.size(0);
    const auto f32 = hidden.options().dtype(at::kFloat);
    at::Tensor lse = at::empty({n}, f32), log_probs = at::empty({n}, f32);
    at::Tensor mean_logit = entropy ? at::empty({n}, f32) : at::empty({0}, f32),
               ent = at::empty({entropy ? n : 0}, f32);
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t len = std::min(chunk, n - begin);
      at::Tensor z = chunk_logits_f32(hidden.narrow(0, begin, len), weight, bias);
      if (temperature != 1.0) z.div_(temperature);
      const at::Tensor l = at::logsumexp(z, 1);
      lse.narrow(0, begin, len).copy_(l);
      log_probs.narrow(0, begin, len).copy_(z.gather(1, targets.narrow(0, begin, len).unsqueeze(1)).squeeze(1) - l);
      if (entropy) {
        const at::Tensor ez = ((z - l.unsqueeze(1)).exp() * z).sum(1);  // E_p[z]
        mean_logit.narrow(0, begin, len).copy_(ez);
        ent.narrow(0, begin, len).copy_(l - ez);
      }
    }
    ctx->save_for_backward({hidden, weight, bias, targets, lse, mean_logit});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["temperature"] = temperature;
    if (!entropy) ctx->mark_non_differentiable({ent});
    return {log_probs, ent};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &bias = saved[2], &targets = saved[3], &lse = saved[4],
                     &mean_logit = saved[5];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const at::Tensor& g_logp = grads[0];
    const at::Tensor g_ent = mean_logit.numel() > 0 ? grads[1] : at::Tensor();
    HeadGrads out(ctx, hidden, weight, bias);
    const int64_t n = hidden.size(0);
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t len = std::min(chunk, n - begin);
      const at::Tensor h = hidden.narrow(0, begin, len);
      at::Tensor z = chunk_logits_f32(h, weight, bias);
      if (temperature != 1.0) z.div_(temperature);
      const at::Tensor p = (z - lse.narrow(0, begin, len).unsqueeze(1)).exp();
      at::Tensor dz = at::zeros_like(z);
      if (g_logp.defined()) {
        // d log p_t / dz = one-hot(t) - p
        const at::Tensor g = g_logp.narrow(0, begin, len).to(at::kFloat).unsqueeze(1);
        dz.sub_(p * g).scatter_add_(1, targets.narrow(0, begin, len).unsqueeze(1), g);
      }
      if (g_ent.defined()) {
        // d H / dz = -p (z - E_p[z])
        const at::Tensor g = g_ent.narrow(0, begin, len).to(at::kFloat).unsqueeze(1);
        dz.sub_(p * (z - mean_logit.narrow(0, begin, len).unsqueeze(1)) * g);
      }
      if (temperature != 1.0) dz.div_(temperature);
      out.add(begin, dz, h, weight);
    }
    auto g = out.finish(weight, bias);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

FSDPX_DECL LabelCheck::LabelCheck(const at::Tensor& labels, int64_t vocabulary, std::optional<int64_t> ignore_index)
    : vocabulary_(vocabulary), ignore_index_(ignore_index), count_(labels.numel()) {
  at::Tensor ok = (labels >= 0).logical_and(labels < vocabulary);
  if (ignore_index) ok = ok.logical_or(labels == *ignore_index);
  ok = ok.all();
  if (!ok.is_cuda()) {  // answered at once: the CPU's, or a device without pinned host memory
    answer_ = ok.cpu();
    return;
  }
  answer_ = at::empty({}, at::TensorOptions().dtype(at::kBool).pinned_memory(true));
  answer_.copy_(ok, /*non_blocking=*/true);
  const c10::Device device = ok.device();
  ready_.emplace(device.type());
  ready_->record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
}

FSDPX_DECL bool LabelCheck::passed() const {
  if (ready_) ready_->synchronize();
  return answer_.item<bool>();
}

FSDPX_DECL at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                           const CrossEntropyOptions& options, const at::Tensor& bias) {
  const auto in = detail::head_inputs("linear_cross_entropy", hidden, weight, labels, bias);
  const bool mean = options.reduction == LossReduction::mean;
  const int64_t vocab = in.weight.size(0);
  const bool labels_ok = options.labels_checked
                             ? detail::read_check(*options.labels_checked, in.targets, vocab, options.ignore_index)
                             : LabelCheck(in.targets, vocab, options.ignore_index).passed();
  FSDPX_CHECK(labels_ok, "linear_cross_entropy: every label must be a token id in [0, ", vocab,
              ") or the ignore index ", options.ignore_index);
  if (options.chunk_logits <= 0) {
    const at::Tensor logits = detail::chunk_logits_f32(in.hidden, in.weight, in.bias);
    return at::cross_entropy_loss(logits, in.targets, std::nullopt, mean ? at::Reduction::Mean : at::Reduction::Sum,
                                  options.ignore_index);
  }
  const int64_t chunk = detail::chunk_tokens(options.chunk_logits, in.weight.size(0), in.hidden.size(0));
  // Autograd records the call exactly when this holds (labels never require gradients).
  const bool recorded =
      at::GradMode::is_enabled() && (in.hidden.requires_grad() || in.weight.requires_grad() || in.bias.requires_grad());
  return detail::ChunkedCrossEntropy::apply(in.hidden, in.weight, in.bias, in.targets, chunk, options.ignore_index,
                                            mean, recorded);
}

FSDPX_DECL TokenLogProbs linear_log_probs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                          const LogProbOptions& options, const at::Tensor& bias) {
  const auto in = detail::head_inputs("linear_log_probs", hidden, weight, targets, bias);
  FSDPX_CHECK(options.temperature > 0, "linear_log_probs: the temperature must be positive, not ", options.temperature);
  const int64_t vocab = in.weight.size(0);
  const bool range_ok = options.targets_checked
                            ? detail::read_check(*options.targets_checked, in.targets, vocab, std::nullopt)
                            : LabelCheck(in.targets, vocab).passed();
  FSDPX_CHECK(range_ok, "linear_log_probs: every target must be a token id in [0, ", vocab,
              "); mask padding after computing, not with -100");
  TokenLogProbs out;
  if (options.chunk_logits <= 0) {
    at::Tensor z = detail::chunk_logits_f32(in.hidden, in.weight, in.bias);
    if (options.temperature != 1.0) z = z / options.temperature;
    const at::Tensor logp = at::log_softmax(z, 1);
    out.log_probs = logp.gather(1, in.targets.unsqueeze(1)).squeeze(1);
    if (options.entropy) out.entropy = -(logp.exp() * logp).sum(1);
  } else {
    const int64_t chunk = detail::chunk_tokens(options.chunk_logits, vocab, in.hidden.size(0));
    auto r = detail::ChunkedLogProbs::apply(in.hidden, in.weight, in.bias, in.targets, chunk, options.temperature,
                                            options.entropy);
    out.log_probs = r[0];
    if (options.entropy) out.entropy = r[1];
  }
  out.log_probs = out.log_probs.view(in.leading);
  if (out.entropy.defined()) out.entropy = out.entropy.view(in.leading);
  return out;
}

FSDPX_DECL at::Tensor shift_labels(const at::Tensor& labels, int64_t ignore_index) {
  FSDPX_CHECK(labels.dim() == 2 && labels.scalar_type() == at::kLong,
              "CausalLM: labels must be int64 [batch, seq], not ", labels.scalar_type(), " ", labels.sizes());
  return at::constant_pad_nd(labels, {0, 1}, static_cast<double>(ignore_index)).narrow(1, 1, labels.size(1));
}

FSDPX_DECL at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index) {
  const int64_t vocab = logits.size(-1);
  const at::Tensor shifted = shift_labels(labels, ignore_index);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, vocab}), shifted.reshape({-1}).to(logits.device()),
                                std::nullopt, at::Reduction::Mean, ignore_index);
}

}  // namespace fsdpx::models
