#pragma once
// The type every backend's kernels accumulate an element type in: fp32 for fp32, bf16 and
// fp16 (the CPU's c10 types and CUDA's __half / __nv_bfloat16 alike), fp64 for fp64. The
// logsumexp outputs and the split workspaces are of this type too (attention_params.h,
// paged_params.h).

namespace mha_ext {

template <typename scalar_t>
struct AccumulateType {
  using type = float;
};
template <>
struct AccumulateType<double> {
  using type = double;
};

}  // namespace mha_ext
