#pragma once
// The CPU backend of every op (see ops/attention.h for the plan/run contract): plans decide
// the task split and take workspaces from buffers each calling thread keeps; runs call the
// kernel build of the active ISA (cpu/isa.h).
#include <ATen/core/Tensor.h>

#include "cpu/kernels/blocking.h"
#include "mha_ext/attention_params.h"
#include "mha_ext/paged_params.h"

namespace mha_ext::cpu {

// Threads a deterministic backward plans its key splits for, whatever the thread count.
constexpr int64_t kDeterministicThreads = 8;

struct Backend {
  // The ops check index values on the host before the kernels trust them.
  static constexpr bool kIndicesOnHost = true;

  // Plans own what only the CPU kernels read (the shared params hold the rest). Their
  // workspaces are borrowed from the calling thread's buffers: valid until that thread's
  // next op call, so a plan must not outlive its op.
  // A packed (varlen) call runs its sequences one after another, each as a dense call of
  // batch 1 (sequence_params) whose tasks spread over the threads; the workspaces are sized
  // for the longest sequence.
  struct AttentionForwardPlan {
    at::Tensor kv_pairs;  // the bf16 kernel's packed K/V tiles; undefined for other dtypes
    AttentionWorkspaces workspaces;
  };
  struct AttentionBackwardPlan {
    at::Tensor grad_q_accum;           // [num_kv_splits, lse's elements, head_dim]
    at::Tensor q_grad_out_transposed;  // the bf16 kernel's Q^T, dO^T; undefined otherwise
    AttentionWorkspaces workspaces;
  };
  struct NoPlan {};

  static AttentionForwardPlan plan(AttentionForwardParams& params, const at::Tensor& like);
  static void run(const AttentionForwardParams& params, const AttentionForwardPlan& plan);

  // Splits the key range across threads only when batch x kv_heads leaves threads idle: each
  // split then sums its own dQ partials, added up at the end. A deterministic call splits as
  // if the CPU had kDeterministicThreads threads, so that its sums do not depend on the
  // thread count.
  static AttentionBackwardPlan plan(AttentionBackwardParams& params, const at::Tensor& like);
  static void run(const AttentionBackwardParams& params, const AttentionBackwardPlan& plan);

  static void run(const DropoutMaskParams& params);

  // Index values have been checked on the host: the kernel trusts them.
  static NoPlan plan(PagedAppendParams& params, const at::Tensor& like);
  static void run(const PagedAppendParams& params, NoPlan);

  // plan_paged_tasks for this process's thread count: kv heads per task and key splits.
  static PagedTaskPlan plan(PagedAttentionParams& params, const at::Tensor& like);
  static void run(const PagedAttentionParams& params, const PagedTaskPlan& plan);

  static NoPlan plan(MergeStatesParams& params, const at::Tensor& like);
  static void run(const MergeStatesParams& params, NoPlan);
};

}  // namespace mha_ext::cpu
