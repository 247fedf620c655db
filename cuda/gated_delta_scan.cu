// The gated delta rule, forward and backward, one warp per (batch, head, slice of 32 columns of
// V): the columns of the state S [K, V] evolve independently, so each lane owns one column and
// keeps it in shared memory (its own stride-32 lane of the buffer: no bank conflicts, no
// barriers). Sequential over T with state checkpoints every `chunk` tokens; the backward sweeps
// the chunks in reverse, recomputing the states entering each token of a chunk from its
// checkpoint into a global scratch buffer. Sums over V (dq, dk, dlog_decay, dbeta) are warp
// reductions written per slice and summed by the launcher in a fixed order (no atomics).
// Launchers: lowbit/ops/gated_delta_scan/_cuda.py; reference: reference/gated_delta_scan.py;
// tests: tests/test_gated_delta_scan.py.
#include "common.cuh"

namespace gated_delta {

// Lanes per block: one warp, so every reduction over columns is a warp shuffle.
constexpr int kLanes = lowbit::kWarpSize;

using lowbit::exp_of;
using lowbit::warp_sum;

// Shapes and strides shared by the kernels.
struct Dims {
    int64_t T;
    int32_t H, K, V;
    int32_t Kd;     // 1 (one decay per head) or K (one per key row)
    int32_t chunk;  // tokens per checkpoint
    int32_t nchunks;
};

// Decay the lane's state column s (stride kLanes) by token t and return v_t[j] - s.T @ k_t
// (the residual). Inactive lanes (j >= V) return 0 and touch nothing.
template <typename T>
__device__ __forceinline__ T decay_and_residual(T* s, const T* __restrict__ k_t,
                                                const T* __restrict__ ld_t, T v_tj,
                                                const Dims& d, bool active) {
    if (!active) return T(0);
    T memory = T(0);
    T g = exp_of(ld_t[0]);
    for (int i = 0; i < d.K; ++i) {
        if (d.Kd > 1) g = exp_of(ld_t[i]);
        const T si = s[i * kLanes] * g;
        s[i * kLanes] = si;
        memory += k_t[i] * si;
    }
    return v_tj - memory;
}

}  // namespace gated_delta

// grid (B * H, ceil(V / 32)), block 32, dynamic shared K * 32 * sizeof(T).
template <typename T>
__global__ void gated_delta_fwd(const T* __restrict__ q,          // [B, T, H, K]
                                const T* __restrict__ k,          // [B, T, H, K]
                                const T* __restrict__ v,          // [B, T, H, V]
                                const T* __restrict__ log_decay,  // [B, T, H, Kd]
                                const T* __restrict__ beta,       // [B, T, H]
                                const T* __restrict__ s0,         // [B, H, K, V]
                                T* __restrict__ out,              // [B, T, H, V]
                                T* __restrict__ final_state,      // [B, H, K, V]
                                T* __restrict__ checkpoints,      // [B, H, nchunks, K, V]
                                int64_t n_tokens, int32_t H, int32_t K, int32_t V, int32_t Kd,
                                int32_t chunk, int32_t nchunks, int32_t keep) {
    using namespace gated_delta;
    const Dims d{n_tokens, H, K, V, Kd, chunk, nchunks};
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* s = smem + threadIdx.x;
    const int64_t bh = blockIdx.x;
    const int64_t b = bh / d.H, h = bh % d.H;
    const int64_t j = static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x;
    if (j >= d.V) return;  // no barriers or shuffles below: idle lanes may leave
    const int64_t kv = static_cast<int64_t>(d.K) * d.V;
    for (int i = 0; i < d.K; ++i) s[i * kLanes] = s0[bh * kv + i * d.V + j];
    for (int64_t t = 0; t < d.T; ++t) {
        const int64_t row = (b * d.T + t) * d.H + h;  // (b, t, h)
        if (keep && t % d.chunk == 0) {
            T* ck = checkpoints + (bh * d.nchunks + t / d.chunk) * kv + j;
            for (int i = 0; i < d.K; ++i) ck[i * d.V] = s[i * kLanes];
        }
        const T* k_t = k + row * d.K;
        const T* q_t = q + row * d.K;
        const T delta = beta[row] * decay_and_residual(s, k_t, log_decay + row * d.Kd,
                                                        v[row * d.V + j], d, true);
        T o = T(0);
        for (int i = 0; i < d.K; ++i) {
            const T si = s[i * kLanes] + k_t[i] * delta;
            s[i * kLanes] = si;
            o += q_t[i] * si;
        }
        out[row * d.V + j] = o;
    }
    for (int i = 0; i < d.K; ++i) final_state[bh * kv + i * d.V + j] = s[i * kLanes];
}

// grid (B * H, ceil(V / 32)), block 32, dynamic shared 2 * K * 32 * sizeof(T).
// dq, dk, dlog, dbeta are per-slice partial sums: [gridDim.y, ...].
template <typename T>
__global__ void gated_delta_bwd(const T* __restrict__ q,            // [B, T, H, K]
                                const T* __restrict__ k,            // [B, T, H, K]
                                const T* __restrict__ v,            // [B, T, H, V]
                                const T* __restrict__ log_decay,    // [B, T, H, Kd]
                                const T* __restrict__ beta,         // [B, T, H]
                                const T* __restrict__ checkpoints,  // [B, H, nchunks, K, V]
                                const T* __restrict__ dout,         // [B, T, H, V]
                                const T* __restrict__ dstate,       // [B, H, K, V]
                                T* __restrict__ scratch,            // [B, H, min(chunk, T), K, V]
                                T* __restrict__ dq,                 // [slices, B, T, H, K]
                                T* __restrict__ dk,                 // [slices, B, T, H, K]
                                T* __restrict__ dv,                 // [B, T, H, V]
                                T* __restrict__ dlog,               // [slices, B, T, H, Kd]
                                T* __restrict__ dbeta,              // [slices, B, T, H]
                                T* __restrict__ dinit,              // [B, H, K, V]
                                int64_t n_tokens, int32_t H, int32_t K, int32_t V, int32_t Kd,
                                int32_t chunk, int32_t nchunks) {
    using namespace gated_delta;
    const Dims d{n_tokens, H, K, V, Kd, chunk, nchunks};
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* s = smem + threadIdx.x;
    T* ds = smem + d.K * kLanes + threadIdx.x;
    const int64_t bh = blockIdx.x;
    const int64_t b = bh / d.H, h = bh % d.H;
    const int64_t j = static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x;
    // Every lane stays to the end: the warp sums below need all 32.
    const bool active = j < d.V;
    const bool lead = threadIdx.x == 0;
    const int64_t kv = static_cast<int64_t>(d.K) * d.V;
    const int64_t rows = static_cast<int64_t>(gridDim.x) * d.T;  // B * T * H
    const int64_t slice = blockIdx.y;
    const int64_t span = d.chunk < d.T ? d.chunk : d.T;  // tokens per chunk held in scratch
    for (int i = 0; i < d.K; ++i) ds[i * kLanes] = active ? dstate[bh * kv + i * d.V + j] : T(0);
    for (int64_t c = d.nchunks - 1; c >= 0; --c) {
        const int64_t t0 = c * d.chunk;
        const int64_t t1 = t0 + d.chunk < d.T ? t0 + d.chunk : d.T;
        if (active) {
            const T* ck = checkpoints + (bh * d.nchunks + c) * kv + j;
            for (int i = 0; i < d.K; ++i) s[i * kLanes] = ck[i * d.V];
        }
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t row = (b * d.T + t) * d.H + h;
            if (!active) continue;
            T* before = scratch + (bh * span + (t - t0)) * kv + j;
            for (int i = 0; i < d.K; ++i) before[i * d.V] = s[i * kLanes];
            if (t + 1 < t1) {
                const T* k_t = k + row * d.K;
                const T delta = beta[row] * decay_and_residual(s, k_t, log_decay + row * d.Kd,
                                                                v[row * d.V + j], d, true);
                for (int i = 0; i < d.K; ++i) s[i * kLanes] += k_t[i] * delta;
            }
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
            const int64_t row = (b * d.T + t) * d.H + h;
            const T* k_t = k + row * d.K;
            const T* q_t = q + row * d.K;
            const T* ld_t = log_decay + row * d.Kd;
            if (active) {
                const T* before = scratch + (bh * span + (t - t0)) * kv + j;
                for (int i = 0; i < d.K; ++i) s[i * kLanes] = before[i * d.V];
            }
            // s becomes token t's decayed state; the state after it is s + k_t * delta.
            const T bt = beta[row];
            const T residual = decay_and_residual(s, k_t, ld_t, active ? v[row * d.V + j] : T(0),
                                                  d, active);
            const T delta = bt * residual;
            const T do_j = active ? dout[row * d.V + j] : T(0);
            T ddelta = T(0);
            for (int i = 0; i < d.K; ++i) {
                const T si = active ? s[i * kLanes] : T(0);
                const T dqi = warp_sum(do_j * (si + k_t[i] * delta));
                if (lead) dq[(slice * rows + row) * d.K + i] = dqi;
                const T dsi = ds[i * kLanes] + do_j * q_t[i];
                ds[i * kLanes] = dsi;
                ddelta += k_t[i] * dsi;
            }
            if (active) dv[row * d.V + j] = bt * ddelta;
            const T dbt = warp_sum(residual * ddelta);
            if (lead) dbeta[slice * rows + row] = dbt;
            const T dmemory = -bt * ddelta;
            T dlog_sum = T(0);
            T g = exp_of(ld_t[0]);
            for (int i = 0; i < d.K; ++i) {
                if (d.Kd > 1) g = exp_of(ld_t[i]);
                const T si = active ? s[i * kLanes] : T(0);
                const T dsi = ds[i * kLanes];
                const T dki = warp_sum(dsi * delta + dmemory * si);
                if (lead) dk[(slice * rows + row) * d.K + i] = dki;
                const T dsd = dsi + dmemory * k_t[i];  // gradient of the decayed state
                if (d.Kd > 1) {
                    const T dli = warp_sum(dsd * si);
                    if (lead) dlog[(slice * rows + row) * d.Kd + i] = dli;
                } else {
                    dlog_sum += dsd * si;
                }
                ds[i * kLanes] = dsd * g;
            }
            if (d.Kd == 1) {
                const T dl = warp_sum(dlog_sum);
                if (lead) dlog[slice * rows + row] = dl;
            }
        }
    }
    if (active) {
        for (int i = 0; i < d.K; ++i) dinit[bh * kv + i * d.V + j] = ds[i * kLanes];
    }
}
