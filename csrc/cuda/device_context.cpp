// The CUDA backend's view of the current device (cuda/backend.h), from c10's CUDA state.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "cuda/backend.h"

namespace mha_ext::cuda {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

int multiprocessor_count() {
  // (ATen/cuda/CUDAContext.h would need cuSPARSE headers that a bare toolkit lacks.)
  int count = 0;
  const cudaError_t status =
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device());
  TORCH_CHECK(status == cudaSuccess,
              "mha_ext: cannot read the GPU's multiprocessor count: ", cudaGetErrorString(status));
  return count;
}

}  // namespace mha_ext::cuda
