// AVX2 + FMA build of the CPU kernels, run only on CPUs that report those features
// (cpu/isa.cpp).
//
// First what every build compiles for the baseline CPU (baseline_headers.h says why); after
// the target pragma, only this build's own code, in its namespace (CPU_CAPABILITY).
#include "baseline_headers.h"

// The target pragma stands in for per-file compiler flags, which torch.utils.cpp_extension
// cannot give to one source of an extension.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif
// GCC's target pragma enables the instructions but not the feature macros that sleef.h
// (included by at::vec) tests before declaring its vector functions; define them to match.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
// at::vec's lambdas get function-pointer thunks that GCC warns about; they are never called.
#pragma GCC diagnostic ignored "-Wpsabi"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "append_kernel.h"
#include "attention_kernel.h"
#include "paged_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
