// Autograd of attention_forward, in C++: its backward is the attention_backward op
// (FlashAttention-2 recompute from the saved out and logsumexp). A Python autograd
// registration costs about 15 us per call, inference included, which small decode-loop
// shapes notice; this kernel costs about 1 us and works for every backend and under
// torch.compile (the backward calls an op with a fake implementation).
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "op_handles.h"

namespace mha_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> as_optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
                               const std::optional<at::Tensor>& dropout_seed, double dropout_p,
                               double scale, int64_t window_left, int64_t window_right,
                               bool bottom_right) {
    // Unused outputs get no zero-filled gradient (see backward).
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = attention_forward_op().call(q, k, v, attn_mask, dropout_seed, dropout_p, scale,
                                                  window_left, window_right, bottom_right);
    ctx->save_for_backward({q, k, v, out, lse, attn_mask.value_or(at::Tensor()),
                            dropout_seed.value_or(at::Tensor())});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["bottom_right"] = bottom_right;
    return {out, lse};
  }

  // grads: d loss / d out and d loss / d lse, undefined for an output the loss did not use.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    // The kernels read rows of grad_out; a broadcast gradient (out.sum() gives stride 0)
    // has to become real rows first.
    if (grad_out.dim() > 0 && grad_out.stride(-1) != 1) grad_out = grad_out.contiguous();
    auto [grad_q, grad_k, grad_v] = attention_backward_op().call(
        grad_out, as_optional(grads[1]), saved[0], saved[1], saved[2], saved[3], saved[4],
        as_optional(saved[5]), as_optional(saved[6]), ctx->saved_data["dropout_p"].toDouble(),
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["window_left"].toInt(),
        ctx->saved_data["window_right"].toInt(), ctx->saved_data["bottom_right"].toBool());
    // No gradient for attn_mask, dropout_seed and the five options.
    return {grad_q, grad_k, grad_v, {}, {}, {}, {}, {}, {}, {}};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  // Without a gradient to record, skip building the graph node and its saved state: about
  // 2 us of a decode step's 7 us at (1, 1, 1, 64).
  const bool records_grad =
      at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!records_grad) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_forward_op().call(q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left,
                                       window_right, bottom_right);
  }
  const variable_list outputs = AttentionFunction::apply(q, k, v, attn_mask, dropout_seed, dropout_p,
                                                         scale, window_left, window_right, bottom_right);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, Autograd, m) { m.impl("attention_forward", &attention_forward_autograd); }

}  // namespace mha_ext
