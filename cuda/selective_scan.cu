// The selective state-space scan, forward and backward, one warp per (batch, head): lane l owns
// the state rows p = l, l + 32, ... of S [P, N], kept in shared memory at stride 32 (each lane
// only touches its own column of the buffer: no bank conflicts, no barriers). Sequential over T
// with state checkpoints every `chunk` tokens; the backward sweeps the chunks in reverse,
// recomputing the states entering each token of a chunk from its checkpoint into a global
// scratch buffer. Sums over P (dB, dC, the step's gradient) are warp reductions; the per-head
// gradients are written per (batch, head) and summed over the batch by the launcher.
// Launchers: lowbit/ops/selective_scan/_cuda.py; reference: reference/selective_scan.py;
// tests: tests/test_selective_scan.py.
#include "common.cuh"

namespace selective {

// Lanes per block: one warp, so every reduction over P is a warp shuffle.
constexpr int kLanes = lowbit::kWarpSize;

using lowbit::exp_of;
using lowbit::log1p_of;
using lowbit::warp_sum;

// log(1 + exp(z)) without overflow: softplus(100) is 100.
template <typename T>
__device__ __forceinline__ T softplus(T z) {
    return (z > T(0) ? z : T(0)) + log1p_of(exp_of(z > T(0) ? -z : z));
}

// Token step: delta = max(softplus(z), floor) and the state decay a = exp(-exp(A_log) * delta).
template <typename T>
struct Step {
    T z, soft, delta, a;
};

template <typename T>
__device__ __forceinline__ Step<T> step(T dt, T bias, T rate, T floor) {
    Step<T> st;
    st.z = dt + bias;
    st.soft = softplus(st.z);
    st.delta = st.soft > floor ? st.soft : floor;
    st.a = exp_of(rate * st.delta);
    return st;
}

}  // namespace selective

// grid (B * H), block 32, dynamic shared ceil(P / 32) * N * 32 * sizeof(T).
template <typename T>
__global__ void selective_fwd(const T* __restrict__ x,        // [B, T, H, P]
                              const T* __restrict__ Bm,       // [B, T, H, N]
                              const T* __restrict__ Cm,       // [B, T, H, N]
                              const T* __restrict__ dt,       // [B, T, H]
                              const T* __restrict__ dt_bias,  // [H]
                              const T* __restrict__ A_log,    // [H]
                              const T* __restrict__ D,        // [H]
                              const T* __restrict__ s0,       // [B, H, P, N]
                              T* __restrict__ out,            // [B, T, H, P]
                              T* __restrict__ final_state,    // [B, H, P, N]
                              T* __restrict__ checkpoints,    // [B, H, nchunks, P, N]
                              int64_t n_tokens, int32_t H, int32_t P, int32_t N, T dt_floor,
                              int32_t chunk, int32_t nchunks, int32_t keep) {
    using namespace selective;
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* s = smem + threadIdx.x;  // s[(r * N + n) * kLanes]: row p = lane + r * kLanes
    const int64_t bh = blockIdx.x;
    const int64_t b = bh / H, h = bh % H;
    const int lane = threadIdx.x;
    const int64_t pn = static_cast<int64_t>(P) * N;
    const T rate = -exp_of(A_log[h]);
    for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
        for (int n = 0; n < N; ++n) s[(r * N + n) * kLanes] = s0[bh * pn + p * N + n];
    }
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int64_t row = (b * n_tokens + t) * H + h;  // (b, t, h)
        const Step<T> st = step(dt[row], dt_bias[h], rate, dt_floor);
        const T* B_t = Bm + row * N;
        const T* C_t = Cm + row * N;
        const bool ck = keep && t % chunk == 0;
        T* ck_t = checkpoints + (bh * nchunks + t / chunk) * pn;
        for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
            const T xp = x[row * P + p];
            const T dx = st.delta * xp;
            T o = D[h] * xp;
            for (int n = 0; n < N; ++n) {
                T* sn = s + (r * N + n) * kLanes;
                if (ck) ck_t[p * N + n] = *sn;
                const T v = st.a * *sn + B_t[n] * dx;
                *sn = v;
                o += v * C_t[n];
            }
            out[row * P + p] = o;
        }
    }
    for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
        for (int n = 0; n < N; ++n) final_state[bh * pn + p * N + n] = s[(r * N + n) * kLanes];
    }
}

// grid (B * H), block 32, dynamic shared 2 * ceil(P / 32) * (N + 1) * 32 * sizeof(T).
// ddt_bias, dA_log, dD: [B, H] rows, summed over the batch by the launcher.
template <typename T>
__global__ void selective_bwd(const T* __restrict__ x,            // [B, T, H, P]
                              const T* __restrict__ Bm,           // [B, T, H, N]
                              const T* __restrict__ Cm,           // [B, T, H, N]
                              const T* __restrict__ dt,           // [B, T, H]
                              const T* __restrict__ dt_bias,      // [H]
                              const T* __restrict__ A_log,        // [H]
                              const T* __restrict__ D,            // [H]
                              const T* __restrict__ checkpoints,  // [B, H, nchunks, P, N]
                              const T* __restrict__ dout,         // [B, T, H, P]
                              const T* __restrict__ dstate,       // [B, H, P, N]
                              T* __restrict__ scratch,            // [B, H, min(chunk, T), P, N]
                              T* __restrict__ dx,                 // [B, T, H, P]
                              T* __restrict__ dB,                 // [B, T, H, N]
                              T* __restrict__ dC,                 // [B, T, H, N]
                              T* __restrict__ ddt,                // [B, T, H]
                              T* __restrict__ ddt_bias,           // [B, H]
                              T* __restrict__ dA_log,             // [B, H]
                              T* __restrict__ dD,                 // [B, H]
                              T* __restrict__ dinit,              // [B, H, P, N]
                              int64_t n_tokens, int32_t H, int32_t P, int32_t N, T dt_floor,
                              int32_t chunk, int32_t nchunks) {
    using namespace selective;
    LOWBIT_DYNAMIC_SHARED(T, smem);
    const int rows_per_lane = (P + kLanes - 1) / kLanes;
    T* s = smem + threadIdx.x;                                 // [r][n] at stride kLanes
    T* ds = s + rows_per_lane * N * kLanes;                    // [r][n]
    T* gx = ds + rows_per_lane * N * kLanes;                   // [r]: gradient of x
    const int64_t bh = blockIdx.x;
    const int64_t b = bh / H, h = bh % H;
    const int lane = threadIdx.x;
    const bool lead = lane == 0;
    const int64_t pn = static_cast<int64_t>(P) * N;
    const int64_t span = chunk < n_tokens ? chunk : n_tokens;  // tokens held in scratch
    const T rate = -exp_of(A_log[h]);
    T bias_acc = T(0), alog_acc = T(0), d_acc = T(0);
    for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
        for (int n = 0; n < N; ++n) ds[(r * N + n) * kLanes] = dstate[bh * pn + p * N + n];
    }
    for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t t0 = c * chunk;
        const int64_t t1 = t0 + chunk < n_tokens ? t0 + chunk : n_tokens;
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t row = (b * n_tokens + t) * H + h;
            const Step<T> st = step(dt[row], dt_bias[h], rate, dt_floor);
            T* before = scratch + (bh * span + (t - t0)) * pn;
            const T* ck = checkpoints + (bh * nchunks + c) * pn;
            for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
                const T xd = st.delta * x[row * P + p];
                for (int n = 0; n < N; ++n) {
                    T* sn = s + (r * N + n) * kLanes;
                    if (t == t0) *sn = ck[p * N + n];
                    before[p * N + n] = *sn;
                    *sn = st.a * *sn + Bm[row * N + n] * xd;
                }
            }
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
            const int64_t row = (b * n_tokens + t) * H + h;
            const Step<T> st = step(dt[row], dt_bias[h], rate, dt_floor);
            const T* prev = scratch + (bh * span + (t - t0)) * pn;
            T d_part = T(0);
            for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
                const T do_p = dout[row * P + p];
                d_part += do_p * x[row * P + p];
                gx[r * kLanes] = D[h] * do_p;
            }
            d_acc += d_part;
            T da_part = T(0), ddelta = T(0);
            for (int n = 0; n < N; ++n) {
                const T bn = Bm[row * N + n];
                const T cn = Cm[row * N + n];
                T dc_part = T(0), xs_part = T(0);
                for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
                    const T xp = x[row * P + p];
                    const T do_p = dout[row * P + p];
                    const T pv = prev[p * N + n];
                    dc_part += do_p * (st.a * pv + bn * st.delta * xp);
                    T* dsn = ds + (r * N + n) * kLanes;
                    const T g = *dsn + do_p * cn;
                    da_part += g * pv;
                    xs_part += g * xp;
                    gx[r * kLanes] += g * st.delta * bn;
                    *dsn = g * st.a;
                }
                const T dcn = warp_sum(dc_part);
                const T xs = warp_sum(xs_part);
                if (lead) {
                    dC[row * N + n] = dcn;
                    dB[row * N + n] = st.delta * xs;
                }
                ddelta += bn * xs;
            }
            for (int p = lane, r = 0; p < P; p += kLanes, ++r) dx[row * P + p] = gx[r * kLanes];
            const T da = warp_sum(da_part);
            ddelta += da * st.a * rate;
            alog_acc += da * st.a * st.delta * rate;
            // sigmoid(z) = exp(-softplus(-z)); no gradient where the floor is active.
            const T gz = st.soft >= dt_floor ? ddelta * exp_of(-softplus(-st.z)) : T(0);
            if (lead) ddt[row] = gz;
            bias_acc += gz;
        }
    }
    for (int p = lane, r = 0; p < P; p += kLanes, ++r) {
        for (int n = 0; n < N; ++n) dinit[bh * pn + p * N + n] = ds[(r * N + n) * kLanes];
    }
    const T d_total = warp_sum(d_acc);
    if (lead) {
        ddt_bias[bh] = bias_acc;
        dA_log[bh] = alog_acc;
        dD[bh] = d_total;
    }
}
