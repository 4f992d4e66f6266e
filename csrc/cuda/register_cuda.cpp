// The CUDA registrations of every op: the device guard and the current stream around the op
// bodies in device_ops.cpp. The dropout seed and the paged indices stay on the device, so
// no call waits for the GPU and every op can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/device_ops.h"

namespace mha_ext::cuda {
namespace {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  return attention_forward_on(current_stream(), q, k, v, attn_mask, dropout_seed, dropout_p, scale,
                              window_left, window_right, bottom_right);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  return attention_backward_on(current_stream(), grad_out, grad_lse, q, k, v, out, lse, attn_mask,
                               dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
}

at::Tensor dropout_mask_cuda(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                             int64_t seq_q, int64_t seq_k, double dropout_p) {
  const c10::cuda::CUDAGuard device_guard(dropout_seed.device());
  return dropout_mask_on(current_stream(), dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p);
}

void paged_kv_append_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard device_guard(k_cache.device());
  paged_kv_append_on(current_stream(), key, value, k_cache, v_cache, slot_mapping);
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache,
                                                        const at::Tensor& block_tables,
                                                        const at::Tensor& seq_lens,
                                                        const at::Tensor& cu_seqlens_q, double scale) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  // (ATen/cuda/CUDAContext.h would need cuSPARSE headers that a bare toolkit lacks.)
  int num_sms = 0;
  const cudaError_t status = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.device().index());
  TORCH_CHECK(status == cudaSuccess, "mha_ext.paged_attention: cannot read the GPU's multiprocessor count: ",
              cudaGetErrorString(status));
  return paged_attention_on(current_stream(), num_sms, q, k_cache, v_cache, block_tables, seq_lens,
                            cu_seqlens_q, scale);
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                               const at::Tensor& out_b, const at::Tensor& lse_b) {
  const c10::cuda::CUDAGuard device_guard(out_a.device());
  return merge_attention_states_on(current_stream(), out_a, lse_a, out_b, lse_b);
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("dropout_mask", &dropout_mask_cuda);
  m.impl("paged_kv_append", &paged_kv_append_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("merge_attention_states", &merge_attention_states_cuda);
}

}  // namespace mha_ext::cuda
