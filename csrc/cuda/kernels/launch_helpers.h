#pragma once
// Host-side helpers of the kernel launchers: the dtype switch and grid-stride grid sizes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "mha_ext/attention_params.h"

namespace mha_ext::cuda {

// Calls kernel(tag) with a value of the element type that `dtype` names.
template <typename Kernel>
cudaError_t dispatch_dtype(DType dtype, Kernel&& kernel) {
  switch (dtype) {
    case DType::kFloat32: return kernel(float{});
    case DType::kFloat64: return kernel(double{});
    case DType::kBFloat16: return kernel(__nv_bfloat16{});
    case DType::kFloat16: return kernel(__half{});
  }
  return cudaErrorInvalidValue;
}

// Blocks of a grid-stride loop over `work` items: enough to fill any current GPU.
inline unsigned stride_blocks(int64_t work, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + threads - 1) / threads, 1, 65535));
}

}  // namespace mha_ext::cuda
