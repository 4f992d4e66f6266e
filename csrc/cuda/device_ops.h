#pragma once
// The bodies of the CUDA ops: validate (the checks the CPU backend uses), allocate like the
// inputs, launch on `stream`. They use ATen and the torch-free launchers only, no c10/cuda,
// so the CPU emulation of the kernels (tests/emulation) runs exactly this code; the CUDA
// registrations (register_cuda.cpp) add the device guard and the current stream.
#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <optional>
#include <tuple>

namespace mha_ext::cuda {

std::tuple<at::Tensor, at::Tensor> attention_forward_on(
    cudaStream_t stream, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right);

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_on(
    cudaStream_t stream, const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& dropout_seed, double dropout_p, double scale,
    int64_t window_left, int64_t window_right, bool bottom_right);

at::Tensor dropout_mask_on(cudaStream_t stream, const at::Tensor& dropout_seed, int64_t batch,
                           int64_t num_heads, int64_t seq_q, int64_t seq_k, double dropout_p);

void paged_kv_append_on(cudaStream_t stream, const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping);

// num_sms: the GPU's multiprocessor count, which sizes the split-K plan.
std::tuple<at::Tensor, at::Tensor> paged_attention_on(cudaStream_t stream, int num_sms,
                                                      const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache,
                                                      const at::Tensor& block_tables,
                                                      const at::Tensor& seq_lens,
                                                      const at::Tensor& cu_seqlens_q, double scale);

std::tuple<at::Tensor, at::Tensor> merge_attention_states_on(cudaStream_t stream,
                                                             const at::Tensor& out_a,
                                                             const at::Tensor& lse_a,
                                                             const at::Tensor& out_b,
                                                             const at::Tensor& lse_b);

}  // namespace mha_ext::cuda
