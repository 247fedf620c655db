// BDH low-rank residual layer: strictly causal linear attention with rotary positions (forward
// and backward); its layer norms are cuda/layer_norm.cu's. Launchers:
// lowbit/ops/lowrank_residual/_cuda.py; reference: reference/lowrank_residual.py; tests:
// tests/test_lowrank_residual.py.
//
// Attention: Q = rope(x) on pairs (2j, 2j+1) of the N axis, a[t] = sum_{s < t, same segment}
// (Q_t . Q_s) v[s]. One block per (token, batch row); scores are computed kTile keys at a time
// into shared memory (never a T x T matrix) and the rotation is applied on the fly from the
// cos/sin tables. The backward block of token i gathers every term of dq[i] and dv[i] itself,
// so each output element is written by one thread: no atomics, bitwise deterministic.
#include "common.cuh"

namespace {

constexpr int kTile = 32;  // keys whose scores sit in shared memory at once

// Dot product of the rotated row x_s (token s, rotation tables row s) with a rotated vector q
// held in shared memory, reduced over the warp; every lane of the warp must call it.
__device__ __forceinline__ float rotated_dot(const float* __restrict__ xs,  // [N]
                                             const float* __restrict__ cs,  // [N / 2]
                                             const float* __restrict__ ss,  // [N / 2]
                                             const float* q,                // [N] shared
                                             int64_t half, int64_t n, int lane) {
    float p = 0.f;
    for (int64_t j = lane; j < half; j += lowbit::kWarpSize) {
        const float e = xs[2 * j], o = xs[2 * j + 1], c = cs[j], s = ss[j];
        p += q[2 * j] * (e * c - o * s) + q[2 * j + 1] * (o * c + e * s);
    }
    if ((n & 1) && lane == 0) p += q[n - 1] * xs[n - 1];
    return lowbit::warp_sum(p);
}

__device__ __forceinline__ float plain_dot(const float* __restrict__ a, const float* b,
                                           int64_t n, int lane) {
    float p = 0.f;
    for (int64_t i = lane; i < n; i += lowbit::kWarpSize) p += a[i] * b[i];
    return lowbit::warp_sum(p);
}

// Rotate x (global, token t) into q (shared); sign -1 rotates back (the transpose).
__device__ __forceinline__ void rotate_into(const float* __restrict__ x,   // [N]
                                            const float* __restrict__ cs,  // [N / 2]
                                            const float* __restrict__ ss,  // [N / 2]
                                            float* q,                      // [N]
                                            int64_t half, int64_t n, float sign) {
    for (int64_t j = threadIdx.x; j < half; j += blockDim.x) {
        const float e = x[2 * j], o = x[2 * j + 1], c = cs[j], s = sign * ss[j];
        q[2 * j] = e * c - o * s;
        q[2 * j + 1] = o * c + e * s;
    }
    if ((n & 1) && threadIdx.x == 0) q[n - 1] = x[n - 1];
}

}  // namespace

// Dynamic shared memory: (N + D + kTile) floats. Grid (T, B); blockDim a multiple of 32.
__global__ void causal_linear_fwd(const float* __restrict__ x,          // [B, T, N]
                                  const float* __restrict__ v,          // [B, T, D]
                                  const float* __restrict__ cos_t,      // [T, N / 2]
                                  const float* __restrict__ sin_t,      // [T, N / 2]
                                  const int64_t* __restrict__ seg_lo,   // [T] segment start
                                  float* __restrict__ out,              // [B, T, D]
                                  int64_t T, int64_t N, int64_t D) {
    LOWBIT_DYNAMIC_SHARED(float, smem);
    float* qt = smem;
    float* acc = qt + N;
    float* score = acc + D;
    const int64_t t = blockIdx.x, b = blockIdx.y, half = N / 2;
    const int lane = threadIdx.x % lowbit::kWarpSize, warp = threadIdx.x / lowbit::kWarpSize;
    const int warps = blockDim.x / lowbit::kWarpSize;
    rotate_into(x + (b * T + t) * N, cos_t + t * half, sin_t + t * half, qt, half, N, 1.f);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) acc[d] = 0.f;
    __syncthreads();
    for (int64_t s0 = seg_lo[t]; s0 < t; s0 += kTile) {
        const int count = static_cast<int>(t - s0 < kTile ? t - s0 : kTile);
        for (int k = warp; k < count; k += warps) {
            const int64_t s = s0 + k;
            const float p = rotated_dot(x + (b * T + s) * N, cos_t + s * half, sin_t + s * half,
                                        qt, half, N, lane);
            if (lane == 0) score[k] = p;
        }
        __syncthreads();
        for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
            float a = acc[d];
            for (int k = 0; k < count; ++k) a += score[k] * v[(b * T + s0 + k) * D + d];
            acc[d] = a;
        }
        __syncthreads();
    }
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) out[(b * T + t) * D + d] = acc[d];
}

// Block of token i: dq_i = sum_{j<i} (da_i . v_j) q_j + sum_{j>i} (da_j . v_i) q_j,
// dv_i = sum_{j>i} (q_j . q_i) da_j, j in i's segment; dx_i = rope^T(dq_i).
// Dynamic shared memory: (2 N + 3 D + 2 kTile) floats. Grid (T, B).
__global__ void causal_linear_bwd(const float* __restrict__ da,         // [B, T, D]
                                  const float* __restrict__ x,          // [B, T, N]
                                  const float* __restrict__ v,          // [B, T, D]
                                  const float* __restrict__ cos_t,      // [T, N / 2]
                                  const float* __restrict__ sin_t,      // [T, N / 2]
                                  const int64_t* __restrict__ seg_lo,   // [T] segment start
                                  const int64_t* __restrict__ seg_hi,   // [T] segment end
                                  float* __restrict__ dx,               // [B, T, N]
                                  float* __restrict__ dv,               // [B, T, D]
                                  int64_t T, int64_t N, int64_t D) {
    LOWBIT_DYNAMIC_SHARED(float, smem);
    float* qi = smem;
    float* dq = qi + N;
    float* dai = dq + N;
    float* vi = dai + D;
    float* dvacc = vi + D;
    float* coef = dvacc + D;
    float* pco = coef + kTile;
    const int64_t i = blockIdx.x, b = blockIdx.y, half = N / 2;
    const int lane = threadIdx.x % lowbit::kWarpSize, warp = threadIdx.x / lowbit::kWarpSize;
    const int warps = blockDim.x / lowbit::kWarpSize;
    rotate_into(x + (b * T + i) * N, cos_t + i * half, sin_t + i * half, qi, half, N, 1.f);
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) dq[n] = 0.f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        dai[d] = da[(b * T + i) * D + d];
        vi[d] = v[(b * T + i) * D + d];
        dvacc[d] = 0.f;
    }
    __syncthreads();
    const int64_t lo = seg_lo[i], hi = seg_hi[i];
    for (int64_t j0 = lo; j0 < hi; j0 += kTile) {
        const int count = static_cast<int>(hi - j0 < kTile ? hi - j0 : kTile);
        for (int k = warp; k < count; k += warps) {
            const int64_t j = j0 + k;
            float c = 0.f, p = 0.f;
            if (j < i) {
                c = plain_dot(v + (b * T + j) * D, dai, D, lane);
            } else if (j > i) {
                c = plain_dot(da + (b * T + j) * D, vi, D, lane);
                p = rotated_dot(x + (b * T + j) * N, cos_t + j * half, sin_t + j * half, qi,
                                half, N, lane);
            }
            if (lane == 0) {
                coef[k] = c;
                pco[k] = p;
            }
        }
        __syncthreads();
        for (int64_t m = threadIdx.x; m < half; m += blockDim.x) {
            float ge = dq[2 * m], go = dq[2 * m + 1];
            for (int k = 0; k < count; ++k) {
                const int64_t j = j0 + k;
                const float e = x[(b * T + j) * N + 2 * m], o = x[(b * T + j) * N + 2 * m + 1];
                const float cs = cos_t[j * half + m], sn = sin_t[j * half + m];
                ge += coef[k] * (e * cs - o * sn);
                go += coef[k] * (o * cs + e * sn);
            }
            dq[2 * m] = ge;
            dq[2 * m + 1] = go;
        }
        if ((N & 1) && threadIdx.x == 0) {
            float g = dq[N - 1];
            for (int k = 0; k < count; ++k) g += coef[k] * x[(b * T + j0 + k) * N + N - 1];
            dq[N - 1] = g;
        }
        for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
            float g = dvacc[d];
            for (int k = 0; k < count; ++k) g += pco[k] * da[(b * T + j0 + k) * D + d];
            dvacc[d] = g;
        }
        __syncthreads();
    }
    rotate_into(dq, cos_t + i * half, sin_t + i * half, dx + (b * T + i) * N, half, N, -1.f);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dv[(b * T + i) * D + d] = dvacc[d];
}
