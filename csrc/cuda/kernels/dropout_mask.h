#pragma once
// Launcher of the CUDA dropout-mask kernel; torch-free so kernel files compile without
// torch headers.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "mha_ext/attention_params.h"

namespace mha_ext::cuda {

// keep: [batch, num_heads, seq_q, seq_k] contiguous bool; seed: one int64 in device memory,
// read by the kernel so that the launch never waits for the host (CUDA-graph safe).
// `dropout` supplies the threshold; its seed field is ignored.
cudaError_t launch_dropout_mask(bool* keep, const int64_t* seed, const DropoutParams& dropout,
                                int64_t batch, int64_t num_heads, int64_t seq_q, int64_t seq_k,
                                cudaStream_t stream);

}  // namespace mha_ext::cuda
