// torch's own flash-attention kernels, callable while mha_ext's provider for torch's SDPA hook
// has taken their place.
//
// mha_ext/integrations/torch_sdpa.py registers mha_ext as the CPU and CUDA kernel of torch's
// flash-attention ops (aten::_scaled_dot_product_flash_attention_for_cpu and the rest). A call
// mha_ext cannot take must run torch's kernel instead, but the dispatcher now leads from the
// aten op back to the provider. These ops call torch's kernel functions (at::native::*, which
// libtorch_cpu and libtorch_cuda export) without the dispatcher. Each takes its aten op's
// arguments; the namespace leaves out "mha_ext" so that a profile of a call that fell through
// shows torch_flash_native::*, not mha_ext.
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_native.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_native.h>
#include <torch/library.h>

#if defined(MHA_EXT_WITH_CUDA)
#include <ATen/ops/_flash_attention_backward_native.h>
#include <ATen/ops/_flash_attention_forward_native.h>
#include <ATen/ops/_flash_attention_forward_no_dropout_inplace_native.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward_native.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_native.h>

#include <optional>
#include <tuple>

#include "cuda/on_device.h"
#endif

TORCH_LIBRARY(torch_flash_native, m) {
  // aten::_scaled_dot_product_flash_attention_for_cpu and its backward.
  m.def(
      "sdpa_cpu(Tensor query, Tensor key, Tensor value, float dropout_p, bool is_causal, "
      "Tensor? attn_mask, float? scale) -> (Tensor output, Tensor logsumexp)");
  m.def(
      "sdpa_cpu_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, float dropout_p, bool is_causal, Tensor? attn_mask, float? scale) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // aten::_scaled_dot_product_flash_attention (CUDA) without its outputs that are no tensors
  // (max_q and max_k, the sequence lengths) or are always undefined for a dense call
  // (cum_seq_q, cum_seq_k), and its backward.
  m.def(
      "sdpa_cuda(Tensor query, Tensor key, Tensor value, float dropout_p, bool is_causal, "
      "bool return_debug_mask, float? scale) -> (Tensor output, Tensor logsumexp, "
      "Tensor rng_state, Tensor unused, Tensor debug_attn_mask)");
  m.def(
      "sdpa_cuda_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, Tensor? cum_seq_q, Tensor? cum_seq_k, int max_q, int max_k, "
      "float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, float? scale) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // aten::_flash_attention_forward, its in-place form and its backward (CUDA).
  m.def(
      "flash_cuda(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
      "int max_q, int max_k, float dropout_p, bool is_causal, bool return_debug_mask, "
      "float? scale, int? window_size_left, int? window_size_right, Tensor? seqused_k, "
      "Tensor? alibi_slopes, Tensor? block_table, int? num_splits) -> (Tensor output, "
      "Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)");
  m.def(
      "flash_cuda_inplace(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor? cum_seq_q, Tensor? cum_seq_k, int max_q, int max_k, float dropout_p, "
      "bool is_causal, bool return_debug_mask, float? scale, int? window_size_left, "
      "int? window_size_right, Tensor? seqused_k, Tensor? alibi_slopes, Tensor? block_table, "
      "int? num_splits) -> Tensor softmax_logsumexp");
  m.def(
      "flash_cuda_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor logsumexp, Tensor? cum_seq_q, Tensor? cum_seq_k, int max_q, int max_k, "
      "float dropout_p, bool is_causal, Tensor rng_state, Tensor unused, float? scale, "
      "int? window_size_left, int? window_size_right) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_flash_native, CPU, m) {
  m.impl("sdpa_cpu", &at::native::_scaled_dot_product_flash_attention_cpu);
  m.impl("sdpa_cpu_backward", &at::native::_scaled_dot_product_flash_attention_cpu_backward);
}

#if defined(MHA_EXT_WITH_CUDA)
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double dropout_p,
    bool is_causal, bool return_debug_mask, std::optional<double> scale) {
  auto [output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask] =
      at::native::_scaled_dot_product_flash_attention_cuda(query, key, value, dropout_p, is_causal,
                                                           return_debug_mask, scale);
  return {output, logsumexp, rng_state, unused, debug_attn_mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sdpa_cuda_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& cum_seq_q, const std::optional<at::Tensor>& cum_seq_k,
    int64_t max_q, int64_t max_k, double dropout_p, bool is_causal, const at::Tensor& philox_seed,
    const at::Tensor& philox_offset, std::optional<double> scale) {
  return at::native::_scaled_dot_product_flash_attention_backward_cuda(
      grad_out, query, key, value, out, logsumexp, cum_seq_q.value_or(at::Tensor()),
      cum_seq_k.value_or(at::Tensor()), max_q, max_k, dropout_p, is_causal, philox_seed,
      philox_offset, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_cuda_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& cum_seq_q, const std::optional<at::Tensor>& cum_seq_k,
    int64_t max_q, int64_t max_k, double dropout_p, bool is_causal, const at::Tensor& rng_state,
    const at::Tensor& unused, std::optional<double> scale, std::optional<int64_t> window_size_left,
    std::optional<int64_t> window_size_right) {
  return at::native::_flash_attention_backward(
      grad_out, query, key, value, out, logsumexp, cum_seq_q.value_or(at::Tensor()),
      cum_seq_k.value_or(at::Tensor()), max_q, max_k, dropout_p, is_causal, rng_state, unused,
      scale, window_size_left, window_size_right);
}

}  // namespace

// The kernels run with their first tensor's device current, as torch's CUDA kernels expect.
TORCH_LIBRARY_IMPL(torch_flash_native, CUDA, m) {
  m.impl("sdpa_cuda", mha_ext::cuda::on_device<&sdpa_cuda>);
  m.impl("sdpa_cuda_backward", mha_ext::cuda::on_device<&sdpa_cuda_backward>);
  m.impl("flash_cuda", mha_ext::cuda::on_device<&at::native::_flash_attention_forward>);
  m.impl("flash_cuda_inplace",
         mha_ext::cuda::on_device<&at::native::_flash_attention_forward_no_dropout_inplace>);
  m.impl("flash_cuda_backward", mha_ext::cuda::on_device<&flash_cuda_backward>);
}
#endif
