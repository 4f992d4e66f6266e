// CUDA backend of the paged KV-cache ops. The index tensors stay on the device and the
// kernels guard every index they read (cuda/kernels/paged.cu), so a call never waits for
// the GPU. MHA_EXT_CHECK_INDICES=1 copies the indices to the host first and raises the CPU
// backend's errors for bad values, before anything is written (a debugging aid: it syncs).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "attention_checks.h"
#include "cuda/kernels/launchers.h"
#include "paged_checks.h"

namespace mha_ext::cuda {
namespace {

bool check_indices_on_host() {
  const char* setting = std::getenv("MHA_EXT_CHECK_INDICES");
  return setting != nullptr && std::strcmp(setting, "1") == 0;
}

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, "CUDA kernel launch failed: ", cudaGetErrorString(status));
}

void paged_kv_append_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const PagedAppendParams params = make_append_params(key, value, k_cache, v_cache, slot_mapping);
  const c10::cuda::CUDAGuard device_guard(k_cache.device());
  if (check_indices_on_host()) {
    const at::Tensor host_slots = slot_mapping.cpu();
    PagedAppendParams host_params = params;
    host_params.slot_mapping = host_slots.data_ptr<int64_t>();
    check_slot_values(host_params);
  }
  check_launch(launch_paged_kv_append(params, c10::cuda::getCurrentCUDAStream()), "mha_ext.paged_kv_append: ");
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache,
                                                        const at::Tensor& block_tables,
                                                        const at::Tensor& seq_lens,
                                                        const at::Tensor& cu_seqlens_q, double scale) {
  PagedAttentionParams params =
      make_paged_attention_params(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale);
  const c10::cuda::CUDAGuard device_guard(q.device());
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

  const at::ScalarType acc_dtype = accumulate_dtype(q.scalar_type());
  at::Tensor out = at::empty({params.total_q, params.num_heads, params.head_dim_v}, q.options());
  at::Tensor lse = at::empty({params.total_q, params.num_heads}, q.options().dtype(acc_dtype));
  params.out = out.data_ptr();
  params.out_strides = {out.stride(0), out.stride(1)};
  params.lse = lse.data_ptr();
  // (ATen/cuda/CUDAContext.h would need cuSPARSE headers that a bare toolkit lacks.)
  int num_sms = 0;
  check_launch(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.device().index()),
               "mha_ext.paged_attention: ");
  params.num_kv_splits = paged_attention_splits(params, num_sms);
  at::Tensor partial_out, partial_lse;
  if (params.num_kv_splits > 1) {
    partial_out = at::empty({params.num_kv_splits, params.total_q, params.num_heads, params.head_dim_v},
                            q.options().dtype(acc_dtype));
    partial_lse = at::empty({params.num_kv_splits, params.total_q, params.num_heads}, q.options().dtype(acc_dtype));
    params.partial_out = partial_out.data_ptr();
    params.partial_lse = partial_lse.data_ptr();
  }
  check_launch(launch_paged_attention(params, num_sms, c10::cuda::getCurrentCUDAStream()),
               "mha_ext.paged_attention: ");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                               const at::Tensor& out_b, const at::Tensor& lse_b) {
  MergeStatesParams params = make_merge_params(out_a, lse_a, out_b, lse_b);
  const c10::cuda::CUDAGuard device_guard(out_a.device());
  // Flatten the leading dims to rows; a layout that does not flatten is copied (O(rows)).
  const at::Tensor rows_a = out_a.reshape({params.rows, params.head_dim});
  const at::Tensor rows_b = out_b.reshape({params.rows, params.head_dim});
  const at::Tensor lse_a_rows = lse_a.contiguous();
  const at::Tensor lse_b_rows = lse_b.contiguous();
  at::Tensor out = at::empty(out_a.sizes(), out_a.options());
  at::Tensor lse = at::empty(lse_a.sizes(), lse_a.options());
  params.out_a = rows_a.data_ptr();
  params.out_b = rows_b.data_ptr();
  params.out_a_stride = params.rows > 1 ? rows_a.stride(0) : params.head_dim;
  params.out_b_stride = params.rows > 1 ? rows_b.stride(0) : params.head_dim;
  params.lse_a = lse_a_rows.data_ptr();
  params.lse_b = lse_b_rows.data_ptr();
  params.out = out.data_ptr();
  params.out_stride = params.head_dim;
  params.lse = lse.data_ptr();
  check_launch(launch_merge_attention_states(params, c10::cuda::getCurrentCUDAStream()),
               "mha_ext.merge_attention_states: ");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("paged_kv_append", &paged_kv_append_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("merge_attention_states", &merge_attention_states_cuda);
}

}  // namespace mha_ext::cuda
