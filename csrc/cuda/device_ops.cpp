#include "cuda/device_ops.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#include "attention_checks.h"
#include "cuda/kernels/launchers.h"
#include "paged_checks.h"

namespace mha_ext::cuda {
namespace {

// MHA_EXT_CUDA_KERNELS=simt runs the generic kernels for every call, so the tests can check
// both kernel families on one GPU; unset or "auto" lets each call take the fastest.
KernelChoice kernel_choice() {
  const char* setting = std::getenv("MHA_EXT_CUDA_KERNELS");
  KernelChoice choice;
  if (setting == nullptr || std::strcmp(setting, "auto") == 0) return choice;
  TORCH_CHECK(std::strcmp(setting, "simt") == 0, "MHA_EXT_CUDA_KERNELS must be auto or simt, got '",
              setting, "'");
  choice.allow_tensor_cores = false;
  return choice;
}

// MHA_EXT_CHECK_INDICES=1: copy the paged ops' indices to the host and raise the CPU
// backend's errors for bad values before anything is written (a debugging aid: it syncs).
bool check_indices_on_host() {
  const char* setting = std::getenv("MHA_EXT_CHECK_INDICES");
  return setting != nullptr && std::strcmp(setting, "1") == 0;
}

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, "CUDA kernel launch failed: ", cudaGetErrorString(status));
}

constexpr const char* kAttention = "mha_ext.attention: ";

const int64_t* device_seed(const AttentionForwardParams& params,
                           const std::optional<at::Tensor>& dropout_seed) {
  return params.dropout.enabled ? dropout_seed->data_ptr<int64_t>() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward_on(
    cudaStream_t stream, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  AttentionForwardParams params = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  auto [out, lse] = prepare_forward_outputs(params, q);
  check_launch(launch_attention_forward(params, device_seed(params, dropout_seed), kernel_choice(), stream),
               kAttention);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_on(
    cudaStream_t stream, const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& dropout_seed, double dropout_p, double scale,
    int64_t window_left, int64_t window_right, bool bottom_right) {
  AttentionBackwardParams params;
  static_cast<AttentionForwardParams&>(params) = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  check_backward_args(params, grad_out, out, lse, grad_lse, q);
  // One dQ workspace: the key blocks add their parts with atomics.
  const BackwardTensors tensors =
      prepare_backward(params, grad_out, grad_lse, q, k, v, out, lse, 1, zeros_per_call);
  check_launch(launch_attention_backward(params, device_seed(params, dropout_seed), kernel_choice(), stream),
               kAttention);
  return {tensors.grad_q, tensors.grad_k, tensors.grad_v};
}

at::Tensor dropout_mask_on(cudaStream_t stream, const at::Tensor& dropout_seed, int64_t batch,
                           int64_t num_heads, int64_t seq_q, int64_t seq_k, double dropout_p) {
  check_dropout_mask_args(dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p);
  at::Tensor mask = at::empty({batch, num_heads, seq_q, seq_k}, dropout_seed.options().dtype(at::kBool));
  check_launch(launch_dropout_mask(mask.data_ptr<bool>(), dropout_seed.data_ptr<int64_t>(),
                                   make_dropout_params(dropout_p), batch, num_heads, seq_q, seq_k, stream),
               "mha_ext.dropout_mask: ");
  return mask;
}

void paged_kv_append_on(cudaStream_t stream, const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const PagedAppendParams params = make_append_params(key, value, k_cache, v_cache, slot_mapping);
  if (check_indices_on_host()) {
    const at::Tensor host_slots = slot_mapping.cpu();
    PagedAppendParams host_params = params;
    host_params.slot_mapping = host_slots.data_ptr<int64_t>();
    check_slot_values(host_params);
  }
  check_launch(launch_paged_kv_append(params, stream), "mha_ext.paged_kv_append: ");
}

std::tuple<at::Tensor, at::Tensor> paged_attention_on(cudaStream_t stream, int num_sms,
                                                      const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache,
                                                      const at::Tensor& block_tables,
                                                      const at::Tensor& seq_lens,
                                                      const at::Tensor& cu_seqlens_q, double scale) {
  PagedAttentionParams params =
      make_paged_attention_params(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale);
  if (check_indices_on_host()) {
    const at::Tensor host_tables = block_tables.contiguous().cpu();
    const at::Tensor host_lens = seq_lens.cpu();
    const at::Tensor host_cu = cu_seqlens_q.cpu();
    PagedAttentionParams host_params = params;
    host_params.block_tables = host_tables.data_ptr<int32_t>();
    host_params.block_table_stride = host_tables.size(1);
    host_params.seq_lens = host_lens.data_ptr<int32_t>();
    host_params.cu_seqlens_q = host_cu.data_ptr<int32_t>();
    check_paged_index_values(host_params);
  }
  // Bounds the host knows without reading the device: a sequence has at most all the
  // queries and at most what its block-table row holds.
  params.max_queries_per_seq = params.total_q;
  params.max_seq_len = params.max_blocks_per_seq * params.block_size;

  const PagedAttentionOutputs outputs = prepare_paged_outputs(params, q, paged_attention_splits(params, num_sms));
  check_launch(launch_paged_attention(params, num_sms, stream), "mha_ext.paged_attention: ");
  return {outputs.out, outputs.lse};
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_on(cudaStream_t stream,
                                                             const at::Tensor& out_a,
                                                             const at::Tensor& lse_a,
                                                             const at::Tensor& out_b,
                                                             const at::Tensor& lse_b) {
  const MergeStatesCall call = prepare_merge_states(out_a, lse_a, out_b, lse_b);
  check_launch(launch_merge_attention_states(call.params, stream), "mha_ext.merge_attention_states: ");
  return {call.out, call.lse};
}

}  // namespace mha_ext::cuda
