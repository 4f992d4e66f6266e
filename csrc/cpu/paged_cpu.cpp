// CPU backend of the paged KV-cache ops: validate (index values included, before any write)
// -> fill params -> run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_checks.h"
#include "cpu/kernels/kernels.h"
#include "cpu/paged_cpu.h"
#include "mha_ext/paged_cache.h"

namespace mha_ext::cpu {

PagedAttentionOutputs prepare_paged_run(PagedAttentionParams& params, const at::Tensor& q) {
  const PagedTaskPlan plan = plan_paged_tasks(params, at::get_num_threads());
  params.kv_heads_per_task = plan.kv_heads_per_task;
  return prepare_paged_outputs(params, q, plan.kv_splits);
}

namespace {

void paged_kv_append_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const PagedAppendParams params = make_append_params(key, value, k_cache, v_cache, slot_mapping);
  check_slot_values(params);
  paged_kv_append(params);
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache,
                                                       const at::Tensor& block_tables,
                                                       const at::Tensor& seq_lens,
                                                       const at::Tensor& cu_seqlens_q, double scale) {
  PagedAttentionParams params =
      make_paged_attention_params(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale);
  check_paged_index_values(params);
  const PagedAttentionOutputs outputs = prepare_paged_run(params, q);
  MHA_EXT_RUN_CPU_KERNEL(paged_attention, params);
  return {outputs.out, outputs.lse};
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& out_a,
                                                              const at::Tensor& lse_a,
                                                              const at::Tensor& out_b,
                                                              const at::Tensor& lse_b) {
  const MergeStatesCall call = prepare_merge_states(out_a, lse_a, out_b, lse_b);
  MHA_EXT_RUN_CPU_KERNEL(merge_attention_states, call.params);
  return {call.out, call.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("paged_kv_append", &paged_kv_append_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("merge_attention_states", &merge_attention_states_cpu);
}

}  // namespace mha_ext::cpu
