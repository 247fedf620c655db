// RMS norm over the last axis with a weight (BitNet b1.58 / Llama: no mean subtracted, eps on
// the mean of the squares), forward and backward, for float and double. Launchers:
// lowbit/ops/rms_norm/_cuda.py; reference: reference/rms_norm.py; tests: tests/test_rms_norm.py.
//
// The row kernels give one warp to a row (blockDim.x / 32 rows per block): rows of a few
// thousand features need no block-wide reduction, and every output element is written by the
// one lane that owns it. The weight gradient sums over rows, so it takes two kernels without
// atomics: each block of the first sums one chunk of rows for kColumnThreads features into a
// partial row, the second adds the partials in chunk order. The results are bitwise
// deterministic.
#include "common.cuh"

namespace rms_norm {

//! Threads of a block of the row kernels (one warp per row).
constexpr int kRowThreads = 128;
//! Threads of a block of the weight-gradient kernels (one feature each).
constexpr int kColumnThreads = 128;

// Float and double square roots for the templated kernels (sqrtf keeps float in float).
__device__ __forceinline__ float sqrt_of(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_of(double v) { return sqrt(v); }

// The row this lane's warp owns.
__device__ __forceinline__ int64_t warp_row() {
    return static_cast<int64_t>(blockIdx.x) * (blockDim.x / lowbit::kWarpSize) +
           threadIdx.x / lowbit::kWarpSize;
}

}  // namespace rms_norm

// rstd = 1 / sqrt(mean(x^2) + eps), y = weight * (x * rstd) (BitNetRMSNorm's order).
// Grid: ceil(rows / (blockDim.x / 32)).
template <typename T>
__global__ void __launch_bounds__(rms_norm::kRowThreads)
rms_norm_fwd(const T* __restrict__ x,       // [rows, D]
             const T* __restrict__ weight,  // [D]
             T* __restrict__ y,             // [rows, D]
             T* __restrict__ rstd,          // [rows]
             int64_t rows, int64_t D, T eps) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t r = rms_norm::warp_row();
    if (r >= rows) return;  // whole warps leave together
    const T* xr = x + r * D;
    T s = 0;
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) s += xr[i] * xr[i];
    const T inv = T(1) / rms_norm::sqrt_of(lowbit::warp_sum(s) / static_cast<T>(D) + eps);
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) {
        y[r * D + i] = weight[i] * (xr[i] * inv);
    }
    if (lane == 0) rstd[r] = inv;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = weight * dy, xhat = x * rstd (recomputed).
template <typename T>
__global__ void __launch_bounds__(rms_norm::kRowThreads)
rms_norm_bwd(const T* __restrict__ dy,      // [rows, D]
             const T* __restrict__ x,       // [rows, D]
             const T* __restrict__ weight,  // [D]
             const T* __restrict__ rstd,    // [rows]
             T* __restrict__ dx,            // [rows, D]
             int64_t rows, int64_t D) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t r = rms_norm::warp_row();
    if (r >= rows) return;
    const T inv = rstd[r];
    const T* dyr = dy + r * D;
    const T* xr = x + r * D;
    T s = 0;
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) {
        s += (weight[i] * dyr[i]) * (xr[i] * inv);
    }
    const T m = lowbit::warp_sum(s) / static_cast<T>(D);
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) {
        dx[r * D + i] = inv * (weight[i] * dyr[i] - (xr[i] * inv) * m);
    }
}

// partial[k, c] = sum of dy[r, c] * x[r, c] * rstd[r] over the rows r of chunk k, in row order.
// Grid: (chunks, ceil(D / blockDim.x)).
template <typename T>
__global__ void __launch_bounds__(rms_norm::kColumnThreads)
rms_norm_dweight_partial(const T* __restrict__ dy,    // [rows, D]
                         const T* __restrict__ x,     // [rows, D]
                         const T* __restrict__ rstd,  // [rows]
                         T* __restrict__ partial,     // [chunks, D]
                         int64_t rows, int64_t D, int64_t chunk_rows) {
    const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const int64_t k = blockIdx.x;
    const int64_t begin = k * chunk_rows;
    const int64_t end = rows - begin < chunk_rows ? rows : begin + chunk_rows;
    T s = 0;
    for (int64_t r = begin; r < end; ++r) s += dy[r * D + c] * (x[r * D + c] * rstd[r]);
    partial[k * D + c] = s;
}

// dweight[c] = the partials of feature c added in chunk order. Grid: ceil(D / blockDim.x).
template <typename T>
__global__ void __launch_bounds__(rms_norm::kColumnThreads)
rms_norm_dweight_sum(const T* __restrict__ partial,  // [chunks, D]
                     T* __restrict__ dweight,        // [D]
                     int64_t chunks, int64_t D) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= D) return;
    T s = 0;
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * D + c];
    dweight[c] = s;
}
