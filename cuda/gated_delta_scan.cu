// The gated delta rule, forward and backward. The columns of the state S [K, V] evolve
// independently, so a block takes `cols` columns of one (batch, head) and each column is held by
// a group of G threads (G = lanes of a warp sharing the column, a power of two up to 32): thread
// r of the group keeps rows r, r + G, ..., r + (kRows - 1) * G of it in registers. Splitting K
// over G threads (rather than one thread owning a whole column, which needs no reduction) is
// what fills a GPU: at B = 16, H = 8, K = V = 64 whole columns give 8192 threads (256 warps for
// 132 SMs); with G = 8 there are 2048 warps, each thread has 8 state rows, and the two sums over
// K per token (S^T k and S^T q) are log2(G) shuffles inside the group. Strided rows make the
// group's reads of a staged k or q row hit G consecutive words (no bank conflicts).
//
// Per tile of tokens, the block stages what its columns share (q, k, exp(log_decay), beta) and
// its slice of v in shared memory with coalesced loads, and writes its outputs back through
// shared memory, coalesced. The forward keeps the state entering every `chunk` tokens; the
// backward sweeps the chunks in reverse: it recomputes from the chunk's checkpoint the state
// entering each tile of kBwdTile tokens into a global scratch laid out thread by thread
// (coalesced), then per tile, in reverse, the tokens' decayed states in registers.
// Sums over V (dq, dk, dlog_decay, dbeta) are reduced over the warp's columns by shuffles (a
// reduce-scatter for the per-row ones), over the block's warps through shared memory in warp
// order, and written per block along V: the launcher adds those partials in a fixed order (no
// atomics, bitwise deterministic).
// Launchers: lowbit/ops/gated_delta_scan/_cuda.py; reference: reference/gated_delta_scan.py;
// tests: tests/test_gated_delta_scan.py.
#include "common.cuh"

namespace gated_delta {

// State rows per thread, in registers: K <= kRows * kMaxGroup.
constexpr int kRows = 8;
// Threads per column at most: one warp, so every sum over K is a shuffle.
constexpr int kMaxGroup = lowbit::kWarpSize;
static_assert((kRows & (kRows - 1)) == 0 && kMaxGroup == lowbit::kWarpSize,
              "groups are powers of two within a warp; the reduce-scatter halves kRows");
// Threads per block at most (the launchers' block sizes; registers may use up to 255).
constexpr int kMaxThreads = 256;
// Blocks per SM the launch bounds ask for. Given none, ptxas capped these kernels at 64 or 128
// registers and spilled (sm_80 and sm_90); with one it keeps the state rows in registers.
constexpr int kMinBlocks = 1;
// The backward in float asks for two: it fits in 128 registers without spilling, so at B = 16,
// H = 8, K = V = 64 all 256 blocks are resident at once on a 132-SM GPU (one wave, not two).
template <typename T>
constexpr int kBwdMinBlocks = sizeof(T) == sizeof(float) ? 2 : kMinBlocks;
// Tokens staged in shared memory per tile, forward and backward. The backward keeps a tile's
// decayed states in registers (kBwdTile * kRows of them): 2 tokens keep it within 128 registers
// in float and cut the scratch traffic to the state entering each tile (4 would need 176).
constexpr int kFwdTile = 16;
constexpr int kBwdTile = 2;

using lowbit::exp_of;
using lowbit::kFullMask;
using lowbit::kWarpSize;

using lowbit::column_sum;
using lowbit::column_sums_to;
using lowbit::fma_of;
using lowbit::group_sum;

// Where one thread sits, and the shapes every kernel shares.
struct Place {
    int64_t T;
    int32_t H, K, V, Kd;
    int group, r, col, cols, kp;  // kp = group * kRows: the padded rows of a staged vector
    int64_t bh, b, h, j0, j;
    bool active;                   // j < V
};

__device__ __forceinline__ Place place(int64_t n_tokens, int32_t H, int32_t K, int32_t V,
                                       int32_t Kd, int32_t group) {
    Place p;
    p.T = n_tokens;
    p.H = H;
    p.K = K;
    p.V = V;
    p.Kd = Kd;
    p.group = group;
    p.r = threadIdx.x % group;
    p.col = threadIdx.x / group;
    p.cols = blockDim.x / group;
    p.kp = group * kRows;
    // 32-bit division (gridDim.x < 2^31): a 64-bit one is a called subroutine, whose calling
    // convention spills live registers to the stack.
    const int bh = static_cast<int>(blockIdx.x);
    p.bh = bh;
    p.b = bh / H;
    p.h = bh % H;
    p.j0 = static_cast<int64_t>(blockIdx.y) * p.cols;
    p.j = p.j0 + p.col;
    p.active = p.j < V;
    return p;
}

// Row (b, t, h) of the [B, T, H, ...] inputs.
__device__ __forceinline__ int64_t row_of(const Place& p, int64_t t) {
    return (p.b * p.T + t) * p.H + p.h;
}

// Stage tokens [t0, t0 + n) of k and exp(log_decay) ([tile][kp], zero past K) and beta, the
// block's columns of v into v_s ([tile][cols], zero past V); q and dout too when q_s and do_s
// are given. Every thread of the block calls it.
template <typename T>
__device__ __forceinline__ void stage(const Place& p, int64_t t0, int n,
                                      const T* __restrict__ q, const T* __restrict__ k,
                                      const T* __restrict__ v, const T* __restrict__ log_decay,
                                      const T* __restrict__ beta, const T* __restrict__ dout,
                                      T* q_s, T* k_s, T* g_s, T* beta_s, T* v_s, T* do_s) {
    for (int e = threadIdx.x; e < n * p.kp; e += blockDim.x) {
        const int tt = e / p.kp, i = e % p.kp;
        const int64_t row = row_of(p, t0 + tt);
        const bool in = i < p.K;
        k_s[e] = in ? k[row * p.K + i] : T(0);
        if (q_s) q_s[e] = in ? q[row * p.K + i] : T(0);
        // A padded row's decay is 0, not exp of anything: its zero state stays zero.
        g_s[e] = in ? exp_of(log_decay[row * p.Kd + (p.Kd > 1 ? i : 0)]) : T(0);
    }
    for (int e = threadIdx.x; e < n * p.cols; e += blockDim.x) {
        const int tt = e / p.cols, c = e % p.cols;
        const int64_t j = p.j0 + c;
        const int64_t at = row_of(p, t0 + tt) * p.V + j;
        v_s[e] = j < p.V ? v[at] : T(0);
        if (do_s) do_s[e] = j < p.V ? dout[at] : T(0);
    }
    for (int tt = threadIdx.x; tt < n; tt += blockDim.x) beta_s[tt] = beta[row_of(p, t0 + tt)];
}

// Write tokens [t0, t0 + n) of a [tile][cols] shared tile to the block's columns of `dst`
// ([B, T, H, V]).
template <typename T>
__device__ __forceinline__ void store_columns(const Place& p, int64_t t0, int n, const T* tile,
                                              T* __restrict__ dst) {
    for (int e = threadIdx.x; e < n * p.cols; e += blockDim.x) {
        const int tt = e / p.cols, c = e % p.cols;
        const int64_t j = p.j0 + c;
        if (j < p.V) dst[row_of(p, t0 + tt) * p.V + j] = tile[e];
    }
}

// The thread's rows of a [K, V] state matrix: load (zero outside it) and store.
template <typename T>
__device__ __forceinline__ void load_state(const Place& p, const T* __restrict__ m, T* s) {
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
        const int i = p.r + a * p.group;
        s[a] = p.active && i < p.K ? m[static_cast<int64_t>(i) * p.V + p.j] : T(0);
    }
}
template <typename T>
__device__ __forceinline__ void store_state(const Place& p, const T* s, T* __restrict__ m) {
    if (!p.active) return;
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
        const int i = p.r + a * p.group;
        if (i < p.K) m[static_cast<int64_t>(i) * p.V + p.j] = s[a];
    }
}

// The decay of the thread's row a from the staged g_t (its row r). With one decay per head,
// row r's (a real row: r < group <= K) serves every row, one shared-memory read per token; a
// padded row's state is zero either way.
template <typename T>
__device__ __forceinline__ T decay_of(const Place& p, const T* g_t, int a) {
    return p.Kd > 1 ? g_t[a * p.group] : g_t[0];
}

// Token step 1 on the thread's rows: decay s by g and return the column's v - s^T k.
template <typename T>
__device__ __forceinline__ T decay_and_residual(const Place& p, T* s, const T* k_t,
                                                const T* g_t, T v_j) {
    T memory = T(0);
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
        s[a] *= decay_of(p, g_t, a);
        memory = fma_of(k_t[a * p.group], s[a], memory);
    }
    return v_j - group_sum(memory, p.group);
}

}  // namespace gated_delta

// grid (B * H, ceil(V / cols)), block group * cols (at most kMaxThreads, whole warps), dynamic
// shared kFwdTile * (3 * group * kRows + 1 + 2 * cols) * sizeof(T).
template <typename T>
__global__ void __launch_bounds__(gated_delta::kMaxThreads, gated_delta::kMinBlocks)
    gated_delta_fwd(const T* __restrict__ q,          // [B, T, H, K]
                    const T* __restrict__ k,          // [B, T, H, K]
                    const T* __restrict__ v,          // [B, T, H, V]
                    const T* __restrict__ log_decay,  // [B, T, H, Kd]
                    const T* __restrict__ beta,       // [B, T, H]
                    const T* __restrict__ s0,         // [B, H, K, V]
                    T* __restrict__ out,              // [B, T, H, V]
                    T* __restrict__ final_state,      // [B, H, K, V]
                    T* __restrict__ checkpoints,      // [B, H, nchunks, K, V]
                    int64_t n_tokens, int32_t H, int32_t K, int32_t V, int32_t Kd,
                    int32_t chunk, int32_t nchunks, int32_t keep, int32_t group) {
    using namespace gated_delta;
    const Place p = place(n_tokens, H, K, V, Kd, group);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* q_s = smem;                       // [kFwdTile][kp]
    T* k_s = q_s + kFwdTile * p.kp;      // [kFwdTile][kp]
    T* g_s = k_s + kFwdTile * p.kp;      // [kFwdTile][kp]: exp(log_decay)
    T* beta_s = g_s + kFwdTile * p.kp;   // [kFwdTile]
    T* v_s = beta_s + kFwdTile;          // [kFwdTile][cols]
    T* o_s = v_s + kFwdTile * p.cols;    // [kFwdTile][cols]
    const int64_t kv = static_cast<int64_t>(K) * V;
    T s[kRows];
    load_state(p, s0 + p.bh * kv, s);
    int64_t next_checkpoint = 0, checkpoint = 0;  // counters, not t % chunk (a 64-bit division)
    for (int64_t t0 = 0; t0 < p.T; t0 += kFwdTile) {
        const int n = p.T - t0 < kFwdTile ? static_cast<int>(p.T - t0) : kFwdTile;
        __syncthreads();  // the previous tile is computed: its outputs are in o_s
        if (t0 > 0) store_columns(p, t0 - kFwdTile, kFwdTile, o_s, out);
        stage(p, t0, n, q, k, v, log_decay, beta, static_cast<const T*>(nullptr), q_s, k_s, g_s,
              beta_s, v_s, static_cast<T*>(nullptr));
        __syncthreads();
        for (int tt = 0; tt < n; ++tt) {
            const int64_t t = t0 + tt;
            if (keep && t == next_checkpoint) {
                store_state(p, s, checkpoints + (p.bh * nchunks + checkpoint) * kv);
                next_checkpoint += chunk;
                ++checkpoint;
            }
            const T* k_t = k_s + tt * p.kp + p.r;
            const T* q_t = q_s + tt * p.kp + p.r;
            const T delta = beta_s[tt] * decay_and_residual(p, s, k_t, g_s + tt * p.kp + p.r,
                                                             v_s[tt * p.cols + p.col]);
            T o = T(0);
#pragma unroll
            for (int a = 0; a < kRows; ++a) {
                s[a] = fma_of(k_t[a * p.group], delta, s[a]);
                o = fma_of(q_t[a * p.group], s[a], o);
            }
            o = group_sum(o, p.group);
            if (p.r == 0) o_s[tt * p.cols + p.col] = o;
        }
    }
    __syncthreads();
    const int64_t last = (p.T - 1) / kFwdTile * kFwdTile;
    store_columns(p, last, static_cast<int>(p.T - last), o_s, out);
    store_state(p, s, final_state + p.bh * kv);
}

namespace gated_delta {

// Per-warp partial sums of one backward tile, [warps][kBwdTile][red_width(kp)]: dq, dk and
// dlog_decay rows (kp each; with one decay per head, its sum sits in the first dlog slot), then
// dbeta.
__device__ __forceinline__ int red_width(int kp) { return 3 * kp + 1; }

// Add the tile's per-warp partials in warp order and write tokens [t0, t0 + n) of the block's
// partial rows of dq, dk, dlog, dbeta (slice blockIdx.y) and of dv.
template <typename T>
__device__ __forceinline__ void flush(const Place& p, int64_t t0, int n, const T* red,
                                      const T* dv_s, T* __restrict__ dq, T* __restrict__ dk,
                                      T* __restrict__ dv, T* __restrict__ dlog,
                                      T* __restrict__ dbeta) {
    const int warps = blockDim.x / kWarpSize, width = red_width(p.kp);
    const int64_t rows = static_cast<int64_t>(gridDim.x) * p.T;  // B * T * H
    const int64_t slice = blockIdx.y;
    for (int e = threadIdx.x; e < n * width; e += blockDim.x) {
        const int tt = e / width, f = e % width;
        const int part = f / p.kp, i = f % p.kp;
        const bool used = part == 3 ? i == 0 : part == 2 && p.Kd == 1 ? i == 0 : i < p.K;
        if (!used) continue;
        T total = T(0);
        for (int w = 0; w < warps; ++w) total += red[(w * kBwdTile + tt) * width + f];
        const int64_t at = slice * rows + row_of(p, t0 + tt);
        if (part == 0) dq[at * p.K + i] = total;
        else if (part == 1) dk[at * p.K + i] = total;
        else if (part == 2) dlog[at * p.Kd + i] = total;
        else dbeta[at] = total;
    }
    store_columns(p, t0, n, dv_s, dv);
}

}  // namespace gated_delta

// grid (B * H, ceil(V / cols)), block group * cols, dynamic shared
// kBwdTile * (3 * kp + 1 + 3 * cols + warps * (3 * kp + 1)) * sizeof(T), kp = group * kRows.
// dq, dk, dlog, dbeta are per-block partial sums along V: [gridDim.y, ...].
template <typename T>
__global__ void __launch_bounds__(gated_delta::kMaxThreads, gated_delta::kBwdMinBlocks<T>)
    gated_delta_bwd(const T* __restrict__ q,            // [B, T, H, K]
                    const T* __restrict__ k,            // [B, T, H, K]
                    const T* __restrict__ v,            // [B, T, H, V]
                    const T* __restrict__ log_decay,    // [B, T, H, Kd]
                    const T* __restrict__ beta,         // [B, T, H]
                    const T* __restrict__ checkpoints,  // [B, H, nchunks, K, V]
                    const T* __restrict__ dout,         // [B, T, H, V]
                    const T* __restrict__ dstate,       // [B, H, K, V]
                    T* __restrict__ scratch,  // [B * H * gridDim.y, tiles per chunk, kRows,
                                              //  blockDim.x]
                    T* __restrict__ dq,       // [gridDim.y, B, T, H, K]
                    T* __restrict__ dk,       // [gridDim.y, B, T, H, K]
                    T* __restrict__ dv,       // [B, T, H, V]
                    T* __restrict__ dlog,     // [gridDim.y, B, T, H, Kd]
                    T* __restrict__ dbeta,    // [gridDim.y, B, T, H]
                    T* __restrict__ dinit,    // [B, H, K, V]
                    int64_t n_tokens, int32_t H, int32_t K, int32_t V, int32_t Kd,
                    int32_t chunk, int32_t nchunks, int32_t group) {
    using namespace gated_delta;
    const Place p = place(n_tokens, H, K, V, Kd, group);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    const int width = red_width(p.kp);
    T* q_s = smem;                       // [kBwdTile][kp]
    T* k_s = q_s + kBwdTile * p.kp;      // [kBwdTile][kp]
    T* g_s = k_s + kBwdTile * p.kp;      // [kBwdTile][kp]: exp(log_decay)
    T* beta_s = g_s + kBwdTile * p.kp;   // [kBwdTile]
    T* v_s = beta_s + kBwdTile;          // [kBwdTile][cols]
    T* do_s = v_s + kBwdTile * p.cols;   // [kBwdTile][cols]
    T* dv_s = do_s + kBwdTile * p.cols;  // [kBwdTile][cols]
    T* red = dv_s + kBwdTile * p.cols;   // [warps][kBwdTile][width]
    const int warp = threadIdx.x / kWarpSize;
    const int64_t kv = static_cast<int64_t>(K) * V;
    const int64_t span = chunk < p.T ? chunk : p.T;
    const int64_t per_chunk = (span + kBwdTile - 1) / kBwdTile;  // tiles held in scratch
    // This thread's slots: [tile of the chunk][kRows rows of the state entering it]. Only the
    // tiles' states go through memory; a tile's tokens are recomputed from it in registers.
    T* mine = scratch + (p.bh * gridDim.y + blockIdx.y) * per_chunk * kRows * blockDim.x +
              threadIdx.x;
    T s[kRows], ds[kRows];
    load_state(p, dstate + p.bh * kv, ds);
    for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t c0 = c * chunk;
        const int64_t c1 = c0 + chunk < p.T ? c0 + chunk : p.T;
        const int64_t tiles = (c1 - c0 + kBwdTile - 1) / kBwdTile;
        load_state(p, checkpoints + (p.bh * nchunks + c) * kv, s);
        // Recompute: the state entering each tile, into scratch (the last tile's end unneeded).
        for (int64_t u = 0; u < tiles; ++u) {
            const int64_t t0 = c0 + u * kBwdTile;
            T* slot = mine + u * kRows * blockDim.x;
#pragma unroll
            for (int a = 0; a < kRows; ++a) slot[a * blockDim.x] = s[a];
            if (u + 1 == tiles) break;
            __syncthreads();
            stage(p, t0, kBwdTile, q, k, v, log_decay, beta, static_cast<const T*>(nullptr),
                  static_cast<T*>(nullptr), k_s, g_s, beta_s, v_s, static_cast<T*>(nullptr));
            __syncthreads();
            for (int tt = 0; tt < kBwdTile; ++tt) {
                const T* k_t = k_s + tt * p.kp + p.r;
                const T delta = beta_s[tt] * decay_and_residual(p, s, k_t, g_s + tt * p.kp + p.r,
                                                                 v_s[tt * p.cols + p.col]);
#pragma unroll
                for (int a = 0; a < kRows; ++a) s[a] = fma_of(k_t[a * p.group], delta, s[a]);
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
                flush(p, later, static_cast<int>(c1 - later < kBwdTile ? c1 - later : kBwdTile),
                      red, dv_s, dq, dk, dv, dlog, dbeta);
            }
            stage(p, t0, n, q, k, v, log_decay, beta, dout, q_s, k_s, g_s, beta_s, v_s, do_s);
            __syncthreads();
            // The tile's decayed states and residuals, recomputed from its entering state.
            T sd[kBwdTile][kRows], res[kBwdTile];
            const T* slot = mine + u * kRows * blockDim.x;
#pragma unroll
            for (int a = 0; a < kRows; ++a) s[a] = slot[a * blockDim.x];
#pragma unroll
            for (int tt = 0; tt < kBwdTile; ++tt) {
                if (tt >= n) break;
                const T* k_t = k_s + tt * p.kp + p.r;
                res[tt] = decay_and_residual(p, s, k_t, g_s + tt * p.kp + p.r,
                                             v_s[tt * p.cols + p.col]);
                const T delta = beta_s[tt] * res[tt];
#pragma unroll
                for (int a = 0; a < kRows; ++a) {
                    sd[tt][a] = s[a];
                    s[a] = fma_of(k_t[a * p.group], delta, s[a]);
                }
            }
#pragma unroll
            for (int tt = kBwdTile - 1; tt >= 0; --tt) {
                if (tt >= n) continue;
                const T* k_t = k_s + tt * p.kp + p.r;
                const T* q_t = q_s + tt * p.kp + p.r;
                const T* g_t = g_s + tt * p.kp + p.r;
                const T bt = beta_s[tt];
                const T delta = bt * res[tt];
                const T do_j = do_s[tt * p.cols + p.col];
                // ds becomes the gradient of the state after the token, sd + outer(k, delta).
                T dq_a[kRows], ddelta = T(0);
#pragma unroll
                for (int a = 0; a < kRows; ++a) {
                    const T ki = k_t[a * p.group];
                    dq_a[a] = do_j * fma_of(ki, delta, sd[tt][a]);
                    ds[a] = fma_of(do_j, q_t[a * p.group], ds[a]);
                    ddelta = fma_of(ds[a], ki, ddelta);
                }
                ddelta = group_sum(ddelta, p.group);
                if (p.r == 0) dv_s[tt * p.cols + p.col] = bt * ddelta;
                const T dbt = column_sum(res[tt] * ddelta, p.group);
                const T dmemory = -bt * ddelta;
                T dk_a[kRows], dl_a[kRows], dl_sum = T(0);
#pragma unroll
                for (int a = 0; a < kRows; ++a) {
                    const T ki = k_t[a * p.group];
                    dk_a[a] = fma_of(ds[a], delta, dmemory * sd[tt][a]);
                    const T dsd = fma_of(ki, dmemory, ds[a]);  // gradient of the decayed state
                    dl_a[a] = dsd * sd[tt][a];
                    dl_sum += dl_a[a];
                    ds[a] = dsd * decay_of(p, g_t, a);
                }
                T* red_t = red + (warp * kBwdTile + tt) * width;
                column_sums_to(dq_a, p.group, red_t);
                column_sums_to(dk_a, p.group, red_t + p.kp);
                if (Kd > 1) {
                    column_sums_to(dl_a, p.group, red_t + 2 * p.kp);
                } else {
                    // One decay for all rows: its gradient sums the warp's rows and columns.
                    const T dl = column_sum(group_sum(dl_sum, p.group), p.group);
                    if (threadIdx.x % kWarpSize == 0) red_t[2 * p.kp] = dl;
                }
                if (threadIdx.x % kWarpSize == 0) red_t[3 * p.kp] = dbt;
            }
        }
        __syncthreads();
        flush(p, c0, static_cast<int>(c1 - c0 < kBwdTile ? c1 - c0 : kBwdTile), red, dv_s, dq,
              dk, dv, dlog, dbeta);
    }
    store_state(p, ds, dinit + p.bh * kv);
}
