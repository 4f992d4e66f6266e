#pragma once
// The CUDA backend of every op (see ops/attention.h for the plan/run contract): plans size
// the workspaces by shapes alone and runs launch the torch-free kernels (kernels/launchers.h)
// on the current stream. Nothing here reads device memory on the host, so no op waits for
// the GPU and every op can be captured in a CUDA graph. Torch's CUDA headers stay out of this
// file and backend.cpp, so that the CPU emulation of the kernels (tests/emulation) runs this
// code too: the stream and the multiprocessor count come from device_context.cpp (the
// emulator brings its own), and the device guard from on_device.h.
#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include "mha_ext/attention_params.h"
#include "mha_ext/paged_params.h"

namespace mha_ext::cuda {

// The stream an op launches on: the current CUDA stream of the current device.
cudaStream_t current_stream();

// The multiprocessor count of the current device, which sizes paged attention's split-K plan.
int multiprocessor_count();

struct Backend {
  // Index values stay in device memory: the kernels guard them (launchers.h).
  static constexpr bool kIndicesOnHost = false;

  struct NoPlan {};
  struct AttentionBackwardPlan {
    // Zero-filled [1, lse_elements * head_dim] (the lse layout's rows of head_dim): atomics
    // add dQ; undefined for a deterministic backward.
    at::Tensor grad_q_accum;
  };

  static NoPlan plan(AttentionForwardParams& params, const at::Tensor& like);
  static void run(const AttentionForwardParams& params, NoPlan);

  static AttentionBackwardPlan plan(AttentionBackwardParams& params, const at::Tensor& like);
  static void run(const AttentionBackwardParams& params, const AttentionBackwardPlan& plan);

  static void run(const DropoutMaskParams& params);

  // Slots outside the cache are skipped by the kernel.
  static NoPlan plan(PagedAppendParams& params, const at::Tensor& like);
  static void run(const PagedAppendParams& params, NoPlan);

  static NoPlan plan(PagedAttentionParams& params, const at::Tensor& like);
  static void run(const PagedAttentionParams& params, NoPlan);

  static NoPlan plan(MergeStatesParams& params, const at::Tensor& like);
  static void run(const MergeStatesParams& params, NoPlan);
};

}  // namespace mha_ext::cuda
