#include "cpu/backend.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include "cpu/parallel.h"

#include <array>

#include "cpu/kernels/kernels.h"
#include "mha_ext/philox.h"
#include "mha_ext/sequences.h"
#include "ops/tensor_checks.h"

namespace mha_ext::cpu {
namespace {

// The ops' workspaces, by the buffer each calling thread keeps for them.
enum class Workspace : int { kKvPairs, kGradQAccum, kTransposed, kCount };

// A workspace tensor in the buffer the calling thread keeps for `slot`, grown when too small.
// Memory touched for the first time is slow on these machines (a page fault per 4 KiB,
// every call: torch frees CPU memory at once), and training and generation call the ops with
// the same shapes step after step. Over kMaxKeptBytes a workspace is allocated per call
// instead, so that one very long sequence does not pin its memory. The tensor borrows the
// buffer: it must not outlive the op call (none of the op's outputs is a workspace).
at::Tensor kept_workspace(Workspace slot, at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr int64_t kMaxKeptBytes = int64_t(1) << 30;
  thread_local std::array<at::Tensor, static_cast<int>(Workspace::kCount)> buffers;  // bytes
  const int64_t bytes =
      c10::multiply_integers(shape) * static_cast<int64_t>(options.dtype().itemsize());
  if (bytes > kMaxKeptBytes) return at::empty(shape, options);
  at::Tensor& buffer = buffers[static_cast<int>(slot)];
  if (!buffer.defined() || buffer.numel() < bytes) {
    buffer = at::empty({bytes}, options.dtype(at::kByte));
  }
  return at::from_blob(buffer.data_ptr(), shape, options);
}

}  // namespace

// The dense shape whose workspaces fit every kernel run of the call: the call itself, or
// for a packed call its longest sequence as batch 1.
AttentionForwardParams workspace_shape(const AttentionForwardParams& params) {
  AttentionForwardParams shape = params;
  if (params.varlen.cu_seqlens_q != nullptr) shape.batch = 1;
  return shape;
}

// Runs the kernel on the call, or on each sequence of a packed call.
template <typename Params, typename Kernel>
void run_sequences(const Params& params, const Kernel& kernel) {
  if (params.varlen.cu_seqlens_q == nullptr) return kernel(params);
  for (int64_t sequence = 0; sequence < params.batch; ++sequence) {
    kernel(sequence_params(params, sequence));
  }
}

Backend::AttentionForwardPlan Backend::plan(AttentionForwardParams& params,
                                            const at::Tensor& like) {
  AttentionForwardPlan plan;
  if (params.dtype == DType::kBFloat16) {
    plan.kv_pairs = kept_workspace(Workspace::kKvPairs, {kv_pairs_size(workspace_shape(params))},
                                   like.options());
    plan.workspaces.kv_pairs = plan.kv_pairs.data_ptr();
  }
  return plan;
}

void Backend::run(const AttentionForwardParams& params, const AttentionForwardPlan& plan) {
  run_sequences(params, [&](const AttentionForwardParams& one) {
    MHA_EXT_RUN_CPU_KERNEL(attention_forward, one, plan.workspaces);
  });
}

Backend::AttentionBackwardPlan Backend::plan(AttentionBackwardParams& params,
                                             const at::Tensor& like) {
  const AttentionForwardParams shape = workspace_shape(params);
  const int64_t kv_tasks = std::max<int64_t>(shape.batch * shape.num_kv_heads, 1);
  const int64_t key_blocks = std::max<int64_t>((shape.seq_k + kKeyBlock - 1) / kKeyBlock, 1);
  const int64_t threads = params.deterministic ? kDeterministicThreads : at::get_num_threads();
  params.num_kv_splits = std::min(key_blocks, (threads + kv_tasks - 1) / kv_tasks);
  AttentionBackwardPlan plan;
  // Uncleared: the kernels write each element before they add to it.
  params.grad_q_accum_split_stride = lse_elements(params) * params.head_dim;
  plan.grad_q_accum = kept_workspace(Workspace::kGradQAccum,
                                     {params.num_kv_splits, params.grad_q_accum_split_stride},
                                     accumulate_options(like));
  params.grad_q_accum = plan.grad_q_accum.data_ptr();
  if (params.dtype == DType::kBFloat16) {
    plan.q_grad_out_transposed =
        kept_workspace(Workspace::kTransposed, {q_grad_out_transposed_size(shape)}, like.options());
    plan.workspaces.q_grad_out_transposed = plan.q_grad_out_transposed.data_ptr();
  }
  return plan;
}

void Backend::run(const AttentionBackwardParams& params, const AttentionBackwardPlan& plan) {
  run_sequences(params, [&](const AttentionBackwardParams& one) {
    MHA_EXT_RUN_CPU_KERNEL(attention_backward, one, plan.workspaces);
  });
}

void Backend::run(const DropoutMaskParams& p) {
  const int64_t rows = p.batch * p.num_heads * p.seq_q;
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (p.num_heads * p.seq_q), h = row / p.seq_q % p.num_heads;
      const int64_t i = row % p.seq_q;
      for (int64_t j = 0; j < p.seq_k; ++j) {
        p.keep[row * p.seq_k + j] = dropout_keeps(p.dropout, b, h, i, j);
      }
    }
  });
}

Backend::NoPlan Backend::plan(PagedAppendParams&, const at::Tensor&) { return {}; }

// The slots were validated before any row is written (paged_kv_append's contract).
void Backend::run(const PagedAppendParams& params, NoPlan) {
  MHA_EXT_RUN_CPU_KERNEL(paged_kv_append, params);
}

PagedTaskPlan Backend::plan(PagedAttentionParams& params, const at::Tensor&) {
  const PagedTaskPlan tasks = plan_paged_tasks(params, at::get_num_threads());
  params.num_kv_splits = tasks.kv_splits;
  return tasks;
}

void Backend::run(const PagedAttentionParams& params, const PagedTaskPlan& plan) {
  MHA_EXT_RUN_CPU_KERNEL(paged_attention, params, plan);
}

Backend::NoPlan Backend::plan(MergeStatesParams&, const at::Tensor&) { return {}; }

void Backend::run(const MergeStatesParams& params, NoPlan) {
  MHA_EXT_RUN_CPU_KERNEL(merge_attention_states, params);
}

}  // namespace mha_ext::cpu
