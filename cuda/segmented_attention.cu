// Segmented (variable-length) attention over packed tokens on FlashAttention-2's structure:
// forward with an online softmax held in registers, and a backward without float atomics (dk/dv
// per key block, dq per query block), so results are bitwise identical run to run. Launchers:
// lowbit/ops/segmented_attention/_cuda.py; reference: reference/segmented_attention.py; tests:
// tests/test_segmented_attention.py. Device helpers: segmented_attention_tiles.cuh.
//
// Layout: q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], token-major; query head h reads
// key/value head h / (H / Hkv). Segment s holds queries offsets[s]:offsets[s + 1] and keys
// k_offsets[s]:k_offsets[s + 1] (the same table unless the caller gave key lengths; a segment
// may be empty then). Causal masks align bottom-right: query row r (global) sees key row j
// (global) iff j <= r + shift, shift = k_offsets[s + 1] - offsets[s + 1]; a query that sees no
// key gets out 0, lse -inf and no gradient. A block covers kBlockRows<T> rows (query rows, or
// key rows for dk/dv) of one segment and one head; blockIdx.x walks the row blocks of every
// segment through the prefix table block_prefix[S + 1] (row blocks before each segment, of the
// queries or for dk/dv of the keys), built once per call on the host.
//
// Register blocking (FA2 on CUDA cores, exact fp32 / fp64 products and sums): a warp owns
// kRowGroups * V rows of the block (V = kVec<T>, the elements of one 16-byte load); lane
// (rg, cg) = (lane / kColGroups, lane % kColGroups) holds rows rg + kRowGroups * i (i < V) and,
// of each tile of kColGroups * V keys, keys cg + kColGroups * t (t < V). A score tile is a
// V x V block of fma chains over the feature axis, read from shared rows as 16-byte vectors;
// the rows a lane holds are interleaved so each 16-byte load of a warp hits distinct banks
// (row stride = width + V elements, width a multiple of kColGroups * V). Products with a
// feature-wide result (p v, ds k, ...) give lane cg the feature chunks (c * kColGroups + cg) * V.
// Row statistics reduce over the kColGroups lanes of a row group: a few shuffles per row and
// tile, none per query-key pair. Tiles arrive by lowbit::cp_async (zero-filled padding), the
// streamed ones double-buffered; the score scale multiplies the finished dot products.
#include "common.cuh"

#include "segmented_attention_tiles.cuh"

// Forward: grid (row blocks of all segments, H), kThreads threads. Online softmax over key tiles
// in registers; writes out [T, H, Dv] and lse [H, T], the logsumexp of each row's scaled scores.
// C: D, Dv <= 32 * C. Offsets and block_prefix: [S + 1]. Key/value tiles are double-buffered:
// the copy of tile n + 1 runs while tile n is used.
template <typename T, int C>
__global__ void segmented_attention_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v,
                                        const int64_t* __restrict__ offsets,       // [S + 1]
                                        const int64_t* __restrict__ k_offsets,     // [S + 1]
                                        const int64_t* __restrict__ block_prefix,  // [S + 1]
                                        T* __restrict__ out, T* __restrict__ lse,
                                        int64_t num_segments, int64_t tokens, int64_t heads,
                                        int64_t kv_heads, int64_t dim, int64_t dim_v, T scale,
                                        int32_t causal) {
    using namespace segattn;
    constexpr int V = kVec<T>, BM = kBlockRows<T>, BN = kTileRows<T>;
    constexpr int NC = lowbit::kWarpSize * C / (kColGroups * V);
    const int ld = tile_stride<T>(dim), ldv = tile_stride<T>(dim_v);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* q_s = smem;                // [BM][ld]
    T* k_s = q_s + BM * ld;       // [2][BN][ld]
    T* v_s = k_s + 2 * BN * ld;   // [2][BN][ldv]
    T* p_s = v_s + 2 * BN * ldv;  // [kWarps][kRowGroups * V][BN + V]
    const int64_t h = blockIdx.y;
    const int64_t g = h / (heads / kv_heads);
    const Rows blk = block_rows<T>(offsets, block_prefix, num_segments);
    const KeyRange keys = key_range(blk, k_offsets, causal);
    const int64_t key_stop = keys.stop, shift = keys.shift;
    const Lane ln = lane_of<T>();
    const int rg = ln.rg, cg = ln.cg, row0 = ln.row0;
    T* p_w = p_s + ln.warp * kRowGroups * V * (BN + V);
    const int chunks = chunks_of<T>(dim_v);

    const auto stage_kv = [&](int64_t k0, int buf) {
        const int count = static_cast<int>(key_stop - k0 < BN ? key_stop - k0 : BN);
        stage(k_s + buf * BN * ld, k, k0, count, BN, kv_heads, g, dim);
        stage(v_s + buf * BN * ldv, v, k0, count, BN, kv_heads, g, dim_v);
        lowbit::cp_async_commit();
    };
    stage(q_s, q, blk.r0, blk.count, BM, heads, h, dim);
    if (keys.start < key_stop) stage_kv(keys.start, 0);
    T acc[V][NC][V] = {}, m[V], l[V] = {};
#pragma unroll
    for (int i = 0; i < V; ++i) m[i] = neg_inf<T>();
    int buf = 0;
    for (int64_t k0 = keys.start; k0 < key_stop; k0 += BN, buf ^= 1) {
        const int count = static_cast<int>(key_stop - k0 < BN ? key_stop - k0 : BN);
        lowbit::cp_async_wait<0>();
        __syncthreads();  // tile n (and q) landed everywhere; every warp is done with tile n - 1
        if (k0 + BN < key_stop) stage_kv(k0 + BN, buf ^ 1);
        const T* k_t = k_s + buf * BN * ld;
        const T* v_t = v_s + buf * BN * ldv;
        T s[V][V] = {};
        score_block(s, q_s + row0 * ld, k_t + cg * ld, ld, dim);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int64_t row = blk.r0 + row0 + i * kRowGroups;
            T tile_max = neg_inf<T>();
#pragma unroll
            for (int t = 0; t < V; ++t) {
                const int j = cg + t * kColGroups;
                const bool visible = j < count && !(causal && k0 + j > row + shift);
                s[i][t] = visible ? s[i][t] * scale : neg_inf<T>();
                tile_max = max_of(tile_max, s[i][t]);
            }
            // A tile whose keys are all masked for a row leaves its state unchanged. A row that
            // has seen no key yet (new_m = -inf: more queries than keys, bottom-right) is
            // shifted by 0 instead, so its state stays exactly zero rather than NaN.
            const T new_m = max_of(m[i], row_reduce<true>(tile_max));
            const T base = new_m == neg_inf<T>() ? T(0) : new_m;
            const T alpha = exp_of(m[i] - base);
            T sum = 0;
#pragma unroll
            for (int t = 0; t < V; ++t) {
                s[i][t] = exp_of(s[i][t] - base);
                sum += s[i][t];
            }
            l[i] = l[i] * alpha + sum;  // this lane's share of the row sum
            m[i] = new_m;
#pragma unroll
            for (int cw = 0; cw < NC * V; ++cw) acc[i][cw / V][cw % V] *= alpha;
        }
        put_block(p_w, s, rg, cg);
        __syncwarp();
        accumulate_rows<T, NC>(acc, p_w + rg * (BN + V), v_t, ldv, chunks, cg);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
        l[i] = row_reduce<false>(l[i]);
        const int r = row0 + i * kRowGroups;
        // l = 0 only for a row that sees no key: out 0, lse -inf.
        if (cg == 0 && r < blk.count) {
            lse[h * tokens + blk.r0 + r] = l[i] > T(0) ? m[i] + log_of(l[i]) : neg_inf<T>();
        }
        const T inv = l[i] > T(0) ? T(1) / l[i] : T(0);
#pragma unroll
        for (int cw = 0; cw < NC * V; ++cw) acc[i][cw / V][cw % V] *= inv;
    }
    store_rows<T, NC>(out, acc, T(1), blk, ln, heads, h, dim_v);
}

// delta[h, t] = sum_d dout[t, h, d] * out[t, h, d]: one warp per (t, h) row, grid-stride.
template <typename T>
__global__ void segmented_attention_bwd_delta(const T* __restrict__ dout,  // [T, H, Dv]
                                              const T* __restrict__ out,   // [T, H, Dv]
                                              T* __restrict__ delta,       // [H, T]
                                              int64_t tokens, int64_t heads, int64_t dim_v) {
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t warps = lowbit::grid_stride() / lowbit::kWarpSize;
    for (int64_t row = lowbit::grid_index() / lowbit::kWarpSize; row < tokens * heads;
         row += warps) {
        T part = 0;
        for (int64_t d = lane; d < dim_v; d += lowbit::kWarpSize) {
            part = segattn::fma_of(dout[row * dim_v + d], out[row * dim_v + d], part);
        }
        part = lowbit::warp_sum(part);
        const int64_t t = row / heads;
        if (lane == 0) delta[(row - t * heads) * tokens + t] = part;
    }
}

// dq [T, H, D]: grid (query row blocks of all segments, H). Per key tile, recomputes the
// probabilities from the saved logsumexp (lse, delta: [H, T]): p = exp(s - lse), dp = dout v^T,
// ds = p (dp - delta), and accumulates dq += ds k in registers; dq = scale * that. Key/value
// tiles double-buffered.
template <typename T, int C>
__global__ void segmented_attention_bwd_dq(const T* __restrict__ dout, const T* __restrict__ q,
                                           const T* __restrict__ k, const T* __restrict__ v,
                                           const T* __restrict__ lse,
                                           const T* __restrict__ delta,
                                           const int64_t* __restrict__ offsets,       // [S + 1]
                                           const int64_t* __restrict__ k_offsets,     // [S + 1]
                                           const int64_t* __restrict__ block_prefix,  // [S + 1]
                                           T* __restrict__ dq, int64_t num_segments,
                                           int64_t tokens, int64_t heads, int64_t kv_heads,
                                           int64_t dim, int64_t dim_v, T scale,
                                           int32_t causal) {
    using namespace segattn;
    constexpr int V = kVec<T>, BM = kBlockRows<T>, BN = kTileRows<T>;
    constexpr int NC = lowbit::kWarpSize * C / (kColGroups * V);
    const int ld = tile_stride<T>(dim), ldv = tile_stride<T>(dim_v);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* q_s = smem;                 // [BM][ld]
    T* do_s = q_s + BM * ld;       // [BM][ldv]
    T* k_s = do_s + BM * ldv;      // [2][BN][ld]
    T* v_s = k_s + 2 * BN * ld;    // [2][BN][ldv]
    T* ds_s = v_s + 2 * BN * ldv;  // [kWarps][kRowGroups * V][BN + V]
    const int64_t h = blockIdx.y;
    const int64_t g = h / (heads / kv_heads);
    const Rows blk = block_rows<T>(offsets, block_prefix, num_segments);
    const KeyRange keys = key_range(blk, k_offsets, causal);
    const int64_t key_stop = keys.stop, shift = keys.shift;
    const Lane ln = lane_of<T>();
    const int rg = ln.rg, cg = ln.cg, row0 = ln.row0;
    T* ds_w = ds_s + ln.warp * kRowGroups * V * (BN + V);
    const int chunks = chunks_of<T>(dim);

    const auto stage_kv = [&](int64_t k0, int buf) {
        const int count = static_cast<int>(key_stop - k0 < BN ? key_stop - k0 : BN);
        stage(k_s + buf * BN * ld, k, k0, count, BN, kv_heads, g, dim);
        stage(v_s + buf * BN * ldv, v, k0, count, BN, kv_heads, g, dim_v);
        lowbit::cp_async_commit();
    };
    stage(q_s, q, blk.r0, blk.count, BM, heads, h, dim);
    stage(do_s, dout, blk.r0, blk.count, BM, heads, h, dim_v);
    if (keys.start < key_stop) stage_kv(keys.start, 0);
    T acc[V][NC][V] = {}, row_lse[V], row_delta[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int r = row0 + i * kRowGroups;
        row_lse[i] = r < blk.count ? lse[h * tokens + blk.r0 + r] : T(0);
        row_delta[i] = r < blk.count ? delta[h * tokens + blk.r0 + r] : T(0);
    }
    int buf = 0;
    for (int64_t k0 = keys.start; k0 < key_stop; k0 += BN, buf ^= 1) {
        const int count = static_cast<int>(key_stop - k0 < BN ? key_stop - k0 : BN);
        lowbit::cp_async_wait<0>();
        __syncthreads();  // as in the forward
        if (k0 + BN < key_stop) stage_kv(k0 + BN, buf ^ 1);
        const T* k_t = k_s + buf * BN * ld;
        T s[V][V] = {}, dp[V][V] = {};
        score_block(s, q_s + row0 * ld, k_t + cg * ld, ld, dim);
        score_block(dp, do_s + row0 * ldv, v_s + buf * BN * ldv + cg * ldv, ldv, dim_v);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int64_t row = blk.r0 + row0 + i * kRowGroups;
#pragma unroll
            for (int t = 0; t < V; ++t) {
                const int j = cg + t * kColGroups;
                // A row without keys (lse -inf) has none visible: its p and ds are 0.
                const bool visible = j < count && !(causal && k0 + j > row + shift);
                const T p = exp_of(visible ? s[i][t] * scale - row_lse[i] : neg_inf<T>());
                s[i][t] = p * (dp[i][t] - row_delta[i]);
            }
        }
        put_block(ds_w, s, rg, cg);
        __syncwarp();
        accumulate_rows<T, NC>(acc, ds_w + rg * (BN + V), k_t, ld, chunks, cg);
    }
    store_rows<T, NC>(dq, acc, scale, blk, ln, heads, h, dim);
}

// dk [T, Hkv, D], dv [T, Hkv, Dv]: grid (key row blocks of all segments, Hkv). Each block loops
// over the query heads of its group and the query tiles that see its keys, so every dk/dv
// element is summed by one lane in a fixed order: dv_j = sum_i p_ij dout_i,
// dk_j = scale * sum_i ds_ij q_i. Query tiles double-buffered.
template <typename T, int C>
__global__ void segmented_attention_bwd_dkdv(const T* __restrict__ dout,
                                             const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ lse,
                                             const T* __restrict__ delta,
                                             const int64_t* __restrict__ offsets,    // [S + 1]
                                             const int64_t* __restrict__ k_offsets,  // [S + 1]
                                             // [S + 1], of the key row blocks
                                             const int64_t* __restrict__ block_prefix,
                                             T* __restrict__ dk, T* __restrict__ dv,
                                             int64_t num_segments, int64_t tokens,
                                             int64_t heads, int64_t kv_heads, int64_t dim,
                                             int64_t dim_v, T scale, int32_t causal) {
    using namespace segattn;
    constexpr int V = kVec<T>, BM = kBlockRows<T>, BN = kTileRows<T>;
    constexpr int NC = lowbit::kWarpSize * C / (kColGroups * V);
    constexpr int kWarpTile = kRowGroups * V * (BN + V);
    const int ld = tile_stride<T>(dim), ldv = tile_stride<T>(dim_v);
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* k_s = smem;                          // [BM][ld], this block's keys
    T* v_s = k_s + BM * ld;                 // [BM][ldv]
    T* q_s = v_s + BM * ldv;                // [2][BN][ld]
    T* do_s = q_s + 2 * BN * ld;            // [2][BN][ldv]
    T* p_s = do_s + 2 * BN * ldv;           // [kWarps][kRowGroups * V][BN + V]
    T* ds_s = p_s + kWarps * kWarpTile;     // [kWarps][kRowGroups * V][BN + V]
    T* lse_s = ds_s + kWarps * kWarpTile;   // [2][BN]
    T* delta_s = lse_s + 2 * BN;            // [2][BN]
    const int64_t g = blockIdx.y;
    const int64_t group = heads / kv_heads;
    const Rows blk = block_rows<T>(k_offsets, block_prefix, num_segments);
    const int64_t q_end = offsets[blk.seg + 1], shift = blk.seg_end - q_end;
    // A causal query sees this block only from its first key on: query r >= r0 - shift.
    const int64_t q_first = blk.r0 - shift;
    const int64_t query_start =
        causal && q_first > offsets[blk.seg] ? q_first : offsets[blk.seg];
    const Lane ln = lane_of<T>();
    const int rg = ln.rg, cg = ln.cg, row0 = ln.row0;
    T* p_w = p_s + ln.warp * kWarpTile;
    T* ds_w = ds_s + ln.warp * kWarpTile;
    const int chunks_k = chunks_of<T>(dim), chunks_v = chunks_of<T>(dim_v);

    // Steps: (query head, query tile) pairs, head-major. The step at (h_next, r_next) is copied
    // into the other buffer while the current one is used.
    const int64_t h_end = (g + 1) * group;
    int64_t h_next = g * group, r_next = query_start;
    const auto stage_next = [&](int buf) {
        const int count = static_cast<int>(q_end - r_next < BN ? q_end - r_next : BN);
        stage(q_s + buf * BN * ld, q, r_next, count, BN, heads, h_next, dim);
        stage(do_s + buf * BN * ldv, dout, r_next, count, BN, heads, h_next, dim_v);
        lowbit::cp_async_commit();
        for (int j = threadIdx.x; j < BN; j += kThreads) {
            lse_s[buf * BN + j] = j < count ? lse[h_next * tokens + r_next + j] : T(0);
            delta_s[buf * BN + j] = j < count ? delta[h_next * tokens + r_next + j] : T(0);
        }
        r_next += BN;
        if (r_next >= q_end) {
            r_next = query_start;
            ++h_next;
        }
    };
    stage(k_s, k, blk.r0, blk.count, BM, kv_heads, g, dim);
    stage(v_s, v, blk.r0, blk.count, BM, kv_heads, g, dim_v);
    // No query sees these keys (an empty query segment, or all before the block): dk = dv = 0.
    if (query_start < q_end) stage_next(0);
    T dk_acc[V][NC][V] = {}, dv_acc[V][NC][V] = {};
    int buf = 0;
    for (int64_t h = g * group; h < h_end; ++h) {
        for (int64_t r0 = query_start; r0 < q_end; r0 += BN, buf ^= 1) {
            const int count = static_cast<int>(q_end - r0 < BN ? q_end - r0 : BN);
            lowbit::cp_async_wait<0>();
            __syncthreads();  // this step landed everywhere; every warp is done with the last
            if (h_next < h_end) stage_next(buf ^ 1);
            const T* q_t = q_s + buf * BN * ld;
            const T* do_t = do_s + buf * BN * ldv;
            const T* lse_t = lse_s + buf * BN;
            const T* delta_t = delta_s + buf * BN;
            T s[V][V] = {}, dp[V][V] = {};
            score_block(s, k_s + row0 * ld, q_t + cg * ld, ld, dim);
            score_block(dp, v_s + row0 * ldv, do_t + cg * ldv, ldv, dim_v);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int64_t key = blk.r0 + row0 + i * kRowGroups;
#pragma unroll
                for (int t = 0; t < V; ++t) {
                    const int j = cg + t * kColGroups;
                    const bool visible = j < count && !(causal && r0 + j + shift < key);
                    s[i][t] = exp_of(visible ? s[i][t] * scale - lse_t[j] : neg_inf<T>());
                    dp[i][t] = s[i][t] * (dp[i][t] - delta_t[j]);
                }
            }
            put_block(p_w, s, rg, cg);
            put_block(ds_w, dp, rg, cg);
            __syncwarp();
            accumulate_rows<T, NC>(dv_acc, p_w + rg * (BN + V), do_t, ldv, chunks_v, cg);
            accumulate_rows<T, NC>(dk_acc, ds_w + rg * (BN + V), q_t, ld, chunks_k, cg);
        }
    }
    store_rows<T, NC>(dk, dk_acc, scale, blk, ln, kv_heads, g, dim);
    store_rows<T, NC>(dv, dv_acc, T(1), blk, ln, kv_heads, g, dim_v);
}
