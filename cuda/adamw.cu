// AdamW optimizer step: one fused pass per parameter, and the sum of squares of a gradient for
// the global-norm clipping. Launchers: lowbit/ops/adamw/_cuda.py; reference: reference/adamw.py;
// tests: tests/test_adamw.py.
//
// adamw_step updates param, exp_avg and exp_avg_sq in place (the optimizer's documented
// exception to "inputs are never modified"); every other argument is read only.
#include "common.cuh"

namespace lowbit_adamw {

// Threads per block of every kernel here: adamw_sum's block reduction sizes its shared array
// from it, so the launcher must launch exactly this many.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / lowbit::kWarpSize;

__device__ __forceinline__ float sqrt_of(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_of(double x) { return sqrt(x); }

}  // namespace lowbit_adamw

// One grid-stride pass: read p, g, m, v once, write p, m, v. T is the parameter's type and the
// type of the arithmetic (float for float32 parameters); the moments are stored as float, and the
// update uses the stored (rounded) moments, so a run resumed from a saved state continues with
// exactly the numbers it would have used. Every coefficient is precomputed on the host in T.
template <typename T>
__global__ void adamw_step(T* __restrict__ param,             // [n], updated in place
                           const T* __restrict__ grad,        // [n]
                           float* __restrict__ exp_avg,       // [n], updated in place
                           float* __restrict__ exp_avg_sq,    // [n], updated in place
                           int64_t n,
                           T decay,            // 1 - lr * weight_decay
                           T one_minus_beta1,  // 1 - beta1
                           T beta2,
                           T one_minus_beta2,  // 1 - beta2
                           T eps,
                           T step_size,        // lr / (1 - beta1^t)
                           T sqrt_bias2,       // sqrt(1 - beta2^t)
                           T grad_scale) {     // clipping coefficient (1 when not clipping)
    using lowbit_adamw::sqrt_of;
    for (int64_t i = lowbit::grid_index(); i < n; i += lowbit::grid_stride()) {
        const T g = grad[i] * grad_scale;
        T m = static_cast<T>(exp_avg[i]);
        m = m + one_minus_beta1 * (g - m);
        T v = static_cast<T>(exp_avg_sq[i]);
        v = v * beta2 + one_minus_beta2 * g * g;
        const float m_stored = static_cast<float>(m);
        const float v_stored = static_cast<float>(v);
        exp_avg[i] = m_stored;
        exp_avg_sq[i] = v_stored;
        const T denom = sqrt_of(static_cast<T>(v_stored)) / sqrt_bias2 + eps;
        param[i] = param[i] * decay - step_size * (static_cast<T>(m_stored) / denom);
    }
}

// Sum (SQUARE: sum of squares) of x in double, one partial per block: each thread accumulates its
// grid-stride elements in order, then a fixed butterfly within each warp and a fixed sum over the
// warps. The order depends only on n and the grid size, so the result is bitwise reproducible
// (no atomics). The launcher runs it twice for a large x: squares into per-block partials, then
// one block summing the partials (SQUARE false).
template <typename G, bool SQUARE>
__global__ void adamw_sum(const G* __restrict__ x,     // [n]
                          double* __restrict__ out,    // [gridDim.x]
                          int64_t n) {
    using namespace lowbit_adamw;
    __shared__ double warp_total[kWarps];
    double acc = 0.0;
    for (int64_t i = lowbit::grid_index(); i < n; i += lowbit::grid_stride()) {
        const double v = static_cast<double>(x[i]);
        acc += SQUARE ? v * v : v;
    }
    acc = lowbit::warp_sum(acc);
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    if (lane == 0) warp_total[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        double total = lane < kWarps ? warp_total[lane] : 0.0;
        total = lowbit::warp_sum(total);
        if (lane == 0) out[blockIdx.x] = total;
    }
}
