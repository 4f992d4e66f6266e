// CPU backend of the attention ops: validate -> fill params -> run the kernel build that
// suits this CPU (cpu/isa.h, via MHA_EXT_RUN_CPU_KERNEL).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <array>

#include "attention_checks.h"
#include "cpu/kernels/kernels.h"
#include "mha_ext/philox.h"

namespace mha_ext::cpu {
namespace {

// The ops' workspaces, by the buffer each calling thread keeps for them.
enum class Workspace : int { kKvPairs, kGradQAccum, kTransposed, kCount };

// A workspace tensor in the buffer the calling thread keeps for `slot`, grown when too small.
// Memory touched for the first time is slow on these machines (a page fault per 4 KiB,
// every call: torch frees CPU memory at once), and training and generation call the ops with
// the same shapes step after step. Over kMaxKeptBytes a workspace is allocated per
// call instead, so that one very long sequence does not pin its memory. The tensor borrows
// the buffer: it must not outlive the op call (none of the op's outputs is a workspace).
at::Tensor kept_workspace(Workspace slot, at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr int64_t kMaxKeptBytes = int64_t(1) << 30;
  thread_local std::array<at::Tensor, static_cast<int>(Workspace::kCount)> buffers;  // bytes
  const int64_t bytes = c10::multiply_integers(shape) * static_cast<int64_t>(options.dtype().itemsize());
  if (bytes > kMaxKeptBytes) return at::empty(shape, options);
  at::Tensor& buffer = buffers[static_cast<int>(slot)];
  if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, options.dtype(at::kByte));
  return at::from_blob(buffer.data_ptr(), shape, options);
}

// The dQ workspace, uncleared: the kernels clear what they do not overwrite.
at::Tensor grad_q_workspace(at::IntArrayRef shape, const at::TensorOptions& options) {
  return kept_workspace(Workspace::kGradQAccum, shape, options);
}

uint64_t read_seed(const std::optional<at::Tensor>& dropout_seed) {
  return dropout_seed.has_value() ? static_cast<uint64_t>(dropout_seed->item<int64_t>()) : 0;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right,
    bool bottom_right) {
  AttentionForwardParams params = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  auto [out, lse] = prepare_forward_outputs(params, q);
  at::Tensor kv_pairs;  // read only by the bf16 kernel
  if (q.scalar_type() == at::kBFloat16) {
    kv_pairs = kept_workspace(Workspace::kKvPairs, {kv_pairs_size(params)}, q.options());
    params.kv_pairs = kv_pairs.data_ptr();
  }
  params.dropout.seed = read_seed(dropout_seed);
  MHA_EXT_RUN_CPU_KERNEL(attention_forward, params);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right,
    bool bottom_right) {
  AttentionBackwardParams params;
  static_cast<AttentionForwardParams&>(params) = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  check_backward_args(params, grad_out, out, lse, grad_lse, q);
  // Split the key range across threads only when batch x kv_heads leaves threads idle:
  // each split then sums its own dQ partials, added up at the end.
  const int64_t kv_tasks = std::max<int64_t>(params.batch * params.num_kv_heads, 1);
  const int64_t key_blocks = std::max<int64_t>((params.seq_k + kKeyBlock - 1) / kKeyBlock, 1);
  const int64_t splits = std::min(key_blocks, (at::get_num_threads() + kv_tasks - 1) / kv_tasks);
  const BackwardTensors tensors =
      prepare_backward(params, grad_out, grad_lse, q, k, v, out, lse, splits, grad_q_workspace);
  at::Tensor transposed;  // q_grad_out_transposed, read only by the bf16 kernel
  if (q.scalar_type() == at::kBFloat16) {
    transposed = kept_workspace(Workspace::kTransposed, {q_grad_out_transposed_size(params)}, q.options());
    params.q_grad_out_transposed = transposed.data_ptr();
  }
  params.dropout.seed = read_seed(dropout_seed);
  MHA_EXT_RUN_CPU_KERNEL(attention_backward, params);
  return {tensors.grad_q, tensors.grad_k, tensors.grad_v};
}

at::Tensor dropout_mask_cpu(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                            int64_t seq_q, int64_t seq_k, double dropout_p) {
  check_dropout_mask_args(dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p);
  at::Tensor mask = at::empty({batch, num_heads, seq_q, seq_k}, dropout_seed.options().dtype(at::kBool));
  DropoutParams dropout = make_dropout_params(dropout_p);
  dropout.seed = static_cast<uint64_t>(dropout_seed.item<int64_t>());
  bool* keep = mask.data_ptr<bool>();
  at::parallel_for(0, batch * num_heads * seq_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (num_heads * seq_q), h = row / seq_q % num_heads, i = row % seq_q;
      for (int64_t j = 0; j < seq_k; ++j) keep[row * seq_k + j] = dropout_keeps(dropout, b, h, i, j);
    }
  });
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
  m.impl("dropout_mask", &dropout_mask_cpu);
}

}  // namespace mha_ext::cpu
