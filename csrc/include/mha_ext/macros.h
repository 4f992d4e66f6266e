#pragma once
// Lets the shared math headers compile for the host (CPU kernels, C++ benchmarks)
// and for the device (CUDA kernels) from one definition.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define MHA_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MHA_EXT_HOST_DEVICE inline
#endif
