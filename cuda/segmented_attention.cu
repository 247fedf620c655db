// Segmented (variable-length) attention over packed tokens: forward with online softmax, and a
// backward without float atomics (dk/dv per key block, dq per query block), so results are
// bitwise identical run to run. Launchers: lowbit/ops/segmented_attention/_cuda.py; reference:
// reference/segmented_attention.py; tests: tests/test_segmented_attention.py.
//
// Layout: q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], token-major; query head h reads key/value
// head h / (H / Hkv). A block covers kBlockRows rows (query rows, or key rows for dk/dv) of one
// segment and one head; blockIdx.x walks the row blocks of every segment through the prefix
// table block_prefix[S + 1] (row blocks before each segment), built once per call on the host.
// Each warp owns kRowsPerWarp rows; lane l holds elements l, l + 32, ... of a row's feature
// vector in registers (C per lane, so D, Dv <= 32 * C), and dot products are warp sums.
#include "common.cuh"

namespace segattn {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * lowbit::kWarpSize;
constexpr int kRowsPerWarp = 2;
constexpr int kBlockRows = kWarps * kRowsPerWarp;
// Rows of the other operand staged in shared memory per step (keys in the forward and dq
// kernels, queries in the dk/dv kernel).
constexpr int kTile = 16;

using lowbit::exp_of;
using lowbit::log_of;

// -infinity from its bit pattern: NVRTC has no <cmath> INFINITY.
constexpr int kNegInfFloatBits = static_cast<int>(0xff800000u);
constexpr long long kNegInfDoubleBits = static_cast<long long>(0xfff0000000000000ull);
template <typename T>
__device__ __forceinline__ T neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
    return __int_as_float(kNegInfFloatBits);
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(kNegInfDoubleBits);
}

// The segment holding row block `b`: the last s with block_prefix[s] <= b.
__device__ __forceinline__ int64_t find_segment(const int64_t* __restrict__ block_prefix,
                                                int64_t num_segments, int64_t b) {
    int64_t lo = 0, hi = num_segments - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (block_prefix[mid] <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Copies rows [r0, r0 + count) of one head of a token-major [T, heads, dim] tensor into a
// [kTile, dim] shared tile, times `mul`.
template <typename T>
__device__ __forceinline__ void stage_rows(T* __restrict__ tile, const T* __restrict__ src,
                                           int64_t r0, int count, int64_t heads, int64_t head,
                                           int64_t dim, T mul) {
    for (int64_t idx = threadIdx.x; idx < count * dim; idx += kThreads) {
        const int64_t r = idx / dim;
        tile[idx] = src[((r0 + r) * heads + head) * dim + (idx - r * dim)] * mul;
    }
}

// Loads a row of one head into this lane's registers (zero past `dim`), times `mul`.
template <typename T, int C>
__device__ __forceinline__ void load_row(T (&reg)[C], const T* __restrict__ src, int64_t row,
                                         int64_t heads, int64_t head, int64_t dim, int lane,
                                         T mul) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t d = lane + c * lowbit::kWarpSize;
        reg[c] = d < dim ? src[(row * heads + head) * dim + d] * mul : T(0);
    }
}

// Dot product of a register row with a shared-memory row of length dim, in every lane.
template <typename T, int C>
__device__ __forceinline__ T dot_shared(const T (&reg)[C], const T* __restrict__ row,
                                        int64_t dim, int lane) {
    T part = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t d = lane + c * lowbit::kWarpSize;
        if (d < dim) part += reg[c] * row[d];
    }
    return lowbit::warp_sum(part);
}

template <typename T, int C>
__device__ __forceinline__ void axpy_shared(T (&reg)[C], T a, const T* __restrict__ row,
                                            int64_t dim, int lane) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t d = lane + c * lowbit::kWarpSize;
        if (d < dim) reg[c] += a * row[d];
    }
}

template <typename T, int C>
__device__ __forceinline__ void store_row(T* __restrict__ dst, const T (&reg)[C], int64_t row,
                                          int64_t heads, int64_t head, int64_t dim, int lane,
                                          T mul) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t d = lane + c * lowbit::kWarpSize;
        if (d < dim) dst[(row * heads + head) * dim + d] = reg[c] * mul;
    }
}

}  // namespace segattn

// Forward: grid (row blocks of all segments, H). Online softmax over key tiles; writes out and
// the logsumexp of each row's scaled scores.
template <typename T, int C>
__global__ void segmented_attention_fwd(const T* __restrict__ q,                 // [T, H, D]
                                        const T* __restrict__ k,                 // [T, Hkv, D]
                                        const T* __restrict__ v,                 // [T, Hkv, Dv]
                                        const int64_t* __restrict__ offsets,     // [S + 1]
                                        const int64_t* __restrict__ block_prefix,  // [S + 1]
                                        T* __restrict__ out,                     // [T, H, Dv]
                                        T* __restrict__ lse,                     // [H, T]
                                        int64_t num_segments, int64_t tokens, int64_t heads,
                                        int64_t kv_heads, int64_t dim, int64_t dim_v, T scale,
                                        int32_t causal) {
    using namespace segattn;
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* k_tile = smem;                // [kTile, D]
    T* v_tile = smem + kTile * dim;  // [kTile, Dv]
    const int64_t b = blockIdx.x;
    const int64_t h = blockIdx.y;
    const int64_t g = h / (heads / kv_heads);
    const int64_t s = find_segment(block_prefix, num_segments, b);
    const int64_t s1 = offsets[s + 1];
    const int64_t q0 = offsets[s] + (b - block_prefix[s]) * kBlockRows;
    const int64_t key_stop = causal ? (q0 + kBlockRows < s1 ? q0 + kBlockRows : s1) : s1;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int lane = threadIdx.x % lowbit::kWarpSize;

    T qr[kRowsPerWarp][C], acc[kRowsPerWarp][C], m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t row = q0 + warp * kRowsPerWarp + i;
        load_row<T, C>(qr[i], q, row < s1 ? row : q0, heads, h, dim, lane, scale);
#pragma unroll
        for (int c = 0; c < C; ++c) acc[i][c] = 0;
        m[i] = neg_inf<T>();
        l[i] = 0;
    }
    for (int64_t k0 = offsets[s]; k0 < key_stop; k0 += kTile) {
        const int count = static_cast<int>(key_stop - k0 < kTile ? key_stop - k0 : kTile);
        __syncthreads();  // the previous tile is consumed
        stage_rows(k_tile, k, k0, count, kv_heads, g, dim, T(1));
        stage_rows(v_tile, v, k0, count, kv_heads, g, dim_v, T(1));
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
            const int64_t row = q0 + warp * kRowsPerWarp + i;
            if (row >= s1) continue;  // warp-uniform
            T scores[kTile];
            T tile_max = neg_inf<T>();
#pragma unroll
            for (int j = 0; j < kTile; ++j) {
                const bool visible = j < count && (!causal || k0 + j <= row);
                scores[j] = visible ? dot_shared<T, C>(qr[i], k_tile + j * dim, dim, lane)
                                    : neg_inf<T>();
                tile_max = scores[j] > tile_max ? scores[j] : tile_max;
            }
            // The first tile holds the segment's first key, visible to every row: m is finite
            // from then on, and a tile whose keys are all masked leaves the state unchanged.
            const T new_m = tile_max > m[i] ? tile_max : m[i];
            const T alpha = exp_of(m[i] - new_m);
            l[i] *= alpha;
#pragma unroll
            for (int c = 0; c < C; ++c) acc[i][c] *= alpha;
#pragma unroll
            for (int j = 0; j < kTile; ++j) {
                if (j >= count) break;
                const T p = exp_of(scores[j] - new_m);
                l[i] += p;
                axpy_shared<T, C>(acc[i], p, v_tile + j * dim_v, dim_v, lane);
            }
            m[i] = new_m;
        }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t row = q0 + warp * kRowsPerWarp + i;
        if (row >= s1) continue;
        store_row<T, C>(out, acc[i], row, heads, h, dim_v, lane, T(1) / l[i]);
        if (lane == 0) lse[h * tokens + row] = m[i] + log_of(l[i]);
    }
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
            part += dout[row * dim_v + d] * out[row * dim_v + d];
        }
        part = lowbit::warp_sum(part);
        const int64_t t = row / heads;
        if (lane == 0) delta[(row - t * heads) * tokens + t] = part;
    }
}

// dq: grid (query row blocks of all segments, H). Recomputes each probability from the saved
// logsumexp; dq = scale * sum_j ds_ij k_j with ds = p (dp - delta), dp = dout . v.
template <typename T, int C>
__global__ void segmented_attention_bwd_dq(const T* __restrict__ dout,            // [T, H, Dv]
                                           const T* __restrict__ q,               // [T, H, D]
                                           const T* __restrict__ k,               // [T, Hkv, D]
                                           const T* __restrict__ v,               // [T, Hkv, Dv]
                                           const T* __restrict__ lse,             // [H, T]
                                           const T* __restrict__ delta,           // [H, T]
                                           const int64_t* __restrict__ offsets,   // [S + 1]
                                           const int64_t* __restrict__ block_prefix,  // [S + 1]
                                           T* __restrict__ dq,                    // [T, H, D]
                                           int64_t num_segments, int64_t tokens, int64_t heads,
                                           int64_t kv_heads, int64_t dim, int64_t dim_v,
                                           T scale, int32_t causal) {
    using namespace segattn;
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* k_tile = smem;                // [kTile, D]
    T* v_tile = smem + kTile * dim;  // [kTile, Dv]
    const int64_t b = blockIdx.x;
    const int64_t h = blockIdx.y;
    const int64_t g = h / (heads / kv_heads);
    const int64_t s = find_segment(block_prefix, num_segments, b);
    const int64_t s1 = offsets[s + 1];
    const int64_t q0 = offsets[s] + (b - block_prefix[s]) * kBlockRows;
    const int64_t key_stop = causal ? (q0 + kBlockRows < s1 ? q0 + kBlockRows : s1) : s1;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int lane = threadIdx.x % lowbit::kWarpSize;

    T qr[kRowsPerWarp][C], dor[kRowsPerWarp][C], acc[kRowsPerWarp][C];
    T row_lse[kRowsPerWarp], row_delta[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t row = q0 + warp * kRowsPerWarp + i;
        const int64_t safe = row < s1 ? row : q0;
        load_row<T, C>(qr[i], q, safe, heads, h, dim, lane, scale);
        load_row<T, C>(dor[i], dout, safe, heads, h, dim_v, lane, T(1));
#pragma unroll
        for (int c = 0; c < C; ++c) acc[i][c] = 0;
        row_lse[i] = lse[h * tokens + safe];
        row_delta[i] = delta[h * tokens + safe];
    }
    for (int64_t k0 = offsets[s]; k0 < key_stop; k0 += kTile) {
        const int count = static_cast<int>(key_stop - k0 < kTile ? key_stop - k0 : kTile);
        __syncthreads();
        stage_rows(k_tile, k, k0, count, kv_heads, g, dim, T(1));
        stage_rows(v_tile, v, k0, count, kv_heads, g, dim_v, T(1));
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
            const int64_t row = q0 + warp * kRowsPerWarp + i;
            if (row >= s1) continue;
            for (int j = 0; j < count; ++j) {
                if (causal && k0 + j > row) break;
                const T p = exp_of(dot_shared<T, C>(qr[i], k_tile + j * dim, dim, lane) -
                                   row_lse[i]);
                const T dp = dot_shared<T, C>(dor[i], v_tile + j * dim_v, dim_v, lane);
                axpy_shared<T, C>(acc[i], p * (dp - row_delta[i]), k_tile + j * dim, dim, lane);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t row = q0 + warp * kRowsPerWarp + i;
        if (row < s1) store_row<T, C>(dq, acc[i], row, heads, h, dim, lane, scale);
    }
}

// dk, dv: grid (key row blocks of all segments, Hkv). Each block loops over the query heads of
// its group and the query tiles that see its keys, so every dk/dv element is summed by one
// warp in a fixed order: dv_j = sum_i p_ij dout_i, dk_j = scale * sum_i ds_ij q_i.
template <typename T, int C>
__global__ void segmented_attention_bwd_dkdv(const T* __restrict__ dout,           // [T, H, Dv]
                                             const T* __restrict__ q,              // [T, H, D]
                                             const T* __restrict__ k,              // [T, Hkv, D]
                                             const T* __restrict__ v,              // [T, Hkv, Dv]
                                             const T* __restrict__ lse,            // [H, T]
                                             const T* __restrict__ delta,          // [H, T]
                                             const int64_t* __restrict__ offsets,  // [S + 1]
                                             const int64_t* __restrict__ block_prefix,  // [S+1]
                                             T* __restrict__ dk,                   // [T, Hkv, D]
                                             T* __restrict__ dv,                   // [T, Hkv, Dv]
                                             int64_t num_segments, int64_t tokens,
                                             int64_t heads, int64_t kv_heads, int64_t dim,
                                             int64_t dim_v, T scale, int32_t causal) {
    using namespace segattn;
    LOWBIT_DYNAMIC_SHARED(T, smem);
    T* q_tile = smem;                          // [kTile, D], times scale
    T* do_tile = q_tile + kTile * dim;         // [kTile, Dv]
    T* lse_tile = do_tile + kTile * dim_v;     // [kTile]
    T* delta_tile = lse_tile + kTile;          // [kTile]
    const int64_t b = blockIdx.x;
    const int64_t g = blockIdx.y;
    const int64_t group = heads / kv_heads;
    const int64_t s = find_segment(block_prefix, num_segments, b);
    const int64_t s1 = offsets[s + 1];
    const int64_t k0 = offsets[s] + (b - block_prefix[s]) * kBlockRows;
    // A causal query sees this block only from its first key on.
    const int64_t query_start = causal ? k0 : offsets[s];
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int lane = threadIdx.x % lowbit::kWarpSize;

    T kr[kRowsPerWarp][C], vr[kRowsPerWarp][C], dk_acc[kRowsPerWarp][C],
        dv_acc[kRowsPerWarp][C];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t key = k0 + warp * kRowsPerWarp + i;
        const int64_t safe = key < s1 ? key : k0;
        load_row<T, C>(kr[i], k, safe, kv_heads, g, dim, lane, T(1));
        load_row<T, C>(vr[i], v, safe, kv_heads, g, dim_v, lane, T(1));
#pragma unroll
        for (int c = 0; c < C; ++c) dk_acc[i][c] = dv_acc[i][c] = 0;
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t r0 = query_start; r0 < s1; r0 += kTile) {
            const int count = static_cast<int>(s1 - r0 < kTile ? s1 - r0 : kTile);
            __syncthreads();
            stage_rows(q_tile, q, r0, count, heads, h, dim, scale);
            stage_rows(do_tile, dout, r0, count, heads, h, dim_v, T(1));
            for (int j = threadIdx.x; j < count; j += kThreads) {
                lse_tile[j] = lse[h * tokens + r0 + j];
                delta_tile[j] = delta[h * tokens + r0 + j];
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < kRowsPerWarp; ++i) {
                const int64_t key = k0 + warp * kRowsPerWarp + i;
                if (key >= s1) continue;
                for (int j = 0; j < count; ++j) {
                    if (causal && r0 + j < key) continue;
                    const T p = exp_of(dot_shared<T, C>(kr[i], q_tile + j * dim, dim, lane) -
                                       lse_tile[j]);
                    const T dp = dot_shared<T, C>(vr[i], do_tile + j * dim_v, dim_v, lane);
                    axpy_shared<T, C>(dv_acc[i], p, do_tile + j * dim_v, dim_v, lane);
                    axpy_shared<T, C>(dk_acc[i], p * (dp - delta_tile[j]), q_tile + j * dim,
                                      dim, lane);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t key = k0 + warp * kRowsPerWarp + i;
        if (key >= s1) continue;
        store_row<T, C>(dk, dk_acc[i], key, kv_heads, g, dim, lane, T(1));
        store_row<T, C>(dv, dv_acc[i], key, kv_heads, g, dim_v, lane, T(1));
    }
}
