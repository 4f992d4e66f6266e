// AVX-512 (F, BW, VL, DQ) build of the CPU kernels, run only on CPUs that report those
// features (cpu/isa.cpp), at four levels: avx512; avx512_vnni, which also runs the path that
// needs AVX512-VNNI (avx512_vnni_enabled in kernel_common.h); avx512_bf16, which adds the
// paths that need AVX512-BF16 (avx512_bf16_enabled); and avx512_amx, the same on the CPU class
// with AMX, tuned for it where the classes differ.
//
// First what every build compiles for the baseline CPU (baseline_headers.h says why); after
// the target pragma, only this build's own code, in its namespace (CPU_CAPABILITY).
#include "baseline_headers.h"

// The target pragma stands in for per-file compiler flags, which torch.utils.cpp_extension
// cannot give to one source of an extension.
#if defined(__clang__)
#pragma clang attribute push(                                                         \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
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
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
// at::vec's lambdas get function-pointer thunks that GCC warns about; they are never called.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's AVX-512 intrinsics pass a self-initialised "undefined" vector as the unused merge
// source, which it then reports as used uninitialised wherever they are inlined (GCC bug
// 105593, fixed in 13): over 5000 lines of warnings per build that would hide real ones.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "append_kernel.h"
#include "attention_kernel.h"
#include "paged_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
