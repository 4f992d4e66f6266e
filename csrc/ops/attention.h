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
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "mha_ext/attention_params.h"
#include "mha_ext/philox.h"
#include "mha_ext/sequences.h"
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

// Checks a packed call's index tensors (and, where the backend reads indices on the host,
// their values) and fills the params' varlen fields, batch and longest lengths.
inline void fill_varlen_params(AttentionForwardParams& p, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               const std::optional<at::Tensor>& seqused_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, bool indices_on_host) {
  using namespace attention_detail;
  for (const auto& [t, name] :
       {std::pair{&cu_seqlens_q, "cu_seqlens_q"}, std::pair{&cu_seqlens_k, "cu_seqlens_k"}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->numel() >= 1 &&
                    t->is_contiguous() && t->device() == q.device(),
                kOp, name, " must be a contiguous 1-D torch.int32 tensor (batch + 1) on ",
                q.device(), ", got ", dtype_name(t->scalar_type()), " of shape ", t->sizes(),
                " on ", t->device());
  }
  const int64_t batch = cu_seqlens_q.numel() - 1;
  TORCH_CHECK(cu_seqlens_k.numel() == batch + 1, kOp, "cu_seqlens_q has ", batch + 1,
              " entries but cu_seqlens_k has ", cu_seqlens_k.numel());
  if (seqused_k.has_value()) {
    TORCH_CHECK(seqused_k->scalar_type() == at::kInt && seqused_k->dim() == 1 &&
                    seqused_k->numel() == batch && seqused_k->is_contiguous() &&
                    seqused_k->device() == q.device(),
                kOp, "seqused_k must be a contiguous torch.int32 tensor of shape (", batch, ") on ",
                q.device(), ", got ", dtype_name(seqused_k->scalar_type()), " of shape ",
                seqused_k->sizes(), " on ", seqused_k->device());
  }
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, kOp,
              "max_seqlen_q and max_seqlen_k must be >= 0, got ", max_seqlen_q, " and ",
              max_seqlen_k);
  if (indices_on_host) {
    const int32_t* offsets[2] = {cu_seqlens_q.const_data_ptr<int32_t>(),
                                 cu_seqlens_k.const_data_ptr<int32_t>()};
    const char* names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
    const int64_t totals[2] = {q.size(0), k.size(0)}, longest[2] = {max_seqlen_q, max_seqlen_k};
    const char* longest_names[2] = {"max_seqlen_q", "max_seqlen_k"};
    for (int side = 0; side < 2; ++side) {
      const int32_t* cu = offsets[side];
      TORCH_CHECK(cu[0] == 0 && cu[batch] == totals[side], kOp, names[side],
                  " must run from 0 to the ", totals[side], " packed rows, got ", cu[0], " .. ",
                  cu[batch]);
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t length = int64_t(cu[b + 1]) - cu[b];
        TORCH_CHECK(length >= 0, kOp, names[side], " must be non-decreasing, got ", cu[b], " then ",
                    cu[b + 1], " at sequence ", b);
        TORCH_CHECK(length <= longest[side], kOp, longest_names[side], " is ", longest[side],
                    " but sequence ", b, " has ", length, side == 0 ? " queries" : " keys");
      }
    }
    for (int64_t b = 0; seqused_k.has_value() && b < batch; ++b) {
      const int32_t used = seqused_k->const_data_ptr<int32_t>()[b];
      const int32_t* cu = offsets[1];
      TORCH_CHECK(used >= 0 && used <= cu[b + 1] - cu[b], kOp, "seqused_k[", b, "] is ", used,
                  " but sequence ", b, " has ", cu[b + 1] - cu[b], " keys");
    }
  }
  p.batch = batch;
  p.seq_q = max_seqlen_q;
  p.seq_k = max_seqlen_k;
  p.varlen.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int32_t>();
  p.varlen.cu_seqlens_k = cu_seqlens_k.const_data_ptr<int32_t>();
  p.varlen.seqused_k = seqused_k.has_value() ? seqused_k->const_data_ptr<int32_t>() : nullptr;
}

// Validates q, k, v and every option of one attention call and fills every input field of
// the params (the outputs are the caller's). Dense calls take q [batch, heads, seq_q,
// head_dim], k/v [batch, kv_heads, seq_k, head_dim(_v)]; packed (varlen) calls, with
// cu_seqlens_q and cu_seqlens_k, take q [total_q, heads, head_dim], k/v [total_k, kv_heads,
// head_dim(_v)].
inline AttentionForwardParams make_attention_params(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool indices_on_host) {
  using namespace attention_detail;
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(), kOp,
              "cu_seqlens_q and cu_seqlens_k go together, got only ",
              cu_seqlens_q.has_value() ? "cu_seqlens_q" : "cu_seqlens_k");
  const bool packed = cu_seqlens_q.has_value();
  TORCH_CHECK(packed || !seqused_k.has_value(), kOp,
              "seqused_k needs cu_seqlens_q and cu_seqlens_k (a packed call)");
  // A packed call's dims: token, head, dim; a dense call's: batch, head, seq, dim.
  const int64_t seq_dim = packed ? 0 : 2, head_dim_index = packed ? 2 : 3;
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    if (packed) {
      check_rank(kOp, *t, name, 3, "(total, heads, head_dim) with cu_seqlens");
    } else {
      check_4d(*t, name);
    }
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kOp,
              "q, k and v must share one dtype, got q ", dtype_name(q.scalar_type()), ", k ",
              dtype_name(k.scalar_type()), ", v ", dtype_name(v.scalar_type()));
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), kOp,
              "q, k and v must be on one device, got q on ", q.device(), ", k on ", k.device(),
              ", v on ", v.device());
  TORCH_CHECK(packed || (k.size(0) == q.size(0) && v.size(0) == q.size(0)), kOp,
              "q, k and v must share the batch size, got q ", q.size(0), ", k ", k.size(0), ", v ",
              v.size(0));
  TORCH_CHECK(k.size(1) == v.size(1), kOp, "k has ", k.size(1), " heads but v has ", v.size(1));
  TORCH_CHECK(k.size(seq_dim) == v.size(seq_dim), kOp, "k has ", k.size(seq_dim),
              " keys but v has ", v.size(seq_dim), " values");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, kOp, "k has ", k.size(1),
              " heads, which does not divide q's ", q.size(1), " heads");
  const int64_t head_dim = q.size(head_dim_index), head_dim_v = v.size(head_dim_index);
  TORCH_CHECK(head_dim == k.size(head_dim_index), kOp, "q has head_dim ", head_dim, " but k has ",
              k.size(head_dim_index));
  TORCH_CHECK(head_dim <= kMaxHeadDim && head_dim_v <= kMaxHeadDim, kOp, "head_dim ", head_dim,
              " (q, k) and ", head_dim_v, " (v) must not exceed ", kMaxHeadDim);
  TORCH_CHECK(std::isfinite(scale), kOp, "scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, kOp,
              "softcap must be >= 0 (0 = no softcap), got ", softcap);
  TORCH_CHECK(window_left >= -1 && window_right >= -1, kOp,
              "window sides must be -1 (unbounded) or >= 0, got window_left ", window_left,
              ", window_right ", window_right);
  TORCH_CHECK(!(packed && attn_mask.has_value()), kOp,
              "attn_mask is not supported with cu_seqlens (packed sequences)");
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
  p.num_heads = q.size(1);
  p.num_kv_heads = k.size(1);
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  if (packed) {
    fill_varlen_params(p, q, k, *cu_seqlens_q, *cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                       indices_on_host);
    for (const auto& [t, strides] :
         {std::pair{&q, &p.q_strides}, std::pair{&k, &p.k_strides}, std::pair{&v, &p.v_strides}}) {
      *strides = RowStrides{0, t->stride(1), t->stride(0)};
    }
  } else {
    p.batch = q.size(0);
    p.seq_q = q.size(2);
    p.seq_k = k.size(2);
    p.q_strides = row_strides(q);
    p.k_strides = row_strides(k);
    p.v_strides = row_strides(v);
  }
  p.scale = scale;
  p.window.window_left = window_left;
  p.window.window_right = window_right;
  p.bottom_right = bottom_right;
  p.window.diagonal_offset = bottom_right ? p.seq_k - p.seq_q : 0;
  if (attn_mask.has_value()) p.mask = make_mask_params(*attn_mask, q, p.seq_k);
  p.dropout = make_dropout_params(dropout_p, dropout_p > 0.0 ? &*dropout_seed : nullptr);
  p.mods.softcap = softcap;
  if (alibi_slopes.has_value()) {
    check_per_head_values(kOp, *alibi_slopes, "alibi_slopes", q,
                          {{p.num_heads}, {p.batch, p.num_heads}}, "(heads) or (batch, heads)");
    p.mods.alibi_slopes = alibi_slopes->data_ptr();
    p.mods.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  if (sinks.has_value()) {
    check_per_head_values(kOp, *sinks, "sinks", q, {{p.num_heads}}, "(heads)");
    p.sinks = sinks->data_ptr();
  }
  // lse: [batch, heads, seq_q], or [heads, total_q] packed.
  p.lse_head_stride = packed ? q.size(0) : p.seq_q;
  p.lse_batch_stride = packed ? 0 : p.num_heads * p.seq_q;
  return p;
}

// The attention output for q, [batch, heads, seq_q, head_dim_v] in q's memory order:
// (B, S, H, D) storage when q is a transposed (B, S, H, D) view, else (B, H, S, D). A packed
// q [total_q, heads, head_dim] gets [total_q, heads, head_dim_v]. The register_fake in
// mha_ext/ops.py mirrors this rule.
inline at::Tensor empty_attention_output(const at::Tensor& q, int64_t head_dim_v) {
  if (q.dim() == 3) return at::empty({q.size(0), q.size(1), head_dim_v}, q.options());
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  if (q.stride(1) < q.stride(2)) {
    return at::empty({batch, seq_q, heads, head_dim_v}, q.options()).transpose(1, 2);
  }
  return at::empty({batch, heads, seq_q, head_dim_v}, q.options());
}

// The shape of lse (and delta, grad_lse) for q: [batch, heads, seq_q], or [heads, total_q]
// for a packed q.
inline std::vector<int64_t> lse_shape(const at::Tensor& q) {
  if (q.dim() == 3) return {q.size(1), q.size(0)};
  return {q.size(0), q.size(1), q.size(2)};
}

// The strides of an output shaped like q: 4-D, or packed [total, heads, dim].
inline RowStrides output_strides(const at::Tensor& t) {
  return t.dim() == 3 ? RowStrides{0, t.stride(1), t.stride(0)} : row_strides(t);
}

// Points the params at the forward's outputs: out shaped like q with head_dim_v (any
// strides, last dim contiguous) and lse in lse_shape, contiguous. The backward reads them
// through the same fields.
inline void set_forward_outputs(AttentionForwardParams& params, const at::Tensor& out,
                                const at::Tensor& lse) {
  params.out = const_cast<void*>(out.data_ptr());
  params.out_strides = output_strides(out);
  params.lse = const_cast<void*>(lse.data_ptr());
}

// One forward call: its params and the outputs they point at.
struct AttentionForwardCall {
  AttentionForwardParams params;
  at::Tensor out;  // shaped like q with head_dim_v, empty_attention_output's layout
  at::Tensor lse;  // lse_shape(q), accumulation type
};

// The backward's params and the tensors they point at: gradients shaped and strided like
// q/k/v (and sinks), delta in lse's layout and accumulation type, and lse / grad_lse as
// contiguous rows (the kernels index them directly; they are O(seq), so a copy is cheap).
// The backend's plan adds the dQ partial sums (grad_q_accum, num_kv_splits).
struct AttentionBackwardCall {
  AttentionBackwardParams params;
  at::Tensor grad_q, grad_k, grad_v, grad_sinks;
  at::Tensor delta, lse_rows, grad_lse_rows;
};

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
    c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, bool deterministic) {
  AttentionForwardCall call;
  call.params = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right,
      softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
      max_seqlen_q.expect_int(), max_seqlen_k.expect_int(), Backend::kIndicesOnHost);
  call.out = empty_attention_output(q, call.params.head_dim_v);
  call.lse = at::empty(lse_shape(q), accumulate_options(q));
  set_forward_outputs(call.params, call.out, call.lse);
  Backend::run(call.params, Backend::plan(call.params, q));
  return {call.out, call.lse};
}

// Checks the tensors only the backward takes against the forward's params.
inline void check_backward_args(const AttentionForwardParams& params, const at::Tensor& grad_out,
                                const at::Tensor& out, const at::Tensor& lse,
                                const std::optional<at::Tensor>& grad_lse, const at::Tensor& q) {
  using namespace attention_detail;
  std::vector<int64_t> out_shape = q.sizes().vec();
  out_shape.back() = params.head_dim_v;
  const std::vector<int64_t> lse_sizes = lse_shape(q);
  const at::ScalarType lse_dtype = accumulate_dtype(q.scalar_type());
  for (const auto& [tensor, name] : {std::pair{&grad_out, "grad_out"}, std::pair{&out, "out"}}) {
    check_rank(kOp, *tensor, name, q.dim(), "shaped like q");
    TORCH_CHECK(tensor->sizes() == at::IntArrayRef(out_shape), kOp, name, " must have shape ",
                at::IntArrayRef(out_shape), ", got ", tensor->sizes());
    TORCH_CHECK(tensor->scalar_type() == q.scalar_type() && tensor->device() == q.device(), kOp,
                name, " must match q's dtype ", dtype_name(q.scalar_type()), " and device ",
                q.device(), ", got ", dtype_name(tensor->scalar_type()), " on ", tensor->device());
  }
  for (const at::Tensor* tensor : {&lse, grad_lse.has_value() ? &*grad_lse : nullptr}) {
    if (tensor == nullptr) continue;
    const char* name = tensor == &lse ? "lse" : "grad_lse";
    TORCH_CHECK(tensor->sizes() == at::IntArrayRef(lse_sizes) &&
                    tensor->scalar_type() == lse_dtype && tensor->device() == q.device(),
                kOp, name, " must be a ", dtype_name(lse_dtype), " tensor of shape ",
                at::IntArrayRef(lse_sizes), " on ", q.device(), ", got ",
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
  // Keys past a sequence's seqused_k take no part and get zero gradients.
  call.grad_k = p.varlen.seqused_k != nullptr ? at::zeros_like(k) : at::empty_like(k);
  call.grad_v = p.varlen.seqused_k != nullptr ? at::zeros_like(v) : at::empty_like(v);
  call.delta = at::empty(lse_shape(q), accumulate_options(q));
  call.lse_rows = lse.contiguous();
  if (grad_lse.has_value()) call.grad_lse_rows = grad_lse->contiguous();
  set_forward_outputs(p, out, call.lse_rows);
  p.grad_out = grad_out.data_ptr();
  p.grad_out_strides = output_strides(grad_out);
  p.grad_lse = call.grad_lse_rows.defined() ? call.grad_lse_rows.data_ptr() : nullptr;
  p.grad_q = call.grad_q.data_ptr();
  p.grad_k = call.grad_k.data_ptr();
  p.grad_v = call.grad_v.data_ptr();
  p.grad_q_strides = output_strides(call.grad_q);
  p.grad_k_strides = output_strides(call.grad_k);
  p.grad_v_strides = output_strides(call.grad_v);
  p.delta = call.delta.data_ptr();
}

// d loss / d sinks[h] = -sum over h's rows of exp(sink_h - lse) * delta: the sink's share of
// each row's softmax, times the row term of dS (see compute_delta in the kernels). Summed in
// the accumulation type in one fixed order, so it is as reproducible as the rest.
inline at::Tensor sinks_gradient(const at::Tensor& sinks, const at::Tensor& lse,
                                 const at::Tensor& delta) {
  // lse, delta: [batch, heads, seq_q] or [heads, total_q]
  const bool packed = lse.dim() == 2;
  const at::Tensor sink_logits = packed ? sinks.view({-1, 1}) : sinks.view({1, -1, 1});
  const at::Tensor terms = sink_logits.sub(lse).exp().mul(delta);
  const at::Tensor per_head = packed ? terms : terms.transpose(0, 1).reshape({sinks.size(0), -1});
  return per_head.sum(1, /*keepdim=*/false, at::kDouble).neg().to(sinks.scalar_type());
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
    c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, bool deterministic) {
  AttentionBackwardCall call;
  static_cast<AttentionForwardParams&>(call.params) = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right,
      softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k,
      max_seqlen_q.expect_int(), max_seqlen_k.expect_int(), Backend::kIndicesOnHost);
  call.params.deterministic = deterministic;
  check_backward_args(call.params, grad_out, out, lse, grad_lse, q);
  fill_backward_tensors(call, grad_out, grad_lse, q, k, v, out, lse);
  Backend::run(call.params, Backend::plan(call.params, q));
  call.grad_sinks = sinks.has_value() ? sinks_gradient(*sinks, call.lse_rows, call.delta)
                                      : at::empty({0}, accumulate_options(q));
  return {call.grad_q, call.grad_k, call.grad_v, call.grad_sinks};
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
