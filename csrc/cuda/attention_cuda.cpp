// CUDA backend of the attention ops: validate (the same checks and messages as the CPU
// backend) -> allocate on the input's device -> launch on the current stream. The dropout
// seed stays on the device and the kernels read it there, so no call waits for the GPU and
// every op can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "attention_checks.h"
#include "cuda/kernels/launchers.h"

namespace mha_ext::cuda {
namespace {

constexpr const char* kOp = "mha_ext.attention: ";

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

const int64_t* device_seed(const AttentionForwardParams& params,
                           const std::optional<at::Tensor>& dropout_seed) {
  return params.dropout.enabled ? dropout_seed->data_ptr<int64_t>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right,
    bool bottom_right) {
  AttentionForwardParams params = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = empty_attention_output(q, params.head_dim_v);
  at::Tensor lse = at::empty({params.batch, params.num_heads, params.seq_q},
                             q.options().dtype(accumulate_dtype(q.scalar_type())));
  set_forward_outputs(params, out, lse);
  check_launch(launch_attention_forward(params, device_seed(params, dropout_seed), kernel_choice(),
                                        c10::cuda::getCurrentCUDAStream()),
               kOp);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& dropout_seed,
    double dropout_p, double scale, int64_t window_left, int64_t window_right,
    bool bottom_right) {
  AttentionBackwardParams params;
  static_cast<AttentionForwardParams&>(params) = make_attention_params(
      q, k, v, attn_mask, dropout_seed, dropout_p, scale, window_left, window_right, bottom_right);
  check_backward_args(params, grad_out, out, lse, grad_lse, q);
  const c10::cuda::CUDAGuard device_guard(q.device());
  // The kernels index the logsumexp rows directly; they are O(seq) so a copy is cheap.
  const at::Tensor lse_rows = lse.contiguous();
  const std::optional<at::Tensor> grad_lse_rows =
      grad_lse.has_value() ? std::optional<at::Tensor>(grad_lse->contiguous()) : std::nullopt;
  at::Tensor grad_q = at::empty_like(q);
  at::Tensor grad_k = at::empty_like(k);
  at::Tensor grad_v = at::empty_like(v);
  const at::ScalarType acc_dtype = accumulate_dtype(q.scalar_type());
  // One dQ workspace: the key blocks add their parts with atomics.
  at::Tensor grad_q_accum = at::zeros({1, params.batch, params.num_heads, params.seq_q, params.head_dim},
                                      q.options().dtype(acc_dtype));
  at::Tensor delta = at::empty({params.batch, params.num_heads, params.seq_q}, q.options().dtype(acc_dtype));
  set_forward_outputs(params, out, lse_rows);
  set_backward_tensors(params, grad_out, grad_lse_rows.has_value() ? &*grad_lse_rows : nullptr, grad_q,
                       grad_k, grad_v, grad_q_accum, delta);
  check_launch(launch_attention_backward(params, device_seed(params, dropout_seed), kernel_choice(),
                                         c10::cuda::getCurrentCUDAStream()),
               kOp);
  return {grad_q, grad_k, grad_v};
}

at::Tensor dropout_mask_cuda(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                             int64_t seq_q, int64_t seq_k, double dropout_p) {
  check_dropout_mask_args(dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p);
  const c10::cuda::CUDAGuard device_guard(dropout_seed.device());
  at::Tensor mask =
      at::empty({batch, num_heads, seq_q, seq_k}, dropout_seed.options().dtype(at::kBool));
  check_launch(launch_dropout_mask(mask.data_ptr<bool>(), dropout_seed.data_ptr<int64_t>(),
                                   make_dropout_params(dropout_p), batch, num_heads, seq_q, seq_k,
                                   c10::cuda::getCurrentCUDAStream()),
               "mha_ext.dropout_mask: ");
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("dropout_mask", &dropout_mask_cuda);
}

}  // namespace mha_ext::cuda
