// Layer norm over the last axis (no affine parameters, biased variance, eps on the variance),
// forward and backward, for float and double. Launchers: lowbit/ops/layer_norm/_cuda.py;
// reference: reference/layer_norm.py; tests: tests/test_layer_norm.py.
//
// One warp per row (blockDim.x / 32 rows per block): rows of a few hundred features need no
// block-wide reduction, and every output element is written by the one lane that owns it, so the
// results are bitwise deterministic. The mean comes first, then the variance of the centred
// values (two passes over the row, which stays in L1/L2), so a large common offset does not
// cancel the variance away.
#include "common.cuh"

namespace {

// Float and double square roots for the templated kernels (sqrtf keeps float in float).
__device__ __forceinline__ float sqrt_of(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_of(double v) { return sqrt(v); }

// The row this lane's warp owns.
__device__ __forceinline__ int64_t warp_row() {
    return static_cast<int64_t>(blockIdx.x) * (blockDim.x / lowbit::kWarpSize) +
           threadIdx.x / lowbit::kWarpSize;
}

}  // namespace

// y = (x - mean) * rstd, rstd = 1 / sqrt(var + eps). Grid: ceil(rows / (blockDim.x / 32)).
template <typename T>
__global__ void layer_norm_fwd(const T* __restrict__ x,   // [rows, D]
                               T* __restrict__ y,         // [rows, D]
                               T* __restrict__ mean,      // [rows]
                               T* __restrict__ rstd,      // [rows]
                               int64_t rows, int64_t D, T eps) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t r = warp_row();
    if (r >= rows) return;  // whole warps leave together
    const T* xr = x + r * D;
    T s = 0;
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) s += xr[i];
    const T m = lowbit::warp_sum(s) / static_cast<T>(D);
    T q = 0;
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) q += (xr[i] - m) * (xr[i] - m);
    const T inv = T(1) / sqrt_of(lowbit::warp_sum(q) / static_cast<T>(D) + eps);
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) y[r * D + i] = (xr[i] - m) * inv;
    if (lane == 0) {
        mean[r] = m;
        rstd[r] = inv;
    }
}

// dx = rstd * (dy - mean(dy) - y * mean(dy * y)), from the normalized output y.
template <typename T>
__global__ void layer_norm_bwd(const T* __restrict__ dy,    // [rows, D]
                               const T* __restrict__ y,     // [rows, D]
                               const T* __restrict__ rstd,  // [rows]
                               T* __restrict__ dx,          // [rows, D]
                               int64_t rows, int64_t D) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t r = warp_row();
    if (r >= rows) return;
    T s1 = 0, s2 = 0;
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) {
        s1 += dy[r * D + i];
        s2 += dy[r * D + i] * y[r * D + i];
    }
    const T m1 = lowbit::warp_sum(s1) / static_cast<T>(D);
    const T m2 = lowbit::warp_sum(s2) / static_cast<T>(D);
    for (int64_t i = lane; i < D; i += lowbit::kWarpSize) {
        dx[r * D + i] = rstd[r] * (dy[r * D + i] - m1 - y[r * D + i] * m2);
    }
}
