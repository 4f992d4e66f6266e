#include "cuda/backend.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include "cuda/kernels/launchers.h"
#include "mha_ext/sequences.h"
#include "ops/tensor_checks.h"

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

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, "CUDA kernel launch failed: ", cudaGetErrorString(status));
}

constexpr const char* kAttention = "mha_ext.attention: ";

// seed: device int64, or nullptr without dropout.
const int64_t* device_seed(const AttentionForwardParams& params) {
  return params.dropout.enabled ? params.dropout.seed_address : nullptr;
}

}  // namespace

Backend::NoPlan Backend::plan(AttentionForwardParams&, const at::Tensor&) { return {}; }

void Backend::run(const AttentionForwardParams& params, NoPlan) {
  check_launch(
      launch_attention_forward(params, device_seed(params), kernel_choice(), current_stream()),
      kAttention);
}

Backend::AttentionBackwardPlan Backend::plan(AttentionBackwardParams& params,
                                             const at::Tensor& like) {
  AttentionBackwardPlan plan;
  params.num_kv_splits = 1;
  // A deterministic backward writes dQ from a pass of its own and needs no partial sums.
  if (params.deterministic) return plan;
  params.grad_q_accum_split_stride = lse_elements(params) * params.head_dim;
  plan.grad_q_accum =
      at::zeros({params.num_kv_splits, params.grad_q_accum_split_stride}, accumulate_options(like));
  params.grad_q_accum = plan.grad_q_accum.data_ptr();
  return plan;
}

void Backend::run(const AttentionBackwardParams& params, const AttentionBackwardPlan&) {
  check_launch(
      launch_attention_backward(params, device_seed(params), kernel_choice(), current_stream()),
      kAttention);
}

void Backend::run(const DropoutMaskParams& p) {
  check_launch(launch_dropout_mask(p.keep, p.dropout.seed_address, p.dropout, p.batch, p.num_heads,
                                   p.seq_q, p.seq_k, current_stream()),
               "mha_ext.dropout_mask: ");
}

Backend::NoPlan Backend::plan(PagedAppendParams&, const at::Tensor&) { return {}; }

void Backend::run(const PagedAppendParams& params, NoPlan) {
  TORCH_CHECK(params.format == CacheFormat::kPlain,
              "mha_ext.paged_kv_append: 8-bit caches are not yet supported on CUDA");
  check_launch(launch_paged_kv_append(params, current_stream()), "mha_ext.paged_kv_append: ");
}

Backend::NoPlan Backend::plan(PagedAttentionParams& params, const at::Tensor&) {
  params.num_kv_splits = paged_attention_splits(params, multiprocessor_count());
  return {};
}

void Backend::run(const PagedAttentionParams& params, NoPlan) {
  TORCH_CHECK(params.format == CacheFormat::kPlain,
              "mha_ext.paged_attention: 8-bit caches are not yet supported on CUDA");
  check_launch(launch_paged_attention(params, multiprocessor_count(), current_stream()),
               "mha_ext.paged_attention: ");
}

Backend::NoPlan Backend::plan(MergeStatesParams&, const at::Tensor&) { return {}; }

void Backend::run(const MergeStatesParams& params, NoPlan) {
  check_launch(launch_merge_attention_states(params, current_stream()),
               "mha_ext.merge_attention_states: ");
}

}  // namespace mha_ext::cuda
