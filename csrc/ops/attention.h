#pragma once
// The attention ops, written once for every backend: attention_forward, attention_backward
// and dropout_mask. Their contracts are the schemas in csrc/ops.cpp; ops/attention.cpp
// registers them for CPU, CUDA and autograd. Each op validates its arguments, fills the params
// struct in one function (make_*_call), then lets the backend plan and run:
//
//   Backend::plan(params, like)  task split and workspaces (grad_q_accum, the CPU's packed
//                                tiles); `like` is a tensor whose options the workspaces take
//   Backend::run(params, plan)   the kernels, on the backend's stream
//
// The op functions' C++ signatures are the only spelling of the arguments besides the
// schemas: typed dispatcher handles, the direct Python entry points and the autograd kernel
// derive from them (ops/op_signature.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "mha_ext/attention_params.h"
#include "mha_ext/philox.h"
#include "ops/op_signature.h"
#include "ops/tensor_checks.h"

namespace mha_ext {

namespace attention_detail {

constexpr const char* kOp = "mha_ext.attention: ";
constexpr const char* kDropoutMaskOp = "mha_ext.dropout_mask: ";

inline void check_4d(const at::Tensor& t, const char* name) {
  check_rank(kOp, t, name, 4, "(batch, heads, seq, head_dim)");
}

inline void check_dropout_p(const char* op, double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, "dropout_p must be in [0, 1), got ",
              dropout_p);
}

inline void check_seed_tensor(const char* op, const at::Tensor& dropout_seed) {
  TORCH_CHECK(dropout_seed.scalar_type() == at::kLong && dropout_seed.numel() == 1, op,
              "dropout_seed must be a one-element torch.int64 tensor, got ",
              dtype_name(dropout_seed.scalar_type()), " with shape ", dropout_seed.sizes());
}

// The dropout part of the params, seeded by `seed` (nullptr without dropout). The seed's
// address is where the tensor lives (a CUDA kernel reads it there, so no call waits for the
// GPU); a host seed is also read now.
inline DropoutParams make_dropout_params(double dropout_p, const at::Tensor* seed) {
  DropoutParams dropout;
  dropout.enabled = dropout_p > 0.0;
  dropout.drop_threshold = dropout_threshold(dropout_p);
  dropout.keep_scale = 1.0 / (1.0 - dropout_p);
  if (seed != nullptr) {
    dropout.seed_address = seed->const_data_ptr<int64_t>();
    if (seed->is_cpu()) dropout.seed = static_cast<uint64_t>(*dropout.seed_address);
  }
  return dropout;
}

// attn_mask broadcast to [batch, heads, seq_q, seq_k] through zero strides, never copied.
inline AttnMaskParams make_mask_params(const at::Tensor& mask, const at::Tensor& q, int64_t seq_k) {
  const std::vector<int64_t> target = {q.size(0), q.size(1), q.size(2), seq_k};
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == q.scalar_type(), kOp,
              "attn_mask must be torch.bool or q's dtype ", dtype_name(q.scalar_type()), ", got ",
              dtype_name(mask.scalar_type()));
  TORCH_CHECK(mask.device() == q.device(), kOp, "attn_mask is on ", mask.device(), " but q is on ",
              q.device());
  bool broadcastable = mask.dim() <= 4;
  for (int64_t i = 1; broadcastable && i <= mask.dim(); ++i) {
    const int64_t size = mask.size(-i);
    broadcastable = size == 1 || size == target[4 - i];
  }
  TORCH_CHECK(broadcastable, kOp, "attn_mask of shape ", mask.sizes(),
              " does not broadcast to (batch, heads, seq_q, seq_k) = ", at::IntArrayRef(target));
  int64_t strides[4] = {0, 0, 0, 0};
  for (int64_t i = 1; i <= mask.dim(); ++i) {
    strides[4 - i] = mask.size(-i) == 1 ? 0 : mask.stride(-i);
  }
  AttnMaskParams params;
  params.kind = mask.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  params.data = mask.data_ptr();
  params.batch_stride = strides[0];
  params.head_stride = strides[1];
  params.row_stride = strides[2];
  params.col_stride = strides[3];
  return params;
}

}  // namespace attention_detail

// Validates q, k, v, the mask and the dropout/window settings of one attention call and
// fills every input field of the params (the outputs are the caller's).
inline AttentionForwardParams make_attention_params(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  using namespace attention_detail;
  check_4d(q, "q");
  check_4d(k, "k");
  check_4d(v, "v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kOp,
              "q, k and v must share one dtype, got q ", dtype_name(q.scalar_type()), ", k ",
              dtype_name(k.scalar_type()), ", v ", dtype_name(v.scalar_type()));
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), kOp,
              "q, k and v must be on one device, got q on ", q.device(), ", k on ", k.device(),
              ", v on ", v.device());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), kOp,
              "q, k and v must share the batch size, got q ", q.size(0), ", k ", k.size(0), ", v ",
              v.size(0));
  TORCH_CHECK(k.size(1) == v.size(1), kOp, "k has ", k.size(1), " heads but v has ", v.size(1));
  TORCH_CHECK(k.size(2) == v.size(2), kOp, "k has ", k.size(2), " keys but v has ", v.size(2),
              " values");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, kOp, "k has ", k.size(1),
              " heads, which does not divide q's ", q.size(1), " heads");
  TORCH_CHECK(q.size(3) == k.size(3), kOp, "q has head_dim ", q.size(3), " but k has ", k.size(3));
  TORCH_CHECK(q.size(3) <= kMaxHeadDim && v.size(3) <= kMaxHeadDim, kOp, "head_dim ", q.size(3),
              " (q, k) and ", v.size(3), " (v) must not exceed ", kMaxHeadDim);
  TORCH_CHECK(std::isfinite(scale), kOp, "scale must be finite, got ", scale);
  TORCH_CHECK(window_left >= -1 && window_right >= -1, kOp,
              "window sides must be -1 (unbounded) or >= 0, got window_left ", window_left,
              ", window_right ", window_right);
  check_dropout_p(kOp, dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(dropout_seed.has_value(), kOp, "dropout_p is ", dropout_p,
                " but no dropout_seed was given");
    check_seed_tensor(kOp, *dropout_seed);
    TORCH_CHECK(dropout_seed->device() == q.device(), kOp, "dropout_seed is on ",
                dropout_seed->device(), " but q is on ", q.device());
  }

  AttentionForwardParams p;
  p.dtype = to_dtype(q.scalar_type(), kOp, "q");
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.batch = q.size(0);
  p.num_heads = q.size(1);
  p.num_kv_heads = k.size(1);
  p.seq_q = q.size(2);
  p.seq_k = k.size(2);
  p.head_dim = q.size(3);
  p.head_dim_v = v.size(3);
  p.q_strides = row_strides(q);
  p.k_strides = row_strides(k);
  p.v_strides = row_strides(v);
  p.scale = scale;
  p.window.window_left = window_left;
  p.window.window_right = window_right;
  p.window.diagonal_offset = bottom_right ? p.seq_k - p.seq_q : 0;
  if (attn_mask.has_value()) p.mask = make_mask_params(*attn_mask, q, p.seq_k);
  p.dropout = make_dropout_params(dropout_p, dropout_p > 0.0 ? &*dropout_seed : nullptr);
  return p;
}

// The attention output for q, [batch, heads, seq_q, head_dim_v], in q's memory order:
// (B, S, H, D) storage when q is a transposed (B, S, H, D) view, else (B, H, S, D). The
// register_fake in mha_ext/ops.py mirrors this rule.
inline at::Tensor empty_attention_output(const at::Tensor& q, int64_t head_dim_v) {
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  if (q.stride(1) < q.stride(2)) {
    return at::empty({batch, seq_q, heads, head_dim_v}, q.options()).transpose(1, 2);
  }
  return at::empty({batch, heads, seq_q, head_dim_v}, q.options());
}

// Points the params at the forward's outputs: out [batch, heads, seq_q, head_dim_v] (any
// strides, last dim contiguous) and lse [batch, heads, seq_q] contiguous. The backward reads
// them through the same fields.
inline void set_forward_outputs(AttentionForwardParams& params, const at::Tensor& out,
                                const at::Tensor& lse) {
  params.out = const_cast<void*>(out.data_ptr());
  params.out_strides = row_strides(out);
  params.lse = const_cast<void*>(lse.data_ptr());
}

// One forward call: its params and the outputs they point at.
struct AttentionForwardCall {
  AttentionForwardParams params;
  at::Tensor out;  // [batch, heads, seq_q, head_dim_v], empty_attention_output's layout
  at::Tensor lse;  // [batch, heads, seq_q], accumulation type
};

// The backward's params and the tensors they point at: gradients shaped and strided like
// q/k/v, delta [batch, heads, seq_q] in the accumulation type, and lse / grad_lse as
// contiguous rows (the kernels index them directly; they are O(seq), so a copy is cheap).
// The backend's plan adds the dQ partial sums (grad_q_accum, num_kv_splits).
struct AttentionBackwardCall {
  AttentionBackwardParams params;
  at::Tensor grad_q, grad_k, grad_v;
  at::Tensor delta, lse_rows, grad_lse_rows;
};

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  AttentionForwardCall call;
  call.params = make_attention_params(q, k, v, attn_mask, dropout_seed, dropout_p, scale,
                                      window_left, window_right, bottom_right);
  call.out = empty_attention_output(q, call.params.head_dim_v);
  call.lse = at::empty({call.params.batch, call.params.num_heads, call.params.seq_q},
                       accumulate_options(q));
  set_forward_outputs(call.params, call.out, call.lse);
  Backend::run(call.params, Backend::plan(call.params, q));
  return {call.out, call.lse};
}

// Checks the tensors only the backward takes against the forward's params.
inline void check_backward_args(const AttentionForwardParams& params, const at::Tensor& grad_out,
                                const at::Tensor& out, const at::Tensor& lse,
                                const std::optional<at::Tensor>& grad_lse, const at::Tensor& q) {
  using namespace attention_detail;
  const std::vector<int64_t> out_shape = {params.batch, params.num_heads, params.seq_q,
                                          params.head_dim_v};
  const std::vector<int64_t> lse_shape = {params.batch, params.num_heads, params.seq_q};
  const at::ScalarType lse_dtype = accumulate_dtype(q.scalar_type());
  for (const auto& [tensor, name] : {std::pair{&grad_out, "grad_out"}, std::pair{&out, "out"}}) {
    check_4d(*tensor, name);
    TORCH_CHECK(tensor->sizes() == at::IntArrayRef(out_shape), kOp, name, " must have shape ",
                at::IntArrayRef(out_shape), ", got ", tensor->sizes());
    TORCH_CHECK(tensor->scalar_type() == q.scalar_type() && tensor->device() == q.device(), kOp,
                name, " must match q's dtype ", dtype_name(q.scalar_type()), " and device ",
                q.device(), ", got ", dtype_name(tensor->scalar_type()), " on ", tensor->device());
  }
  for (const at::Tensor* tensor : {&lse, grad_lse.has_value() ? &*grad_lse : nullptr}) {
    if (tensor == nullptr) continue;
    const char* name = tensor == &lse ? "lse" : "grad_lse";
    TORCH_CHECK(tensor->sizes() == at::IntArrayRef(lse_shape) &&
                    tensor->scalar_type() == lse_dtype && tensor->device() == q.device(),
                kOp, name, " must be a ", dtype_name(lse_dtype), " tensor of shape ",
                at::IntArrayRef(lse_shape), " on ", q.device(), ", got ",
                dtype_name(tensor->scalar_type()), " of shape ", tensor->sizes(), " on ",
                tensor->device());
  }
}

// Points the backward's params at grad_out, out and lse and at freshly allocated gradients.
inline void fill_backward_tensors(AttentionBackwardCall& call, const at::Tensor& grad_out,
                                  const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse) {
  AttentionBackwardParams& p = call.params;
  call.grad_q = at::empty_like(q);
  call.grad_k = at::empty_like(k);
  call.grad_v = at::empty_like(v);
  call.delta = at::empty({p.batch, p.num_heads, p.seq_q}, accumulate_options(q));
  call.lse_rows = lse.contiguous();
  if (grad_lse.has_value()) call.grad_lse_rows = grad_lse->contiguous();
  set_forward_outputs(p, out, call.lse_rows);
  p.grad_out = grad_out.data_ptr();
  p.grad_out_strides = row_strides(grad_out);
  p.grad_lse = call.grad_lse_rows.defined() ? call.grad_lse_rows.data_ptr() : nullptr;
  p.grad_q = call.grad_q.data_ptr();
  p.grad_k = call.grad_k.data_ptr();
  p.grad_v = call.grad_v.data_ptr();
  p.grad_q_strides = row_strides(call.grad_q);
  p.grad_k_strides = row_strides(call.grad_k);
  p.grad_v_strides = row_strides(call.grad_v);
  p.delta = call.delta.data_ptr();
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right) {
  AttentionBackwardCall call;
  static_cast<AttentionForwardParams&>(call.params) = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  check_backward_args(call.params, grad_out, out, lse, grad_lse, q);
  fill_backward_tensors(call, grad_out, grad_lse, q, k, v, out, lse);
  Backend::run(call.params, Backend::plan(call.params, q));
  return {call.grad_q, call.grad_k, call.grad_v};
}

template <typename Backend>
at::Tensor dropout_mask(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                        int64_t seq_q, int64_t seq_k, double dropout_p) {
  using namespace attention_detail;
  TORCH_CHECK(batch >= 0 && num_heads >= 0 && seq_q >= 0 && seq_k >= 0, kDropoutMaskOp,
              "sizes must be >= 0, got batch ", batch, ", num_heads ", num_heads, ", seq_q ", seq_q,
              ", seq_k ", seq_k);
  check_dropout_p(kDropoutMaskOp, dropout_p);
  check_seed_tensor(kDropoutMaskOp, dropout_seed);
  at::Tensor mask =
      at::empty({batch, num_heads, seq_q, seq_k}, dropout_seed.options().dtype(at::kBool));
  DropoutMaskParams params;
  params.keep = mask.data_ptr<bool>();
  params.dropout = make_dropout_params(dropout_p, &dropout_seed);
  params.batch = batch;
  params.num_heads = num_heads;
  params.seq_q = seq_q;
  params.seq_k = seq_k;
  Backend::run(params);
  return mask;
}

MHA_EXT_DESCRIBE_OP(AttentionForwardOp, attention_forward);
MHA_EXT_DESCRIBE_OP(AttentionBackwardOp, attention_backward);
MHA_EXT_DESCRIBE_OP(DropoutMaskOp, dropout_mask);

}  // namespace mha_ext
