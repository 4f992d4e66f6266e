#pragma once
// Entry points of the CPU attention kernels, one set per compiled ISA, for the dispatcher
// (the ISA translation units define them without including this file). Each set is the same
// source (attention_kernel.h) compiled with that ISA's instructions enabled; cpu/isa.h picks
// one at run time. Non-x86 builds compile only DEFAULT.
#include "blocking.h"
#include "mha_ext/attention_params.h"

namespace mha_ext::cpu {

#define MHA_EXT_DECLARE_CPU_KERNELS(isa)                              \
  namespace isa {                                                     \
  void attention_forward(const AttentionForwardParams& params);      \
  void attention_backward(const AttentionBackwardParams& params);    \
  }

MHA_EXT_DECLARE_CPU_KERNELS(DEFAULT)
#if defined(__x86_64__)
MHA_EXT_DECLARE_CPU_KERNELS(AVX2)
MHA_EXT_DECLARE_CPU_KERNELS(AVX512)
#endif

#undef MHA_EXT_DECLARE_CPU_KERNELS

}  // namespace mha_ext::cpu
