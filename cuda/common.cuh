// Shared device helpers for every lowbit kernel (cuda/<op>.cu).
//
// Compiled three ways: NVRTC through cupy.RawModule (lowbit/_kernels.py), NVRTC compile checks
// (lowbit/_nvrtc.py, tests/test_nvrtc.py), and g++ under the cudasim emulation header
// (cuda/cudasim.cuh force-included by lowbit/_cudasim_build.py, which defines
// LOWBIT_CUDASIM).
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

// Weight formats: the FMT template argument of quantize.cu and packed_matmul.cu (their
// launchers' _FORMAT_ID).
constexpr int kTernary = 0;
constexpr int kSign = 1;
constexpr int kInt8 = 2;

// Global index and stride of a 1-D grid-stride loop, in 64 bits: products of dimensions can
// pass 2^31.
__device__ __forceinline__ int64_t grid_index() {
    return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
    return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Float and double overloads of the libm functions the templated kernels call.
__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }
__device__ __forceinline__ float log1p_of(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_of(double x) { return log1p(x); }

// Round half to even (DESIGN.md: integer codes agree bitwise with np.rint on every backend).
__device__ __forceinline__ float round_even(float v) { return rintf(v); }
__device__ __forceinline__ double round_even(double v) { return rint(v); }

// Larger of two values; fmaxf/fmax for floating point (a NaN operand yields the other one).
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }

// Warp all-reduce: an xor butterfly, so every lane gets the result, in a fixed order
// (deterministic). Every lane of the warp must call it.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(kFullMask, v, offset);
    }
    return v;
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v = max_of(v, __shfl_xor_sync(kFullMask, v, offset));
    }
    return v;
}

// Bit packing, LSB-first (DESIGN.md): code j of a byte holds bits [j * BITS, (j + 1) * BITS).
constexpr int kBitsPerByte = 8;
template <int BITS>
constexpr int kCodesPerByte = kBitsPerByte / BITS;
// Code j of `byte`.
template <int BITS>
__device__ __forceinline__ unsigned unpack_code(unsigned byte, int j) {
    return (byte >> (j * BITS)) & ((1u << BITS) - 1u);
}
// `code` (below 2**BITS) moved to its place j in a byte, to be or-ed with the others.
template <int BITS>
__device__ __forceinline__ unsigned pack_code(unsigned code, int j) {
    return code << (j * BITS);
}

}  // namespace lowbit
