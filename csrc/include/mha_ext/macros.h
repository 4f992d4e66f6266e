#pragma once
// Lets the shared math headers compile for the host (CPU kernels, C++ benchmarks)
// and for the device (CUDA kernels) from one definition.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define MHA_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MHA_EXT_HOST_DEVICE inline
#endif

// The shared headers' functions (not their types: the params structs are one type for every
// backend) go between these. Compiled inside a CPU kernel build, which defines CPU_CAPABILITY
// (kernels/kernels_<isa>.cpp), they land in that build's namespace as the kernels' own code
// does: a copy in plain mha_ext::, compiled with that build's instructions, could be the copy
// the linker keeps for every caller, the portable build and the host code included.
#if defined(CPU_CAPABILITY) && !defined(__CUDACC__) && !defined(__HIPCC__)
#define MHA_EXT_BEGIN_ISA_NAMESPACE inline namespace CPU_CAPABILITY {
#define MHA_EXT_END_ISA_NAMESPACE }
#else
#define MHA_EXT_BEGIN_ISA_NAMESPACE
#define MHA_EXT_END_ISA_NAMESPACE
#endif
