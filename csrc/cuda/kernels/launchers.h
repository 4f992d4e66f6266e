#pragma once
// Launchers of the CUDA kernels. Torch-free, so kernel files compile without torch
// headers; the op wrappers (csrc/cuda/*_cuda.cpp) validate, allocate and call these on the
// current stream. Every launcher returns the launch status (cudaGetLastError).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/paged_params.h"

namespace mha_ext::cuda {

// keep: [batch, num_heads, seq_q, seq_k] contiguous bool; seed: one int64 in device memory,
// read by the kernel so that the launch never waits for the host (CUDA-graph safe).
// `dropout` supplies the threshold; its seed field is ignored.
cudaError_t launch_dropout_mask(bool* keep, const int64_t* seed, const DropoutParams& dropout,
                                int64_t batch, int64_t num_heads, int64_t seq_q, int64_t seq_k,
                                cudaStream_t stream);

// Which attention kernels a call may use. The tensor-core forward takes fp16/bf16 with a
// head dim compiled in (MHA_EXT_HEAD_DIMS) and 16-byte aligned rows; everything else, and
// every call when allow_tensor_cores is false, runs the generic SIMT kernels.
struct KernelChoice {
  bool allow_tensor_cores = true;
};

// out/lse as in AttentionForwardParams; seed: device int64, or nullptr without dropout.
cudaError_t launch_attention_forward(const AttentionForwardParams& params, const int64_t* seed,
                                     KernelChoice choice, cudaStream_t stream);

// grad_q_accum: zero-filled fp32/fp64, one split of lse_elements(params) rows of head_dim
// (the CUDA backward adds dQ with atomics); unused (nullptr) when params.deterministic, whose
// dQ comes from a pass of its own. delta: in lse's layout.
cudaError_t launch_attention_backward(const AttentionBackwardParams& params, const int64_t* seed,
                                      KernelChoice choice, cudaStream_t stream);

// Slots outside [0, num_blocks * block_size) (and -1) are skipped inside the kernel: nothing
// is written for them.
cudaError_t launch_paged_kv_append(const PagedAppendParams& params, cudaStream_t stream);

// How many key splits paged attention uses (partial_out/partial_lse hold that many slices):
// depends on shapes only, so a captured CUDA graph replays with the same plan.
int64_t paged_attention_splits(const PagedAttentionParams& params, int num_sms);

// Index values are read only on the device: block ids outside the cache hide their keys,
// lengths are clamped to what a block-table row holds. max_queries_per_seq and max_seq_len
// are upper bounds (the host cannot read the device's index tensors without a sync).
// With num_kv_splits > 1 the partial_out/partial_lse workspaces must be set.
cudaError_t launch_paged_attention(const PagedAttentionParams& params, int num_sms,
                                   cudaStream_t stream);

cudaError_t launch_merge_attention_states(const MergeStatesParams& params, cudaStream_t stream);

}  // namespace mha_ext::cuda
