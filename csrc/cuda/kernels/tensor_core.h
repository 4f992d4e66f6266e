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

// The dK/dV/dQ pass of the backward (delta before it and the dQ cast after it are shared
// with the generic path); dQ is added into params.grad_q_accum (fp32, one split), except
// when params.deterministic: then only dK and dV, and dQ comes from the launcher's dQ pass.
bool tensor_core_backward(const AttentionBackwardParams& params, const int64_t* seed,
                          cudaStream_t stream);

// The dQ pass of a deterministic backward (after delta): writes params.grad_q, each row
// summed in one fixed order.
bool tensor_core_grad_q(const AttentionBackwardParams& params, const int64_t* seed,
                        cudaStream_t stream);

}  // namespace mha_ext::cuda
