// Portability macros so one definition of every layout/packing rule serves host C++ and CUDA.
#pragma once

#if defined(__CUDACC__)
#define TQ_HD __host__ __device__ __forceinline__
#define TQ_DEVICE __device__ __forceinline__
#define TQ_UNROLL _Pragma("unroll")
#else
#define TQ_HD inline
#define TQ_DEVICE inline
#define TQ_UNROLL
#endif
