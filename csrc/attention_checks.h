#pragma once
// Argument validation and params filling for the attention ops, shared by the CPU and CUDA
// backends so both reject the same inputs with the same messages. Every message names the
// argument and shows the values.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "mha_ext/attention_params.h"

namespace mha_ext {

// Largest head_dim (q/k) and head_dim_v (v) the kernels accept.
constexpr int64_t kMaxHeadDim = 256;

// "torch.float32", as a user writes the dtype.
std::string dtype_name(at::ScalarType dtype);

// The kernels' dtype for a tensor's dtype; an unsupported one is an error naming op and the
// argument.
DType to_dtype(at::ScalarType dtype, const char* op, const char* name);

// fp32 for every input dtype except fp64, which accumulates in fp64: the dtype of the
// logsumexp output and of the kernels' workspaces.
at::ScalarType accumulate_dtype(at::ScalarType dtype);

// Strides of dims 0..2 of a 4-D tensor whose last dim is contiguous.
RowStrides row_strides(const at::Tensor& t);

// Validates q, k, v, the mask and the dropout/window settings of one attention call and
// fills everything in the params except out/lse pointers and the dropout seed, which the
// backend reads from dropout_seed in the way its device allows.
AttentionForwardParams make_attention_params(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v,
                                             const std::optional<at::Tensor>& attn_mask,
                                             const std::optional<at::Tensor>& dropout_seed,
                                             double dropout_p, double scale,
                                             int64_t window_left, int64_t window_right,
                                             bool bottom_right);

// The attention output for q, [batch, heads, seq_q, head_dim_v], in q's memory order:
// (B, S, H, D) storage when q is a transposed (B, S, H, D) view, else (B, H, S, D). The
// register_fake in mha_ext/ops.py mirrors this rule.
at::Tensor empty_attention_output(const at::Tensor& q, int64_t head_dim_v);

// Allocates the forward's outputs – out as empty_attention_output gives it, lse
// [batch, heads, seq_q] in the accumulation type – and points the params at them.
std::tuple<at::Tensor, at::Tensor> prepare_forward_outputs(AttentionForwardParams& params,
                                                           const at::Tensor& q);

// Points the params at the forward's outputs: out [batch, heads, seq_q, head_dim_v] (any
// strides, last dim contiguous) and lse [batch, heads, seq_q] contiguous. The backward reads
// them through the same fields.
void set_forward_outputs(AttentionForwardParams& params, const at::Tensor& out, const at::Tensor& lse);

// The backward's outputs and workspaces: grad_q/k/v shaped and strided like q/k/v, the dQ
// partial sums [num_kv_splits, batch, heads, seq_q, head_dim] and delta [batch, heads,
// seq_q] in the accumulation type, and lse / grad_lse as contiguous rows (the kernels index
// them directly; they are O(seq), so a copy is cheap).
struct BackwardTensors {
  at::Tensor grad_q, grad_k, grad_v;
  at::Tensor grad_q_accum, delta;
  at::Tensor lse_rows;
  std::optional<at::Tensor> grad_lse_rows;
};

// Makes the dQ workspace, which only lives during the op call: the backend decides where
// its memory comes from and whether it starts zero-filled (the CUDA kernel adds into it; the
// CPU kernels write each element before they add to it).
using WorkspaceFn = at::Tensor (*)(at::IntArrayRef shape, const at::TensorOptions& options);

// A WorkspaceFn that allocates fresh zeros for every call (at::zeros).
at::Tensor zeros_per_call(at::IntArrayRef shape, const at::TensorOptions& options);

// Allocates the backward's tensors (the dQ partial sums through make_workspace) and points
// params at them and at grad_out, out and lse; params come from make_attention_params and
// passed check_backward_args.
BackwardTensors prepare_backward(AttentionBackwardParams& params, const at::Tensor& grad_out,
                                 const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, int64_t num_kv_splits, WorkspaceFn make_workspace);

// Checks the tensors only the backward takes against the forward's params.
void check_backward_args(const AttentionForwardParams& params, const at::Tensor& grad_out,
                         const at::Tensor& out, const at::Tensor& lse,
                         const std::optional<at::Tensor>& grad_lse, const at::Tensor& q);

// Validates dropout_mask's arguments (the same seed/probability rules as attention).
void check_dropout_mask_args(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                             int64_t seq_q, int64_t seq_k, double dropout_p);

// The dropout part of the params, without the seed.
DropoutParams make_dropout_params(double dropout_p);

}  // namespace mha_ext
