#pragma once
// Entry points of the CPU kernels, one set per compiled ISA, for the dispatchers (the ISA
// translation units kernels_<isa>.cpp define them without including this file). Each set is
// the same source (attention_kernel.h, paged_kernel.h, append_kernel.h) compiled with that ISA's
// instructions enabled; cpu/isa.h picks one at run time. Non-x86 builds compile only DEFAULT.
#include "blocking.h"
#include "cpu/isa.h"
#include "mha_ext/attention_params.h"
#include "mha_ext/paged_params.h"

namespace mha_ext::cpu {

#define MHA_EXT_DECLARE_CPU_KERNELS(isa)                                               \
  namespace isa {                                                                      \
  void attention_forward(const AttentionForwardParams& params,                         \
                         const AttentionWorkspaces& workspaces);                       \
  void attention_backward(const AttentionBackwardParams& params,                       \
                          const AttentionWorkspaces& workspaces);                      \
  void paged_attention(const PagedAttentionParams& params, const PagedTaskPlan& plan); \
  void merge_attention_states(const MergeStatesParams& params);                        \
  void paged_kv_append(const PagedAppendParams& params);                               \
  }

MHA_EXT_DECLARE_CPU_KERNELS(DEFAULT)
#if defined(__x86_64__)
MHA_EXT_DECLARE_CPU_KERNELS(AVX2)
MHA_EXT_DECLARE_CPU_KERNELS(AVX512)
#endif

#undef MHA_EXT_DECLARE_CPU_KERNELS

// Runs the build of kernel `name` that cpu/isa.h chose for this CPU, with the kernel's
// arguments. The AVX-512 levels run the AVX-512 build, which asks the active ISA whether its
// AVX512-VNNI and AVX512-BF16 paths may run (avx512_vnni_enabled, avx512_bf16_enabled in
// kernel_common.h) and for which class.
#if defined(__x86_64__)
#define MHA_EXT_RUN_CPU_KERNEL(name, ...)                                                   \
  switch (::mha_ext::cpu::active_cpu_isa()) {                                               \
    case ::mha_ext::cpu::CpuIsa::kAvx512Amx:                                                \
    case ::mha_ext::cpu::CpuIsa::kAvx512Bf16:                                               \
    case ::mha_ext::cpu::CpuIsa::kAvx512Vnni:                                               \
    case ::mha_ext::cpu::CpuIsa::kAvx512: ::mha_ext::cpu::AVX512::name(__VA_ARGS__); break; \
    case ::mha_ext::cpu::CpuIsa::kAvx2: ::mha_ext::cpu::AVX2::name(__VA_ARGS__); break;     \
    default: ::mha_ext::cpu::DEFAULT::name(__VA_ARGS__);                                    \
  }
#else
#define MHA_EXT_RUN_CPU_KERNEL(name, ...) ::mha_ext::cpu::DEFAULT::name(__VA_ARGS__)
#endif

}  // namespace mha_ext::cpu
