#include "attention_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

#include "mha_ext/philox.h"

namespace mha_ext {
namespace {

constexpr const char* kOp = "mha_ext.attention: ";

void check_4d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, kOp, name, " must be a 4-D tensor (batch, heads, seq, head_dim), got ",
              t.dim(), "-D with shape ", t.sizes());
  // Strides of an empty tensor are arbitrary (an empty gradient may come broadcast).
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1 || t.numel() == 0, kOp, name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides());
}

void check_dropout_p(const char* op, double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, "dropout_p must be in [0, 1), got ",
              dropout_p);
}

void check_seed_tensor(const char* op, const at::Tensor& dropout_seed) {
  TORCH_CHECK(dropout_seed.scalar_type() == at::kLong && dropout_seed.numel() == 1, op,
              "dropout_seed must be a one-element torch.int64 tensor, got ",
              dtype_name(dropout_seed.scalar_type()), " with shape ", dropout_seed.sizes());
}

AttnMaskParams make_mask_params(const at::Tensor& mask, const at::Tensor& q, int64_t seq_k) {
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
  // Broadcast dims read element 0 again and again: stride 0, no copy.
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

}  // namespace

DType to_dtype(at::ScalarType dtype, const char* op, const char* name) {
  switch (dtype) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      TORCH_CHECK(false, op, name, " has dtype ", dtype_name(dtype),
                  "; supported dtypes are torch.float32, torch.float64, torch.bfloat16 and "
                  "torch.float16");
  }
  return DType::kFloat32;  // not reached: the default branch throws
}

std::string dtype_name(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

at::ScalarType accumulate_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

RowStrides row_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

DropoutParams make_dropout_params(double dropout_p) {
  DropoutParams dropout;
  dropout.enabled = dropout_p > 0.0;
  dropout.drop_threshold = dropout_threshold(dropout_p);
  dropout.keep_scale = 1.0 / (1.0 - dropout_p);
  return dropout;
}

AttentionForwardParams make_attention_params(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v,
                                             const std::optional<at::Tensor>& attn_mask,
                                             const std::optional<at::Tensor>& dropout_seed,
                                             double dropout_p, double scale,
                                             int64_t window_left, int64_t window_right,
                                             bool bottom_right) {
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
  TORCH_CHECK(q.size(3) == k.size(3), kOp, "q has head_dim ", q.size(3), " but k has ",
              k.size(3));
  TORCH_CHECK(q.size(3) <= kMaxHeadDim && v.size(3) <= kMaxHeadDim, kOp, "head_dim ",
              q.size(3), " (q, k) and ", v.size(3), " (v) must not exceed ", kMaxHeadDim);
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
  p.dropout = make_dropout_params(dropout_p);
  return p;
}

at::Tensor empty_attention_output(const at::Tensor& q, int64_t head_dim_v) {
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  if (q.stride(1) < q.stride(2)) {
    return at::empty({batch, seq_q, heads, head_dim_v}, q.options()).transpose(1, 2);
  }
  return at::empty({batch, heads, seq_q, head_dim_v}, q.options());
}

std::tuple<at::Tensor, at::Tensor> prepare_forward_outputs(AttentionForwardParams& params,
                                                           const at::Tensor& q) {
  at::Tensor out = empty_attention_output(q, params.head_dim_v);
  at::Tensor lse = at::empty({params.batch, params.num_heads, params.seq_q},
                             q.options().dtype(accumulate_dtype(q.scalar_type())));
  set_forward_outputs(params, out, lse);
  return {out, lse};
}

void set_forward_outputs(AttentionForwardParams& params, const at::Tensor& out, const at::Tensor& lse) {
  params.out = const_cast<void*>(out.data_ptr());
  params.out_strides = row_strides(out);
  params.lse = const_cast<void*>(lse.data_ptr());
}

at::Tensor zeros_per_call(at::IntArrayRef shape, const at::TensorOptions& options) {
  return at::zeros(shape, options);
}

BackwardTensors prepare_backward(AttentionBackwardParams& params, const at::Tensor& grad_out,
                                 const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, int64_t num_kv_splits, WorkspaceFn make_workspace) {
  const at::TensorOptions acc_options = q.options().dtype(accumulate_dtype(q.scalar_type()));
  BackwardTensors t;
  t.grad_q = at::empty_like(q);
  t.grad_k = at::empty_like(k);
  t.grad_v = at::empty_like(v);
  t.grad_q_accum = make_workspace({num_kv_splits, params.batch, params.num_heads, params.seq_q, params.head_dim},
                                  acc_options);
  t.delta = at::empty({params.batch, params.num_heads, params.seq_q}, acc_options);
  t.lse_rows = lse.contiguous();
  if (grad_lse.has_value()) t.grad_lse_rows = grad_lse->contiguous();

  set_forward_outputs(params, out, t.lse_rows);
  params.grad_out = grad_out.data_ptr();
  params.grad_out_strides = row_strides(grad_out);
  params.grad_lse = t.grad_lse_rows.has_value() ? t.grad_lse_rows->data_ptr() : nullptr;
  params.grad_q = t.grad_q.data_ptr();
  params.grad_k = t.grad_k.data_ptr();
  params.grad_v = t.grad_v.data_ptr();
  params.grad_q_strides = row_strides(t.grad_q);
  params.grad_k_strides = row_strides(t.grad_k);
  params.grad_v_strides = row_strides(t.grad_v);
  params.grad_q_accum = t.grad_q_accum.data_ptr();
  params.num_kv_splits = num_kv_splits;
  params.delta = t.delta.data_ptr();
  return t;
}

void check_backward_args(const AttentionForwardParams& params, const at::Tensor& grad_out,
                         const at::Tensor& out, const at::Tensor& lse,
                         const std::optional<at::Tensor>& grad_lse, const at::Tensor& q) {
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

void check_dropout_mask_args(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                             int64_t seq_q, int64_t seq_k, double dropout_p) {
  constexpr const char* kMaskOp = "mha_ext.dropout_mask: ";
  TORCH_CHECK(batch >= 0 && num_heads >= 0 && seq_q >= 0 && seq_k >= 0, kMaskOp,
              "sizes must be >= 0, got batch ", batch, ", num_heads ", num_heads, ", seq_q ",
              seq_q, ", seq_k ", seq_k);
  check_dropout_p(kMaskOp, dropout_p);
  check_seed_tensor(kMaskOp, dropout_seed);
}

}  // namespace mha_ext
