// Saved-activation packing: per-group quantize-and-pack and unpack-and-dequantize in one pass
// each, plus the sparse (mask + 8-bit nonzeros) format. Launchers:
// lowbit/ops/saved_activation/_cuda.py; reference: reference/saved_activation.py; tests:
// tests/test_saved_activation.py.
//
// Bitwise agreement with the numpy and numba backends: float32 arithmetic with IEEE division
// and round-half-to-even (rintf), products and sums that NVCC could contract into an FMA written
// with __fmul_rn/__fadd_rn, and stochastic-rounding noise from an integer hash of
// (seed key, flat element index).
#include "common.cuh"

namespace saved_activation {

constexpr float kEps = 1e-5f;
// splitmix64 finalizer multipliers; the seed step is folded into `key` on the host.
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
// The noise keeps the top 24 hash bits: u = k * 2^-24, exact in float32.
constexpr int kNoiseShift = 40;
constexpr float kInvTwoPow24 = 5.9604644775390625e-08f;
constexpr int kStatusNonfinite = 1;
constexpr int kStatusNegative = 2;
// A task holds at most this many groups (enough for its first element to be byte-aligned).
constexpr int kMaxTaskGroups = 8;
constexpr int kMaxWarps = 32;
constexpr int kSparseCodeMax = 255;
// Start values of min/max reductions (a non-finite input is flagged separately).
constexpr float kFloatMax = 3.402823466e+38f;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#if defined(LOWBIT_CUDASIM)
// g++ in ISO C++ mode never contracts a * b + c, so plain operators round each step.
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float add_rn(float a, float b) { return a + b; }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
#endif

__device__ __forceinline__ float noise(uint64_t index, uint64_t key) {
    uint64_t z = index + key;
    z = (z ^ (z >> 30)) * kMix1;
    z = (z ^ (z >> 27)) * kMix2;
    z ^= z >> 31;
    return mul_rn(static_cast<float>(static_cast<uint32_t>(z >> kNoiseShift)), kInvTwoPow24);
}

// The code of v in a group with minimum lo and step scale; a positive value of a nonneg group
// never gets code 0, so the zero pattern survives packing.
__device__ __forceinline__ uint32_t quantize(float v, float lo, float scale, float levels,
                                             bool nonneg, bool stochastic, uint64_t index,
                                             uint64_t key) {
    const float t = (v - lo) / scale;
    float q = stochastic ? floorf(add_rn(t, noise(index, key))) : lowbit::round_even(t);
    q = fminf(fmaxf(q, 0.0f), levels);
    uint32_t c = static_cast<uint32_t>(q);
    if (nonneg && c == 0u && v > 0.0f) c = 1u;
    return c;
}

// Block-wide max of v; blockDim.x is a multiple of the warp size. Every thread gets the result.
// `scratch` holds kMaxWarps floats and is free again when this returns.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int warps = blockDim.x / lowbit::kWarpSize;
    v = lowbit::warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : -kFloatMax;
    r = lowbit::warp_max(r);
    __syncthreads();
    return r;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int warps = blockDim.x / lowbit::kWarpSize;
    v = lowbit::warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : 0.0f;
    r = lowbit::warp_sum(r);
    __syncthreads();
    return r;
}

// Exclusive prefix sum of v over the block in thread order; `total` gets the block sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int& total) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int warps = blockDim.x / lowbit::kWarpSize;
    int inclusive = v;
    for (int offset = 1; offset < lowbit::kWarpSize; offset *= 2) {
        const int up = __shfl_up_sync(lowbit::kFullMask, inclusive, offset);
        if (lane >= offset) inclusive += up;
    }
    if (lane == lowbit::kWarpSize - 1) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? scratch[lane] : 0;
        for (int offset = 1; offset < lowbit::kWarpSize; offset *= 2) {
            const int up = __shfl_up_sync(lowbit::kFullMask, w, offset);
            if (lane >= offset) w += up;
        }
        if (lane < warps) scratch[lane] = w;
    }
    __syncthreads();
    const int prefix = (warp > 0 ? scratch[warp - 1] : 0) + inclusive - v;
    total = scratch[warps - 1];
    __syncthreads();
    return prefix;
}

}  // namespace saved_activation

// One block per task: `groups_per_task` whole groups of one row, the first element of the task
// byte-aligned so no two blocks write the same packed byte. The block reduces each group's
// statistics, then packs the task's bytes (each thread builds whole bytes).
template <typename T, int BITS>
__global__ void pack_dense(const T* __restrict__ x,            // [rows, n]
                           uint8_t* __restrict__ codes,        // [rows, row_bytes]
                           float* __restrict__ scales,         // [rows, groups]
                           float* __restrict__ mins,           // [rows, groups] (unused: nonneg)
                           uint8_t* __restrict__ status,       // [rows, groups]
                           int64_t rows, int64_t n, int64_t row_bytes, int64_t groups,
                           int64_t group_size, int64_t groups_per_task, int32_t nonneg,
                           int32_t stochastic, uint64_t key) {
    using namespace saved_activation;
    constexpr int kPerByte = lowbit::kCodesPerByte<BITS>;
    const float levels = static_cast<float>((1 << BITS) - 1);
    __shared__ float scratch[kMaxWarps];
    __shared__ float task_lo[kMaxTaskGroups];
    __shared__ float task_scale[kMaxTaskGroups];
    const int64_t tasks_per_row = (groups + groups_per_task - 1) / groups_per_task;
    for (int64_t task = blockIdx.x; task < rows * tasks_per_row; task += gridDim.x) {
        const int64_t r = task / tasks_per_row;
        const int64_t g0 = (task - r * tasks_per_row) * groups_per_task;
        const int64_t g1 = min64(g0 + groups_per_task, groups);
        const T* row = x + r * n;
        for (int64_t g = g0; g < g1; ++g) {
            const int64_t stop = min64((g + 1) * group_size, n);
            float lo = kFloatMax, hi = -kFloatMax, bad = 0.0f;
            for (int64_t i = g * group_size + threadIdx.x; i < stop; i += blockDim.x) {
                const float v = static_cast<float>(row[i]);
                lo = fminf(lo, v);
                hi = fmaxf(hi, v);
                // v - v is 0 for every finite v, NaN for inf and NaN.
                if (!(v - v == 0.0f)) bad = 1.0f;
            }
            lo = -block_max(-lo, scratch);
            hi = block_max(hi, scratch);
            bad = block_max(bad, scratch);
            if (threadIdx.x == 0) {
                int flag = bad > 0.0f ? kStatusNonfinite : 0;
                if (nonneg) {
                    if (lo < 0.0f) flag |= kStatusNegative;
                    lo = 0.0f;
                }
                lo += 0.0f;  // a -0.0 minimum is stored as +0.0 on every backend
                const float scale = fmaxf(hi - lo, kEps) / levels;
                status[r * groups + g] = static_cast<uint8_t>(flag);
                scales[r * groups + g] = scale;
                if (!nonneg) mins[r * groups + g] = lo;
                task_lo[g - g0] = lo;
                task_scale[g - g0] = scale;
            }
        }
        __syncthreads();
        const int64_t first = g0 * group_size;
        const int64_t last = min64(g1 * group_size, n);
        const int64_t byte_end = (last + kPerByte - 1) / kPerByte;
        for (int64_t b = first / kPerByte + threadIdx.x; b < byte_end; b += blockDim.x) {
            uint32_t byte = 0;
#pragma unroll
            for (int j = 0; j < kPerByte; ++j) {
                const int64_t i = b * kPerByte + j;
                if (i < last) {
                    const int local = static_cast<int>(i / group_size - g0);
                    const uint32_t c = quantize(static_cast<float>(row[i]), task_lo[local],
                                                task_scale[local], levels, nonneg != 0,
                                                stochastic != 0,
                                                static_cast<uint64_t>(r * n + i), key);
                    byte |= lowbit::pack_code<BITS>(c, j);
                }
            }
            codes[r * row_bytes + b] = static_cast<uint8_t>(byte);
        }
        __syncthreads();  // task_lo / task_scale are rewritten by the next task
    }
}

// One thread per packed byte: reads it once and writes its kPerByte float32 values.
template <int BITS>
__global__ void unpack_dense(const uint8_t* __restrict__ codes,  // [rows, row_bytes]
                             const float* __restrict__ scales,   // [rows, groups]
                             const float* __restrict__ mins,     // [rows, groups] (unused: nonneg)
                             float* __restrict__ out,            // [rows, n]
                             int64_t rows, int64_t n, int64_t row_bytes, int64_t groups,
                             int64_t group_size, int32_t nonneg) {
    using namespace saved_activation;
    constexpr int kPerByte = lowbit::kCodesPerByte<BITS>;
    const int64_t total = rows * row_bytes;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t r = idx / row_bytes;
        const int64_t b = idx - r * row_bytes;
        const uint32_t byte = codes[idx];
#pragma unroll
        for (int j = 0; j < kPerByte; ++j) {
            const int64_t i = b * kPerByte + j;
            if (i < n) {
                const int64_t g = r * groups + i / group_size;
                const float step =
                    mul_rn(static_cast<float>(lowbit::unpack_code<BITS>(byte, j)), scales[g]);
                out[r * n + i] = nonneg ? step : add_rn(mins[g], step);
            }
        }
    }
}

// One block per chunk of 8 * blockDim.x elements, one thread per mask byte: writes the mask,
// the chunk's nonzero count and its status (non-finite, negative).
template <typename T>
__global__ void sparse_count(const T* __restrict__ flat,       // [size]
                             uint8_t* __restrict__ mask,       // [ceil(size / 8)]
                             int64_t* __restrict__ counts,     // [chunks]
                             uint8_t* __restrict__ status,     // [chunks]
                             int64_t size) {
    using namespace saved_activation;
    __shared__ float scratch[kMaxWarps];
    const int64_t mask_bytes = (size + 7) / 8;
    const int64_t chunks = (mask_bytes + blockDim.x - 1) / blockDim.x;
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const int64_t b = chunk * blockDim.x + threadIdx.x;
        uint32_t byte = 0;
        float bad = 0.0f, negative = 0.0f;
        if (b < mask_bytes) {
            for (int j = 0; j < 8 && b * 8 + j < size; ++j) {
                const float v = static_cast<float>(flat[b * 8 + j]);
                if (!(v - v == 0.0f)) bad = 1.0f;
                if (v < 0.0f) negative = 1.0f;
                if (v != 0.0f) byte |= 1u << j;
            }
            mask[b] = static_cast<uint8_t>(byte);
        }
        // Counts stay below 2^24, so the float sum is exact.
        const float count = block_sum(static_cast<float>(__popc(byte)), scratch);
        bad = block_max(bad, scratch);
        negative = block_max(negative, scratch);
        if (threadIdx.x == 0) {
            counts[chunk] = static_cast<int64_t>(count);
            status[chunk] = static_cast<uint8_t>((bad > 0.0f ? kStatusNonfinite : 0) |
                                                 (negative > 0.0f ? kStatusNegative : 0));
        }
    }
}

// Compacts the nonzeros of each chunk (as in sparse_count) to values[offsets[chunk] + ...], in
// row-major order, with their noise when rounding stochastically.
template <typename T>
__global__ void sparse_gather(const T* __restrict__ flat,          // [size]
                              const uint8_t* __restrict__ mask,    // [ceil(size / 8)]
                              const int64_t* __restrict__ offsets,  // [chunks]
                              float* __restrict__ values,          // [nnz]
                              float* __restrict__ noise_out,       // [nnz] (stochastic only)
                              int64_t size, int32_t stochastic, uint64_t key) {
    using namespace saved_activation;
    __shared__ int scratch[kMaxWarps];
    const int64_t mask_bytes = (size + 7) / 8;
    const int64_t chunks = (mask_bytes + blockDim.x - 1) / blockDim.x;
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const int64_t b = chunk * blockDim.x + threadIdx.x;
        const uint32_t byte = b < mask_bytes ? mask[b] : 0u;
        int total;
        int64_t k = offsets[chunk] + block_exclusive_scan(__popc(byte), scratch, total);
        for (int j = 0; j < 8; ++j) {
            if (byte & (1u << j)) {
                const int64_t i = b * 8 + j;
                values[k] = static_cast<float>(flat[i]);
                if (stochastic) noise_out[k] = noise(static_cast<uint64_t>(i), key);
                ++k;
            }
        }
    }
}

// One block per group of group_size compacted nonzeros: the group max, then 8-bit codes.
__global__ void sparse_quantize(const float* __restrict__ values,  // [nnz]
                                const float* __restrict__ noise_in,  // [nnz] (stochastic only)
                                uint8_t* __restrict__ codes,         // [nnz]
                                float* __restrict__ scales,          // [groups]
                                int64_t nnz, int64_t group_size, int32_t stochastic) {
    using namespace saved_activation;
    __shared__ float scratch[kMaxWarps];
    const int64_t groups = (nnz + group_size - 1) / group_size;
    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
        const int64_t stop = min64((g + 1) * group_size, nnz);
        float hi = 0.0f;
        for (int64_t k = g * group_size + threadIdx.x; k < stop; k += blockDim.x) {
            hi = fmaxf(hi, values[k]);
        }
        hi = block_max(hi, scratch);
        const float scale = fmaxf(hi, kEps) / static_cast<float>(kSparseCodeMax);
        if (threadIdx.x == 0) scales[g] = scale;
        for (int64_t k = g * group_size + threadIdx.x; k < stop; k += blockDim.x) {
            const float t = values[k] / scale;
            const float q = stochastic ? floorf(add_rn(t, noise_in[k])) : lowbit::round_even(t);
            // Every compacted value is positive: code 0 would turn it into a zero.
            codes[k] = static_cast<uint8_t>(fminf(fmaxf(q, 1.0f),
                                                  static_cast<float>(kSparseCodeMax)));
        }
    }
}

// Nonzeros per chunk of blockDim.x mask bytes (the chunks of sparse_count).
__global__ void sparse_popcount(const uint8_t* __restrict__ mask,  // [mask_bytes]
                                int64_t* __restrict__ counts,      // [chunks]
                                int64_t mask_bytes) {
    using namespace saved_activation;
    __shared__ float scratch[kMaxWarps];
    const int64_t chunks = (mask_bytes + blockDim.x - 1) / blockDim.x;
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const int64_t b = chunk * blockDim.x + threadIdx.x;
        const float count = block_sum(b < mask_bytes ? static_cast<float>(__popc(mask[b])) : 0.0f,
                                      scratch);
        if (threadIdx.x == 0) counts[chunk] = static_cast<int64_t>(count);
    }
}

// One thread per mask byte: writes its 8 outputs, zeros and dequantized nonzeros.
__global__ void sparse_scatter(const uint8_t* __restrict__ mask,    // [mask_bytes]
                               const uint8_t* __restrict__ codes,   // [nnz]
                               const float* __restrict__ scales,    // [groups]
                               const int64_t* __restrict__ offsets,  // [chunks]
                               float* __restrict__ out,             // [size]
                               int64_t size, int64_t group_size) {
    using namespace saved_activation;
    __shared__ int scratch[kMaxWarps];
    const int64_t mask_bytes = (size + 7) / 8;
    const int64_t chunks = (mask_bytes + blockDim.x - 1) / blockDim.x;
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const int64_t b = chunk * blockDim.x + threadIdx.x;
        const uint32_t byte = b < mask_bytes ? mask[b] : 0u;
        int total;
        int64_t k = offsets[chunk] + block_exclusive_scan(__popc(byte), scratch, total);
        if (b < mask_bytes) {
            for (int j = 0; j < 8 && b * 8 + j < size; ++j) {
                float v = 0.0f;
                if (byte & (1u << j)) {
                    v = mul_rn(static_cast<float>(codes[k]), scales[k / group_size]);
                    ++k;
                }
                out[b * 8 + j] = v;
            }
        }
    }
}
