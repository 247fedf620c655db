// The selective state-space scan, forward and backward. The rows p of the state S [P, N] evolve
// independently, so a block takes `cols` rows p of one (batch, head) and each is held by a group
// of G threads (a power of two up to 32): thread r of the group keeps the entries
// n = r, r + G, ..., r + (kStates - 1) * G of it in registers. Splitting N over G threads fills
// a GPU where one thread per p would not (B * H * P threads), and the one sum over N per token
// (S C) is log2(G) shuffles inside the group; the update needs none. Strided entries make the
// group's reads of a staged B or C hit G consecutive words (no bank conflicts).
//
// Per tile of tokens, the block stages what its rows share (B, C and the step: delta, decay) and
// its slice of x in shared memory with coalesced loads, and writes its outputs back through
// shared memory, coalesced. The forward keeps the state entering every `chunk` tokens; the
// backward sweeps the chunks in reverse: it recomputes from the chunk's checkpoint the state
// entering each tile of kBwdTile tokens into a global scratch laid out thread by thread
// (coalesced), then per tile, in reverse, the states entering its tokens in registers. Sums over P
// (dB, dC, the step's gradient, dD) are reduced over the warp's rows p by shuffles (a
// reduce-scatter for the per-entry ones), over the block's warps through shared memory in warp
// order, and written per block along P: the launcher adds those partials (and the per-head ones
// over the batch) in a fixed order (no atomics, bitwise deterministic).
// Launchers: lowbit/ops/selective_scan/_cuda.py; reference: reference/selective_scan.py;
// tests: tests/test_selective_scan.py.
#include "common.cuh"

namespace selective {

// State entries per thread, in registers: N <= kStates * kMaxGroup.
constexpr int kStates = 8;
// Threads per row p at most: one warp, so the sum over N is a shuffle.
constexpr int kMaxGroup = lowbit::kWarpSize;
static_assert((kStates & (kStates - 1)) == 0 && kMaxGroup == lowbit::kWarpSize,
              "groups are powers of two within a warp; the reduce-scatter halves kStates");
// Threads per block at most (the launchers' block sizes).
constexpr int kMaxThreads = 256;
// Blocks per SM the launch bounds ask for: given none, ptxas caps registers low and spills.
constexpr int kMinBlocks = 1;
// The backward in float asks for two: it fits in 128 registers without spilling, so at Bt = 16,
// H = 8, P = N = 64 all 256 blocks are resident at once on a 132-SM GPU.
template <typename T>
constexpr int kBwdMinBlocks = sizeof(T) == sizeof(float) ? 2 : kMinBlocks;
// Tokens staged in shared memory per tile, forward and backward. The backward keeps the states
// entering a tile's tokens in registers (kBwdTile * kStates of them).
constexpr int kFwdTile = 16;
constexpr int kBwdTile = 2;

using lowbit::exp_of;
using lowbit::kFullMask;
using lowbit::kWarpSize;
using lowbit::log1p_of;

using lowbit::column_sum;
using lowbit::column_sums_to;
using lowbit::fma_of;
using lowbit::group_sum;

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

// Where one thread sits, and the shapes every kernel shares.
struct Place {
    int64_t T;
    int32_t H, P, N;
    int group, r, col, cols, np;  // np = group * kStates: the padded entries of a staged vector
    int64_t bh, b, h, p0, p;
    bool active;                  // p < P
};

__device__ __forceinline__ Place place(int64_t n_tokens, int32_t H, int32_t P, int32_t N,
                                       int32_t group) {
    Place q;
    q.T = n_tokens;
    q.H = H;
    q.P = P;
    q.N = N;
    q.group = group;
    q.r = threadIdx.x % group;
    q.col = threadIdx.x / group;
    q.cols = blockDim.x / group;
    q.np = group * kStates;
    // 32-bit division (gridDim.x < 2^31): a 64-bit one is a called subroutine.
    const int bh = static_cast<int>(blockIdx.x);
    q.bh = bh;
    q.b = bh / H;
    q.h = bh % H;
    q.p0 = static_cast<int64_t>(blockIdx.y) * q.cols;
    q.p = q.p0 + q.col;
    q.active = q.p < P;
    return q;
}

// Row (b, t, h) of the [Bt, T, H, ...] inputs.
__device__ __forceinline__ int64_t row_of(const Place& q, int64_t t) {
    return (q.b * q.T + t) * q.H + q.h;
}

// Stage tokens [t0, t0 + n) of B and C ([tile][np], zero past N), the step (delta and a) and
// the block's rows p of each `ins[i]` ([Bt, T, H, P]) into outs[i] ([tile][cols], zero past P).
// Every thread of the block calls it.
template <typename T, int NIN>
__device__ __forceinline__ void stage(const Place& q, int64_t t0, int n,
                                      const T* __restrict__ Bm, const T* __restrict__ Cm,
                                      const T* __restrict__ dt, T bias, T rate, T floor,
                                      const T* const (&ins)[NIN], T* const (&outs)[NIN], T* B_s,
                                      T* C_s, T* delta_s, T* a_s) {
    for (int e = threadIdx.x; e < n * q.np; e += blockDim.x) {
        const int tt = e / q.np, i = e % q.np;
        const int64_t row = row_of(q, t0 + tt);
        B_s[e] = i < q.N ? Bm[row * q.N + i] : T(0);
        C_s[e] = i < q.N ? Cm[row * q.N + i] : T(0);
    }
    for (int e = threadIdx.x; e < n * q.cols; e += blockDim.x) {
        const int tt = e / q.cols, c = e % q.cols;
        const int64_t p = q.p0 + c, row = row_of(q, t0 + tt);
#pragma unroll
        for (int a = 0; a < NIN; ++a) outs[a][e] = p < q.P ? ins[a][row * q.P + p] : T(0);
    }
    for (int tt = threadIdx.x; tt < n; tt += blockDim.x) {
        const Step<T> st = step(dt[row_of(q, t0 + tt)], bias, rate, floor);
        delta_s[tt] = st.delta;
        a_s[tt] = st.a;
    }
}

// Write tokens [t0, t0 + n) of a [tile][cols] shared tile to the block's rows p of `dst`
// ([Bt, T, H, P]).
template <typename T>
__device__ __forceinline__ void store_columns(const Place& q, int64_t t0, int n, const T* tile,
                                              T* __restrict__ dst) {
    for (int e = threadIdx.x; e < n * q.cols; e += blockDim.x) {
        const int tt = e / q.cols, c = e % q.cols;
        const int64_t p = q.p0 + c;
        if (p < q.P) dst[row_of(q, t0 + tt) * q.P + p] = tile[e];
    }
}

// The thread's entries of a [P, N] state matrix: load (zero outside it) and store.
template <typename T>
__device__ __forceinline__ void load_state(const Place& q, const T* __restrict__ m, T* s) {
#pragma unroll
    for (int a = 0; a < kStates; ++a) {
        const int i = q.r + a * q.group;
        s[a] = q.active && i < q.N ? m[q.p * q.N + i] : T(0);
    }
}
template <typename T>
__device__ __forceinline__ void store_state(const Place& q, const T* s, T* __restrict__ m) {
    if (!q.active) return;
#pragma unroll
    for (int a = 0; a < kStates; ++a) {
        const int i = q.r + a * q.group;
        if (i < q.N) m[q.p * q.N + i] = s[a];
    }
}

}  // namespace selective

// grid (Bt * H, ceil(P / cols)), block group * cols (at most kMaxThreads, whole warps), dynamic
// shared kFwdTile * (2 * group * kStates + 2 + 2 * cols) * sizeof(T).
template <typename T>
__global__ void __launch_bounds__(selective::kMaxThreads, selective::kMinBlocks)
    selective_fwd(const T* __restrict__ x,        // [Bt, T, H, P]
                  const T* __restrict__ Bm,       // [Bt, T, H, N]
                  const T* __restrict__ Cm,       // [Bt, T, H, N]
                  const T* __restrict__ dt,       // [Bt, T, H]
                  const T* __restrict__ dt_bias,  // [H]
                  const T* __restrict__ A_log,    // [H]
                  const T* __restrict__ D,        // [H]
                  const T* __restrict__ s0,       // [Bt, H, P, N]
                  T* __restrict__ out,            // [Bt, T, H, P]
                  T* __restrict__ final_state,    // [Bt, H, P, N]
                  T* __restrict__ checkpoints,    // [Bt, H, nchunks, P, N]
                  int64_t n_tokens, int32_t H, int32_t P, int32_t N, T dt_floor,
                  int32_t chunk, int32_t nchunks, int32_t keep, int32_t group) {
    using namespace selective;
    const Place q = place(n_tokens, H, P, N, group);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* B_s = smem;                       // [kFwdTile][np]
    T* C_s = B_s + kFwdTile * q.np;      // [kFwdTile][np]
    T* delta_s = C_s + kFwdTile * q.np;  // [kFwdTile]
    T* a_s = delta_s + kFwdTile;         // [kFwdTile]
    T* x_s = a_s + kFwdTile;             // [kFwdTile][cols]
    T* o_s = x_s + kFwdTile * q.cols;    // [kFwdTile][cols]
    const int64_t pn = static_cast<int64_t>(P) * N;
    const T rate = -exp_of(A_log[q.h]);
    const T bias = dt_bias[q.h], skip = D[q.h];
    const T* const ins[1] = {x};
    T* const outs[1] = {x_s};
    T s[kStates];
    load_state(q, s0 + q.bh * pn, s);
    int64_t next_checkpoint = 0, checkpoint = 0;  // counters, not t % chunk (a 64-bit division)
    for (int64_t t0 = 0; t0 < q.T; t0 += kFwdTile) {
        const int n = q.T - t0 < kFwdTile ? static_cast<int>(q.T - t0) : kFwdTile;
        __syncthreads();  // the previous tile is computed: its outputs are in o_s
        if (t0 > 0) store_columns(q, t0 - kFwdTile, kFwdTile, o_s, out);
        stage(q, t0, n, Bm, Cm, dt, bias, rate, dt_floor, ins, outs, B_s, C_s, delta_s, a_s);
        __syncthreads();
        for (int tt = 0; tt < n; ++tt) {
            const int64_t t = t0 + tt;
            if (keep && t == next_checkpoint) {
                store_state(q, s, checkpoints + (q.bh * nchunks + checkpoint) * pn);
                next_checkpoint += chunk;
                ++checkpoint;
            }
            const T* B_t = B_s + tt * q.np + q.r;
            const T* C_t = C_s + tt * q.np + q.r;
            const T a = a_s[tt];
            const T xp = x_s[tt * q.cols + q.col];
            const T dx = delta_s[tt] * xp;
            T o = T(0);
#pragma unroll
            for (int e = 0; e < kStates; ++e) {
                s[e] = fma_of(a, s[e], B_t[e * q.group] * dx);
                o = fma_of(s[e], C_t[e * q.group], o);
            }
            o = group_sum(o, q.group);
            if (q.r == 0) o_s[tt * q.cols + q.col] = fma_of(skip, xp, o);
        }
    }
    __syncthreads();
    const int64_t last = (q.T - 1) / kFwdTile * kFwdTile;
    store_columns(q, last, static_cast<int>(q.T - last), o_s, out);
    store_state(q, s, final_state + q.bh * pn);
}

namespace selective {

// Per-warp partial sums of one backward tile, [warps][kBwdTile][red_width(np)]: the dC rows,
// the rows of sum_p ds * x (dB / delta), then sum_n B * that, the decay's gradient, dD's, and
// (warp 0) the token's delta.
__device__ __forceinline__ int red_width(int np) { return 2 * np + 4; }

// Add the tile's per-warp partials in warp order and write tokens [t0, t0 + n) of the block's
// partial rows of dB, dC, ddt (slice blockIdx.y) and of dx; thread 0 adds the per-head sums in
// reverse token order.
template <typename T>
__device__ __forceinline__ void flush(const Place& q, int64_t t0, int n, const T* red,
                                      const T* dx_s, const T* __restrict__ dt, T bias, T rate,
                                      T floor, T* __restrict__ dx, T* __restrict__ dB,
                                      T* __restrict__ dC, T* __restrict__ ddt, T& bias_acc,
                                      T& alog_acc, T& d_acc) {
    const int warps = blockDim.x / kWarpSize, width = red_width(q.np);
    const int64_t rows = static_cast<int64_t>(gridDim.x) * q.T;  // Bt * T * H
    const int64_t slice = blockIdx.y;
    for (int e = threadIdx.x; e < n * width; e += blockDim.x) {
        const int tt = e / width, f = e % width;
        const int part = f / q.np, i = f % q.np;
        if (part > 1 || i >= q.N) continue;
        T total = T(0);
        for (int w = 0; w < warps; ++w) total += red[(w * kBwdTile + tt) * width + f];
        const int64_t at = (slice * rows + row_of(q, t0 + tt)) * q.N + i;
        if (part == 0) dC[at] = total;
        else dB[at] = red[tt * width + 2 * q.np + 3] * total;
    }
    if (threadIdx.x == 0) {
        for (int tt = n - 1; tt >= 0; --tt) {
            T bx = T(0), da = T(0), dd = T(0);
            for (int w = 0; w < warps; ++w) {
                const T* red_t = red + (w * kBwdTile + tt) * width + 2 * q.np;
                bx += red_t[0];
                da += red_t[1];
                dd += red_t[2];
            }
            const int64_t row = row_of(q, t0 + tt);
            const Step<T> st = step(dt[row], bias, rate, floor);
            const T ddelta = fma_of(da * st.a, rate, bx);
            alog_acc += da * st.a * st.delta * rate;
            // sigmoid(z) = exp(-softplus(-z)); no gradient where the floor is active.
            const T gz = st.soft >= floor ? ddelta * exp_of(-softplus(-st.z)) : T(0);
            ddt[slice * rows + row] = gz;
            bias_acc += gz;
            d_acc += dd;
        }
    }
    store_columns(q, t0, n, dx_s, dx);
}

}  // namespace selective

// grid (Bt * H, ceil(P / cols)), block group * cols, dynamic shared
// kBwdTile * (2 * np + 2 + 3 * cols + warps * (2 * np + 4)) * sizeof(T), np = group * kStates.
// dB, dC, ddt and the per-head ddt_bias, dA_log, dD are per-block partial sums along P:
// [gridDim.y, ...] (the per-head ones [gridDim.y, Bt, H]).
template <typename T>
__global__ void __launch_bounds__(selective::kMaxThreads, selective::kBwdMinBlocks<T>)
    selective_bwd(const T* __restrict__ x,            // [Bt, T, H, P]
                  const T* __restrict__ Bm,           // [Bt, T, H, N]
                  const T* __restrict__ Cm,           // [Bt, T, H, N]
                  const T* __restrict__ dt,           // [Bt, T, H]
                  const T* __restrict__ dt_bias,      // [H]
                  const T* __restrict__ A_log,        // [H]
                  const T* __restrict__ D,            // [H]
                  const T* __restrict__ checkpoints,  // [Bt, H, nchunks, P, N]
                  const T* __restrict__ dout,         // [Bt, T, H, P]
                  const T* __restrict__ dstate,       // [Bt, H, P, N]
                  T* __restrict__ scratch,  // [Bt * H * gridDim.y, tiles per chunk, kStates,
                                            //  blockDim.x]
                  T* __restrict__ dx,        // [Bt, T, H, P]
                  T* __restrict__ dB,        // [gridDim.y, Bt, T, H, N]
                  T* __restrict__ dC,        // [gridDim.y, Bt, T, H, N]
                  T* __restrict__ ddt,       // [gridDim.y, Bt, T, H]
                  T* __restrict__ ddt_bias,  // [gridDim.y, Bt, H]
                  T* __restrict__ dA_log,    // [gridDim.y, Bt, H]
                  T* __restrict__ dD,        // [gridDim.y, Bt, H]
                  T* __restrict__ dinit,     // [Bt, H, P, N]
                  int64_t n_tokens, int32_t H, int32_t P, int32_t N, T dt_floor,
                  int32_t chunk, int32_t nchunks, int32_t group) {
    using namespace selective;
    const Place q = place(n_tokens, H, P, N, group);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    const int width = red_width(q.np);
    T* B_s = smem;                       // [kBwdTile][np]
    T* C_s = B_s + kBwdTile * q.np;      // [kBwdTile][np]
    T* delta_s = C_s + kBwdTile * q.np;  // [kBwdTile]
    T* a_s = delta_s + kBwdTile;         // [kBwdTile]
    T* x_s = a_s + kBwdTile;             // [kBwdTile][cols]
    T* do_s = x_s + kBwdTile * q.cols;   // [kBwdTile][cols]
    T* dx_s = do_s + kBwdTile * q.cols;  // [kBwdTile][cols]
    T* red = dx_s + kBwdTile * q.cols;   // [warps][kBwdTile][width]
    const int warp = threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int64_t pn = static_cast<int64_t>(P) * N;
    const int64_t span = chunk < q.T ? chunk : q.T;
    const T rate = -exp_of(A_log[q.h]);
    const T bias = dt_bias[q.h], skip = D[q.h];
    const T* const x_in[1] = {x};
    T* const x_out[1] = {x_s};
    const T* const both_in[2] = {x, dout};
    T* const both_out[2] = {x_s, do_s};
    const int64_t per_chunk = (span + kBwdTile - 1) / kBwdTile;  // tiles held in scratch
    // This thread's slots: [tile of the chunk][kStates entries of the state entering it]. Only
    // the tiles' states go through memory; a tile's tokens are recomputed from it in registers.
    T* mine = scratch + (q.bh * gridDim.y + blockIdx.y) * per_chunk * kStates * blockDim.x +
              threadIdx.x;
    T bias_acc = T(0), alog_acc = T(0), d_acc = T(0);  // thread 0's per-head sums
    T s[kStates], ds[kStates];
    load_state(q, dstate + q.bh * pn, ds);
    for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t c0 = c * chunk;
        const int64_t c1 = c0 + chunk < q.T ? c0 + chunk : q.T;
        load_state(q, checkpoints + (q.bh * nchunks + c) * pn, s);
        const int64_t tiles = (c1 - c0 + kBwdTile - 1) / kBwdTile;
        // Recompute: the state entering each tile, into scratch (the last tile's end unneeded).
        for (int64_t u = 0; u < tiles; ++u) {
            const int64_t t0 = c0 + u * kBwdTile;
            T* slot = mine + u * kStates * blockDim.x;
#pragma unroll
            for (int e = 0; e < kStates; ++e) slot[e * blockDim.x] = s[e];
            if (u + 1 == tiles) break;
            __syncthreads();
            stage(q, t0, kBwdTile, Bm, Cm, dt, bias, rate, dt_floor, x_in, x_out, B_s, C_s,
                  delta_s, a_s);
            __syncthreads();
            for (int tt = 0; tt < kBwdTile; ++tt) {
                const T* B_t = B_s + tt * q.np + q.r;
                const T a = a_s[tt];
                const T xd = delta_s[tt] * x_s[tt * q.cols + q.col];
#pragma unroll
                for (int e = 0; e < kStates; ++e) s[e] = fma_of(a, s[e], B_t[e * q.group] * xd);
            }
        }
        // Reverse sweep, tile by tile from the chunk's last; a computed tile is flushed while
        // the one before it is staged.
        for (int64_t u = tiles - 1; u >= 0; --u) {
            const int64_t t0 = c0 + u * kBwdTile;
            const int n = c1 - t0 < kBwdTile ? static_cast<int>(c1 - t0) : kBwdTile;
            __syncthreads();
            if (u + 1 < tiles) {
                const int64_t later = t0 + kBwdTile;
                flush(q, later, static_cast<int>(c1 - later < kBwdTile ? c1 - later : kBwdTile),
                      red, dx_s, dt, bias, rate, dt_floor, dx, dB, dC, ddt, bias_acc, alog_acc,
                      d_acc);
            }
            stage(q, t0, n, Bm, Cm, dt, bias, rate, dt_floor, both_in, both_out, B_s, C_s,
                  delta_s, a_s);
            __syncthreads();
            // The states entering the tile's tokens, recomputed from the tile's in registers.
            T before[kBwdTile][kStates];
            const T* slot = mine + u * kStates * blockDim.x;
#pragma unroll
            for (int e = 0; e < kStates; ++e) before[0][e] = slot[e * blockDim.x];
#pragma unroll
            for (int tt = 1; tt < kBwdTile; ++tt) {
                if (tt >= n) break;
                const T* B_t = B_s + (tt - 1) * q.np + q.r;
                const T a = a_s[tt - 1];
                const T xd = delta_s[tt - 1] * x_s[(tt - 1) * q.cols + q.col];
#pragma unroll
                for (int e = 0; e < kStates; ++e) {
                    before[tt][e] = fma_of(a, before[tt - 1][e], B_t[e * q.group] * xd);
                }
            }
#pragma unroll
            for (int tt = kBwdTile - 1; tt >= 0; --tt) {
                if (tt >= n) continue;
                const T* B_t = B_s + tt * q.np + q.r;
                const T* C_t = C_s + tt * q.np + q.r;
                const T a = a_s[tt], delta = delta_s[tt];
                const T xp = x_s[tt * q.cols + q.col];
                const T do_p = do_s[tt * q.cols + q.col];
                const T xd = delta * xp;
                // ds becomes the gradient of the state after the token, a * before + B * xd.
                T dc_e[kStates], xs_e[kStates];
                T da = T(0), gb = T(0), bx = T(0);
#pragma unroll
                for (int e = 0; e < kStates; ++e) {
                    const T be = B_t[e * q.group];
                    const T g = fma_of(do_p, C_t[e * q.group], ds[e]);
                    dc_e[e] = do_p * fma_of(a, before[tt][e], be * xd);
                    da = fma_of(g, before[tt][e], da);
                    xs_e[e] = g * xp;
                    gb = fma_of(g, be, gb);
                    bx = fma_of(be, xs_e[e], bx);
                    ds[e] = g * a;
                }
                const T gx = group_sum(gb, q.group);
                if (q.r == 0) dx_s[tt * q.cols + q.col] = fma_of(delta, gx, skip * do_p);
                T* red_t = red + (warp * kBwdTile + tt) * width;
                const T bx_w = column_sum(group_sum(bx, q.group), q.group);
                column_sums_to(dc_e, q.group, red_t);
                column_sums_to(xs_e, q.group, red_t + q.np);
                const T da_w = column_sum(group_sum(da, q.group), q.group);
                const T dd_w = column_sum(do_p * xp, q.group);  // one per row p
                if (lane == 0) {
                    red_t[2 * q.np] = bx_w;
                    red_t[2 * q.np + 1] = da_w;
                    red_t[2 * q.np + 2] = dd_w;
                    if (warp == 0) red_t[2 * q.np + 3] = delta;
                }
            }
        }
        __syncthreads();
        flush(q, c0, static_cast<int>(c1 - c0 < kBwdTile ? c1 - c0 : kBwdTile), red, dx_s, dt,
              bias, rate, dt_floor, dx, dB, dC, ddt, bias_acc, alog_acc, d_acc);
    }
    store_state(q, ds, dinit + q.bh * pn);
    if (threadIdx.x == 0) {
        const int64_t at = static_cast<int64_t>(blockIdx.y) * gridDim.x + q.bh;
        ddt_bias[at] = bias_acc;
        dA_log[at] = alog_acc;
        dD[at] = d_acc;
    }
}
