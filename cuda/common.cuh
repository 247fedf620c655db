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

// Round half to even (docs/architecture.rst): integer codes agree bitwise with np.rint on every
// backend.
__device__ __forceinline__ float round_even(float v) { return rintf(v); }
__device__ __forceinline__ double round_even(double v) { return rint(v); }

// Larger of two values; fmaxf/fmax for floating point (a NaN operand yields the other one).
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }

// a * b + c rounded once: NVRTC compiles with -fmad=false, so a fused multiply-add is written.
__device__ __forceinline__ float fma_of(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_of(double a, double b, double c) { return fma(a, b, c); }

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

// Sums over parts of a warp whose lanes are split into groups of G (a power of two: the low lane
// bits) and columns (the bits above): group_sum adds over the G lanes of a group, column_sum over
// the columns; every lane taking part gets the same bits. Every lane of the warp must call them.
template <typename T>
__device__ __forceinline__ T group_sum(T x, int group) {
    for (int offset = 1; offset < group; offset *= 2) x += __shfl_xor_sync(kFullMask, x, offset);
    return x;
}
template <typename T>
__device__ __forceinline__ T column_sum(T x, int group) {
    for (int offset = group; offset < kWarpSize; offset *= 2) {
        x += __shfl_xor_sync(kFullMask, x, offset);
    }
    return x;
}

// column_sum of each of a thread's R values x (its entries r + a * G of one quantity, r its
// lane in the group), written to dst[r + a * G]. A reduce-scatter: each of the first log2(R)
// column steps trades half of the values still held with the partner lane (R / 2 + ... + 1
// shuffles in all, not R per step), so the sums end spread over the lanes; column bits past
// those are a butterfly of the one value left. x is consumed.
template <int R, typename T>
__device__ __forceinline__ void column_sums_to(T (&x)[R], int group, T* dst) {
    const int lane = threadIdx.x % kWarpSize, r = threadIdx.x % group;
    int first = 0, held = R;  // the entries a = first .. first + held - 1 are in x[0 .. held)
#pragma unroll
    for (int step = 0, half = R / 2; half > 0; ++step, half /= 2) {
        const int offset = group << step;
        if (offset >= kWarpSize) break;
        const bool upper = lane & offset;
#pragma unroll
        for (int m = 0; m < half; ++m) {
            const T keep = upper ? x[m + half] : x[m];
            const T send = upper ? x[m] : x[m + half];
            x[m] = keep + __shfl_xor_sync(kFullMask, send, offset);
        }
        if (upper) first += half;
        held = half;
    }
    for (int offset = group * R; offset < kWarpSize; offset *= 2) {
        x[0] += __shfl_xor_sync(kFullMask, x[0], offset);
    }
    // Past the reduce-scatter steps every lane of a group lane r holds the same sums.
    if (lane / group >= R) return;
#pragma unroll
    for (int m = 0; m < R; ++m) {
        if (m < held) dst[r + (first + m) * group] = x[m];
    }
}

// Bit packing, LSB-first (docs/ops.rst): code j of a byte holds bits [j * BITS, (j + 1) * BITS).
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

// ---------------------------------------------------------------------------------------------
// Tensor-core data movement: ldmatrix (sm_75) and cp.async (sm_80) behind device functions.
// Each has a portable twin (cudasim, or a GPU without the instruction) with the same per-lane
// result, so the CPU tests check the layout and the ordering the PTX path relies on.
// ---------------------------------------------------------------------------------------------
#if defined(LOWBIT_CUDASIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750)
#define LOWBIT_LDMATRIX_TWIN 1
#else
#define LOWBIT_LDMATRIX_TWIN 0
#endif
#if defined(LOWBIT_CUDASIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
#define LOWBIT_CP_ASYNC_TWIN 1
#else
#define LOWBIT_CP_ASYNC_TWIN 0
#endif

// Linear index of the calling thread in its block (its lane is this modulo kWarpSize).
__device__ __forceinline__ int thread_rank() {
    return static_cast<int>((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x);
}

// W 64-bit values of each lane of a full warp, for the twins of warp-wide instructions (which
// read other lanes' registers). On a GPU each read is a __shfl_sync, so every lane of the warp
// must make the same sequence of reads; under cudasim the values are exchanged once, when the
// object is built (one warp barrier instead of one per read).
template <int W>
class WarpValues {
  public:
    __device__ __forceinline__ explicit WarpValues(const unsigned long long (&mine)[W]) {
#if defined(LOWBIT_CUDASIM)
        lowbit_sim::warp_gather<W>(mine, all_);
#else
        for (int w = 0; w < W; ++w) mine_[w] = mine[w];
#endif
    }
    // Value `word` of lane `lane`.
    __device__ __forceinline__ unsigned long long operator()(int lane, int word) const {
#if defined(LOWBIT_CUDASIM)
        return all_[lane][word];
#else
        return __shfl_sync(kFullMask, mine_[word], lane);
#endif
    }

  private:
#if defined(LOWBIT_CUDASIM)
    unsigned long long all_[kWarpSize][W];
#else
    unsigned long long mine_[W];
#endif
};

// Twin of ldmatrix.x{N}: lane l receives word l % 4 of row l / 4 of matrix i in r[i], reading the
// row address that lane 8 i + l / 4 gave.
template <int N>
__device__ __forceinline__ void ldmatrix_twin(unsigned (&r)[N], const void* row) {
    const int lane = thread_rank() % kWarpSize;
    const unsigned long long mine[1] = {reinterpret_cast<unsigned long long>(row)};
    const WarpValues<1> rows(mine);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        r[i] = reinterpret_cast<const unsigned*>(rows(8 * i + lane / 4, 0))[lane % 4];
    }
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (not transposed): four 8 x 16-byte matrices; lanes
// 8 i .. 8 i + 7 give the shared-memory addresses of the rows of matrix i (16-byte aligned),
// and lane l receives 32-bit word l % 4 of row l / 4 of matrix i in r[i]. Every lane calls it.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#if LOWBIT_LDMATRIX_TWIN
    ldmatrix_twin<4>(r, row);
#else
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// The .x2 form: two matrices, row addresses from lanes 0..15 (the others' are ignored).
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
#if LOWBIT_LDMATRIX_TWIN
    ldmatrix_twin<2>(r, row);
#else
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
#endif
}

// cp.async of BYTES (4, 8 or 16; both addresses BYTES-aligned) from global to shared memory:
// the first src_bytes (0..BYTES) are copied, the rest of the destination is zero-filled (so
// src_bytes = 0 clears it without reading `global`). The copy lands only once a
// cp_async_wait<N>() covers the group it was committed in; until then the destination must be
// neither read nor written.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* shared, const void* global, int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(LOWBIT_CUDASIM)
    lowbit_sim::cp_async_issue(shared, global, BYTES, src_bytes);
#elif LOWBIT_CP_ASYNC_TWIN
    // No asynchronous copy on this GPU: a synchronous one is a valid schedule of it.
    unsigned char* d = static_cast<unsigned char*>(shared);
    const unsigned char* s = static_cast<const unsigned char*>(global);
    for (int i = 0; i < BYTES; ++i) d[i] = i < src_bytes ? s[i] : 0;
#else
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(shared));
    if constexpr (BYTES == 16) {
        // .cg: through L2 only; the data is used once from shared memory.
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(global),
                     "r"(src_bytes)
                     : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(addr), "l"(global),
                     "n"(BYTES), "r"(src_bytes)
                     : "memory");
    }
#endif
}

// Closes the group of this thread's cp.async calls since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(LOWBIT_CUDASIM)
    lowbit_sim::cp_async_commit();
#elif !LOWBIT_CP_ASYNC_TWIN
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most PENDING of this thread's committed groups are still in flight (the newest
// ones). Other threads see the copied data only after a barrier that follows the wait.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
#if defined(LOWBIT_CUDASIM)
    lowbit_sim::cp_async_wait(PENDING);
#elif !LOWBIT_CP_ASYNC_TWIN
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

}  // namespace lowbit
