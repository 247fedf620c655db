// Shared device helpers for every lowbit kernel (cuda/<op>.cu).
//
// Compiled three ways: NVRTC through cupy.RawModule (lowbit/_kernels.py), NVRTC compile checks
// (lowbit/_nvrtc.py, tests/test_nvrtc.py), and g++ under the cudasim emulation header
// (cuda/cudasim.cuh force-included by lowbit/_cudasim.py, which defines LOWBIT_CUDASIM).
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC has no C++ standard library headers; give kernels the fixed-width integer names.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#elif !defined(LOWBIT_CUDASIM)
#include <cstdint>
#endif

// Dynamic shared memory: the one way every kernel declares it. Under cudasim the emulation
// header provides lowbit_sim_dynamic_shared(), the current block's buffer of shared_mem bytes.
#if defined(LOWBIT_CUDASIM)
#define LOWBIT_DYNAMIC_SHARED(type, name) \
    type* name = reinterpret_cast<type*>(lowbit_sim_dynamic_shared())
#else
#define LOWBIT_DYNAMIC_SHARED(type, name)                              \
    extern __shared__ __align__(16) unsigned char lowbit_dyn_smem_[]; \
    type* name = reinterpret_cast<type*>(lowbit_dyn_smem_)
#endif

namespace lowbit {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Global index and stride of a 1-D grid-stride loop, in 64 bits: products of dimensions can
// pass 2^31.
__device__ __forceinline__ int64_t grid_index() {
    return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
    return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Warp-wide sum; every lane of the warp must call it.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(kFullMask, v, offset);
    }
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    }
    return v;
}

}  // namespace lowbit
