// Registers the attention ops (ops/attention.h) for the CPU and CUDA backends, and
// attention_forward's autograd kernel: its backward is the attention_backward op
// (FlashAttention-2 recompute from the saved out and logsumexp). A Python autograd
// registration costs about 15 us per call, inference included, which small decode-loop
// shapes notice; this kernel costs about 1 us and works for every backend and under
// torch.compile (the backward calls an op with a fake implementation).
#include "ops/attention.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <utility>

#include "cpu/backend.h"
#include "ops/op_signature.h"
#if defined(MHA_EXT_WITH_CUDA)
#include "cuda/backend.h"
#include "cuda/on_device.h"
#endif

namespace mha_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename T>
constexpr bool kIsOptionalTensor = std::is_same_v<std::decay_t<T>, std::optional<at::Tensor>>;

// The autograd kernel of attention_forward, whose signature is (q, k, v, options...) with the
// options exactly attention_backward's trailing arguments: the backward is called with the
// saved q, k, v, out, lse and the options as given. Optional tensors among the options are
// saved for backward; the other options go into saved_data under their position.
template <typename Signature>
struct AttentionAutograd;

template <typename... Options>
struct AttentionAutograd<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, Options...)> {
  static_assert(std::is_same_v<AttentionBackwardOp::Signature,
                               std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                   const at::Tensor&, const std::optional<at::Tensor>&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, Options...)>,
                "attention_backward must take (grad_out, grad_lse, q, k, v, out, lse) followed "
                "by attention_forward's arguments after v, and return the gradients of q, k, v "
                "and sinks");
  static constexpr size_t kSavedBeforeOptions = 5;  // q, k, v, out, lse

  struct Node : torch::autograd::Function<Node> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, Options... options) {
      // Unused outputs get no zero-filled gradient (see backward).
      ctx->set_materialize_grads(false);
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      auto [out, lse] = op_handle<AttentionForwardOp>().call(q, k, v, options...);
      std::vector<at::Tensor> saved = {q, k, v, out, lse};
      size_t position = 0;
      (save_option(ctx, saved, position++, options), ...);
      ctx->save_for_backward(saved);
      return {out, lse};
    }

    // grads: d loss / d out and d loss / d lse, undefined for an output the loss did not use.
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
      const variable_list saved = ctx->get_saved_variables();
      at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
      // The kernels read rows of grad_out; a broadcast gradient (out.sum() gives stride 0)
      // has to become real rows first. sym_stride: under torch.compile's dynamic shapes
      // stride() would specialize every stride of the traced gradient to its example value.
      if (grad_out.dim() > 0 && grad_out.sym_stride(-1) != 1) grad_out = grad_out.contiguous();
      const std::optional<at::Tensor> grad_lse =
          grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
      auto [grad_q, grad_k, grad_v, grad_sinks] = std::apply(
          [&](const auto&... options) {
            return op_handle<AttentionBackwardOp>().call(grad_out, grad_lse, saved[0], saved[1],
                                                         saved[2], saved[3], saved[4], options...);
          },
          restored_options(ctx, saved, std::index_sequence_for<Options...>{}));
      variable_list result = {grad_q, grad_k, grad_v};
      result.resize(3 + sizeof...(Options));  // no gradient for the other options
      if (grad_sinks.sym_numel() > 0) result[sinks_position()] = grad_sinks;
      return result;
    }
  };

  // Where attention_forward takes sinks, the one option with a gradient.
  static size_t sinks_position() {
    static const size_t position =
        *op_handle<AttentionForwardOp>().schema().argumentIndexWithName("sinks");
    return position;
  }

  template <typename T>
  static bool option_requires_grad(const T& option) {
    if constexpr (kIsOptionalTensor<T>) {
      return option.has_value() && option->requires_grad();
    } else {
      return false;
    }
  }

  template <typename T>
  static void save_option(AutogradContext* ctx, std::vector<at::Tensor>& saved, size_t position,
                          const T& option) {
    if constexpr (kIsOptionalTensor<T>) {
      saved.push_back(option.value_or(at::Tensor()));
    } else {
      ctx->saved_data[std::to_string(position)] = option;
    }
  }

  template <typename T>
  static std::decay_t<T> restored_option(AutogradContext* ctx, const variable_list& saved,
                                         size_t position, size_t& next_saved) {
    if constexpr (kIsOptionalTensor<T>) {
      const at::Tensor& tensor = saved[next_saved++];
      return tensor.defined() ? std::optional<at::Tensor>(tensor) : std::nullopt;
    } else {
      return ctx->saved_data[std::to_string(position)].to<std::decay_t<T>>();
    }
  }

  template <size_t... Positions>
  static std::tuple<std::decay_t<Options>...> restored_options(AutogradContext* ctx,
                                                               const variable_list& saved,
                                                               std::index_sequence<Positions...>) {
    size_t next_saved = kSavedBeforeOptions;
    // A braced list evaluates its elements in order, as the saved tensors need.
    return std::tuple<std::decay_t<Options>...>{
        restored_option<Options>(ctx, saved, Positions, next_saved)...};
  }

  static std::tuple<at::Tensor, at::Tensor> call(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, Options... options) {
    // Without a gradient to record, skip building the graph node and its saved state: about
    // 2 us of a decode step's 7 us at (1, 1, 1, 64).
    const bool records_grad =
        at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() ||
                                       v.requires_grad() || (option_requires_grad(options) || ...));
    if (!records_grad) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return op_handle<AttentionForwardOp>().call(q, k, v, options...);
    }
    const variable_list outputs = Node::apply(q, k, v, options...);
    return {outputs[0], outputs[1]};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("attention_forward", &attention_forward<cpu::Backend>);
  m.impl("attention_backward", &attention_backward<cpu::Backend>);
  m.impl("dropout_mask", &dropout_mask<cpu::Backend>);
}

#if defined(MHA_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("attention_forward", cuda::on_device<&attention_forward<cuda::Backend>>);
  m.impl("attention_backward", cuda::on_device<&attention_backward<cuda::Backend>>);
  m.impl("dropout_mask", cuda::on_device<&dropout_mask<cuda::Backend>>);
}
#endif

TORCH_LIBRARY_IMPL(mha_ext, Autograd, m) {
  m.impl("attention_forward", &AttentionAutograd<AttentionForwardOp::Signature>::call);
}

}  // namespace mha_ext
