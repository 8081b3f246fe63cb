// JFA_HOST_DEVICE: marks the small inline functions that the C++ (CPU) and CUDA kernels share, so
// both compute masks, score modifiers and the dropout stream with the very same code.
#pragma once

#if defined(__CUDACC__)
#define JFA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JFA_HOST_DEVICE inline
#endif

