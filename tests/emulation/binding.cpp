// Python entry points of the emulated CUDA backend: the CUDA op bodies (device_ops.cpp) on
// CPU tensors, with the kernels compiled for the emulator (emu.h). num_sms sizes paged
// attention's split-K plan as a GPU with that many multiprocessors would.
#include <torch/extension.h>

#include "cuda/device_ops.h"

namespace ops = mha_ext::cuda;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_forward", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& attn_mask,
                                const std::optional<at::Tensor>& dropout_seed, double dropout_p, double scale,
                                int64_t window_left, int64_t window_right, bool bottom_right) {
    return ops::attention_forward_on(nullptr, q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left,
                                     window_right, bottom_right);
  });
  m.def("attention_backward",
        [](const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
           const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
           const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
           double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
          return ops::attention_backward_on(nullptr, grad_out, grad_lse, q, k, v, out, lse, attn_mask,
                                            dropout_seed, dropout_p, scale, window_left, window_right,
                                            bottom_right);
        });
  m.def("dropout_mask", [](const at::Tensor& seed, int64_t batch, int64_t heads, int64_t seq_q, int64_t seq_k,
                           double dropout_p) {
    return ops::dropout_mask_on(nullptr, seed, batch, heads, seq_q, seq_k, dropout_p);
  });
  m.def("paged_kv_append", [](const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                              at::Tensor v_cache, const at::Tensor& slot_mapping) {
    ops::paged_kv_append_on(nullptr, key, value, k_cache, v_cache, slot_mapping);
  });
  m.def("paged_attention", [](int num_sms, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& cu_seqlens_q, double scale) {
    return ops::paged_attention_on(nullptr, num_sms, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   scale);
  });
  m.def("merge_attention_states", [](const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                     const at::Tensor& lse_b) {
    return ops::merge_attention_states_on(nullptr, out_a, lse_a, out_b, lse_b);
  });
}
