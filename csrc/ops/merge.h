#pragma once
// merge_attention_states, written once for every backend (ops/attention.h explains the
// plan/run contract). Contract: the schema in csrc/ops.cpp; ops/merge.cpp registers it.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <tuple>

#include "mha_ext/paged_params.h"
#include "ops/op_signature.h"
#include "ops/tensor_checks.h"

namespace mha_ext {

// One merge: its params and what they point at, the inputs as [rows, head_dim] / [rows] views
// (copied only when the leading dims do not flatten or the last dim is strided) and the
// outputs.
struct MergeStatesCall {
  MergeStatesParams params;
  at::Tensor rows_a, rows_b, lse_a, lse_b;
  at::Tensor out, lse;
};

inline MergeStatesCall make_merge_states_call(const at::Tensor& out_a, const at::Tensor& lse_a,
                                              const at::Tensor& out_b, const at::Tensor& lse_b) {
  constexpr const char* kOp = "mha_ext.merge_attention_states: ";
  TORCH_CHECK(out_a.dim() >= 1 && out_a.sizes() == out_b.sizes(), kOp,
              "out_a and out_b must have one shape (..., head_dim), got ", out_a.sizes(), " and ",
              out_b.sizes());
  check_same_dtype(kOp, out_a, "out_a", out_b, "out_b");
  const at::ScalarType lse_dtype = accumulate_dtype(out_a.scalar_type());
  const at::IntArrayRef rows_shape = out_a.sizes().slice(0, out_a.dim() - 1);
  for (const auto& [tensor, name] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}}) {
    TORCH_CHECK(tensor->sizes() == rows_shape && tensor->scalar_type() == lse_dtype &&
                    tensor->device() == out_a.device(),
                kOp, name, " must be a ", dtype_name(lse_dtype), " tensor of shape ", rows_shape,
                " on ", out_a.device(), ", got ", dtype_name(tensor->scalar_type()), " of shape ",
                tensor->sizes(), " on ", tensor->device());
  }
  MergeStatesCall call;
  MergeStatesParams& p = call.params;
  p.dtype = to_dtype(out_a.scalar_type(), kOp, "out_a");
  p.rows = lse_a.numel();
  p.head_dim = out_a.size(-1);
  // The kernels read each row's head_dim elements contiguously: a strided last dim (a
  // transposed view, say) is copied, as reshape keeps such a view's strides.
  const auto as_rows = [&](const at::Tensor& out) {
    at::Tensor rows = out.reshape({p.rows, p.head_dim});
    return p.head_dim > 1 && rows.stride(1) != 1 ? rows.contiguous() : rows;
  };
  call.rows_a = as_rows(out_a);
  call.rows_b = as_rows(out_b);
  call.lse_a = lse_a.contiguous();
  call.lse_b = lse_b.contiguous();
  call.out = at::empty(out_a.sizes(), out_a.options());
  call.lse = at::empty(lse_a.sizes(), lse_a.options());
  p.out_a = call.rows_a.data_ptr();
  p.out_b = call.rows_b.data_ptr();
  p.out_a_stride = p.rows > 1 ? call.rows_a.stride(0) : p.head_dim;
  p.out_b_stride = p.rows > 1 ? call.rows_b.stride(0) : p.head_dim;
  p.lse_a = call.lse_a.data_ptr();
  p.lse_b = call.lse_b.data_ptr();
  p.out = call.out.data_ptr();
  p.out_stride = p.head_dim;
  p.lse = call.lse.data_ptr();
  return call;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> merge_attention_states(const at::Tensor& out_a,
                                                          const at::Tensor& lse_a,
                                                          const at::Tensor& out_b,
                                                          const at::Tensor& lse_b) {
  MergeStatesCall call = make_merge_states_call(out_a, lse_a, out_b, lse_b);
  Backend::run(call.params, Backend::plan(call.params, out_a));
  return {call.out, call.lse};
}

MHA_EXT_DESCRIBE_OP(MergeAttentionStatesOp, merge_attention_states);

}  // namespace mha_ext
