#pragma once
// Entry points of the tensor-core (mma.sync) attention kernels, for the launchers in
// attention.cu. Each returns false, launching nothing, when the params are outside what
// the kernels were compiled for.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "mha_ext/attention_params.h"

namespace mha_ext::cuda {

bool tensor_core_forward(const AttentionForwardParams& params, const int64_t* seed,
                         cudaStream_t stream);

}  // namespace mha_ext::cuda
