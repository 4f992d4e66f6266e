// CUDA backend of dropout_mask: validate -> launch on the current stream. (The attention
// kernels' CUDA backends arrive with the CUDA issue; until then this op keeps the CUDA
// build path compiling and shares the CPU path's RNG header.)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "attention_checks.h"
#include "cuda/kernels/dropout_mask.h"

namespace mha_ext::cuda {
namespace {

at::Tensor dropout_mask_cuda(const at::Tensor& dropout_seed, int64_t batch, int64_t num_heads,
                             int64_t seq_q, int64_t seq_k, double dropout_p) {
  check_dropout_mask_args(dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p);
  const c10::cuda::CUDAGuard device_guard(dropout_seed.device());
  at::Tensor mask =
      at::empty({batch, num_heads, seq_q, seq_k}, dropout_seed.options().dtype(at::kBool));
  const cudaError_t status = launch_dropout_mask(
      mask.data_ptr<bool>(), dropout_seed.data_ptr<int64_t>(), make_dropout_params(dropout_p),
      batch, num_heads, seq_q, seq_k, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "mha_ext.dropout_mask: kernel launch failed: ",
              cudaGetErrorString(status));
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) { m.impl("dropout_mask", &dropout_mask_cuda); }

}  // namespace mha_ext::cuda
