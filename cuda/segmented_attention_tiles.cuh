// Device helpers of the segmented attention kernels (included by segmented_attention.cu, whose
// header comment describes the register blocking): tile loads, the V x V score blocks, the
// row statistics and the products with a feature-wide result.
#pragma once
#include "common.cuh"

namespace segattn {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * lowbit::kWarpSize;
constexpr int kRowGroups = 4;
constexpr int kColGroups = lowbit::kWarpSize / kRowGroups;
constexpr int kVecBytes = 16;
template <typename T>
constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));
// Rows per block and rows of the other operand per shared tile.
template <typename T>
constexpr int kBlockRows = kWarps * kRowGroups * kVec<T>;
template <typename T>
constexpr int kTileRows = kColGroups * kVec<T>;

using lowbit::exp_of;
using lowbit::log_of;
using lowbit::max_of;

// -infinity from its bit pattern: NVRTC has no <cmath> INFINITY.
constexpr int kNegInfFloatBits = static_cast<int>(0xff800000u);
constexpr long long kNegInfDoubleBits = static_cast<long long>(0xfff0000000000000ull);
template <typename T>
__device__ __forceinline__ T neg_inf() {
    return sizeof(T) == sizeof(float) ? T(__int_as_float(kNegInfFloatBits))
                                      : T(__longlong_as_double(kNegInfDoubleBits));
}

// a * b + c in one rounding (NVRTC compiles with -fmad=false: only fma gives FFMA / DFMA).
using lowbit::fma_of;

// One 16-byte shared-memory load.
template <typename T>
struct alignas(kVecBytes) Vec {
    T e[kVec<T>];
};
template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T>*>(p);
}

// Shared row width of a feature axis of `dim` elements (zero-padded), and the row stride.
template <typename T>
__device__ __forceinline__ int tile_width(int64_t dim) {
    constexpr int kChunk = kColGroups * kVec<T>;
    return static_cast<int>((dim + kChunk - 1) / kChunk) * kChunk;
}
template <typename T>
__device__ __forceinline__ int tile_stride(int64_t dim) {
    return tile_width<T>(dim) + kVec<T>;
}

// The segment holding row block `b`: the last s with block_prefix[s] <= b (segments without
// rows hold no block and are passed over).
__device__ __forceinline__ int64_t find_segment(const int64_t* __restrict__ block_prefix,
                                                int64_t num_segments, int64_t b) {
    int64_t lo = 0, hi = num_segments - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        const bool after = block_prefix[mid] <= b;
        lo = after ? mid : lo;
        hi = after ? hi : mid - 1;
    }
    return lo;
}

// Issues the asynchronous copy (lowbit::cp_async) of rows [r0, r0 + count) of one head of a
// token-major [T, heads, dim] tensor into `rows` shared rows of tile_width(dim) elements at
// tile_stride(dim), zero past count and dim, so the products below read padding as zeros. The
// tile is readable once a cp_async_wait covering the group it is committed in, then a
// __syncthreads, have passed.
template <typename T>
__device__ __forceinline__ void stage(T* __restrict__ tile, const T* __restrict__ src, int64_t r0,
                                      int count, int rows, int64_t heads, int64_t head,
                                      int64_t dim) {
    constexpr int kBytes = static_cast<int>(sizeof(T));
    const int width = tile_width<T>(dim), stride = tile_stride<T>(dim);
    const int warp = threadIdx.x / lowbit::kWarpSize, lane = threadIdx.x % lowbit::kWarpSize;
    // A warp per row, lanes along it: coalesced loads, conflict-free stores, no division.
    for (int r = warp; r < rows; r += kWarps) {
        const int64_t base = ((r0 + (r < count ? r : 0)) * heads + head) * dim;
        for (int d = lane; d < width; d += lowbit::kWarpSize) {
            const bool inside = r < count && d < dim;
            lowbit::cp_async<kBytes>(tile + r * stride + d, src + base + (inside ? d : 0),
                                     inside ? kBytes : 0);
        }
    }
}

// acc[i][t] += sum_d a_i[d] * b_t[d] over d < dim: a V x V score block from shared rows of
// stride `stride`, a_i at a + kRowGroups * i rows, b_t at b + kColGroups * t rows. The padding
// is zero, so the loop runs over whole pairs of vectors.
template <typename T>
__device__ __forceinline__ void score_block(T (&acc)[kVec<T>][kVec<T>], const T* __restrict__ a,
                                            const T* __restrict__ b, int stride, int64_t dim) {
    constexpr int V = kVec<T>;
    for (int d = 0; d < dim; d += 2 * V) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            Vec<T> av[V], bv[V];
#pragma unroll
            for (int i = 0; i < V; ++i) av[i] = load_vec(a + i * kRowGroups * stride + d + u * V);
#pragma unroll
            for (int t = 0; t < V; ++t) bv[t] = load_vec(b + t * kColGroups * stride + d + u * V);
#pragma unroll
            for (int eit = 0; eit < V * V * V; ++eit) {  // feature e outermost, then i, t
                const int e = eit / (V * V), i = eit / V % V, t = eit % V;
                acc[i][t] = fma_of(av[i].e[e], bv[t].e[e], acc[i][t]);
            }
        }
    }
}

// acc[i][c][w] += sum_j p_i[j] * b[j][(c * kColGroups + cg) * V + w] over the kTileRows<T>
// rows j of `b` (shared, stride ldb); p_i is row rg + kRowGroups * i of this warp's
// [kRowGroups * V][kTileRows + V] shared block, `p` pointing at row rg. Chunks c at or past
// `chunks` (warp-uniform) are skipped.
template <typename T, int NC>
__device__ __forceinline__ void accumulate_rows(T (&acc)[kVec<T>][NC][kVec<T>],
                                                const T* __restrict__ p, const T* __restrict__ b,
                                                int ldb, int chunks, int cg) {
    constexpr int V = kVec<T>, kLdp = kTileRows<T> + V;
#pragma unroll 2
    for (int j0 = 0; j0 < kTileRows<T>; j0 += V) {
        Vec<T> pv[V];
#pragma unroll
        for (int i = 0; i < V; ++i) pv[i] = load_vec(p + i * kRowGroups * kLdp + j0);
#pragma unroll
        for (int e = 0; e < V; ++e) {
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                if (c >= chunks) break;
                const Vec<T> bv = load_vec(b + (j0 + e) * ldb + (c * kColGroups + cg) * V);
#pragma unroll
                for (int iw = 0; iw < V * V; ++iw) {
                    T& a = acc[iw / V][c][iw % V];
                    a = fma_of(pv[iw / V].e[e], bv.e[iw % V], a);
                }
            }
        }
    }
}

// Writes a V x V block (rows rg + kRowGroups * i, columns cg + kColGroups * t) into this warp's
// [kRowGroups * V][kTileRows + V] shared block.
template <typename T>
__device__ __forceinline__ void put_block(T* __restrict__ p, const T (&x)[kVec<T>][kVec<T>],
                                          int rg, int cg) {
    constexpr int V = kVec<T>, kLdp = kTileRows<T> + V;
#pragma unroll
    for (int it = 0; it < V * V; ++it) {
        p[(rg + it / V * kRowGroups) * kLdp + cg + it % V * kColGroups] = x[it / V][it % V];
    }
}

// Max (kMax) or sum over the kColGroups lanes of a row group, in a fixed xor order.
template <bool kMax, typename T>
__device__ __forceinline__ T row_reduce(T x) {
#pragma unroll
    for (int o = 1; o < kColGroups; o *= 2) {
        const T y = __shfl_xor_sync(lowbit::kFullMask, x, o);
        x = kMax ? max_of(x, y) : x + y;
    }
    return x;
}

// Feature chunks of kColGroups * V elements that cover `dim`.
template <typename T>
__device__ __forceinline__ int chunks_of(int64_t dim) {
    return tile_width<T>(dim) / (kColGroups * kVec<T>);
}

// The block's place: its segment s, the segment's rows, the block's first row and rows held.
struct Rows {
    int64_t seg, seg_start, seg_end, r0;
    int count;
};
template <typename T>
__device__ __forceinline__ Rows block_rows(const int64_t* __restrict__ offsets,
                                           const int64_t* __restrict__ block_prefix,
                                           int64_t num_segments) {
    const int64_t b = blockIdx.x;
    const int64_t s = find_segment(block_prefix, num_segments, b);
    const int64_t r0 = offsets[s] + (b - block_prefix[s]) * kBlockRows<T>;
    const int64_t left = offsets[s + 1] - r0;
    return Rows{s, offsets[s], offsets[s + 1], r0,
                static_cast<int>(left < kBlockRows<T> ? left : kBlockRows<T>)};
}

// The keys of a query block's segment: [start, stop), stop causally clipped to what the block's
// last row sees, and shift = key segment end - query segment end (row r sees keys j <= r + shift
// when causal: the mask aligned bottom-right).
struct KeyRange {
    int64_t start, stop, shift;
};
__device__ __forceinline__ KeyRange key_range(const Rows& blk,
                                              const int64_t* __restrict__ k_offsets,
                                              int32_t causal) {
    const int64_t start = k_offsets[blk.seg], end = k_offsets[blk.seg + 1];
    const int64_t shift = end - blk.seg_end;
    int64_t stop = end;
    if (causal) {
        const int64_t seen = blk.r0 + blk.count + shift;
        stop = seen < start ? start : (seen < end ? seen : end);
    }
    return KeyRange{start, stop, shift};
}

// This thread's place in the block: warp, lane (rg, cg) and its first block row.
struct Lane {
    int warp, rg, cg, row0;
};
template <typename T>
__device__ __forceinline__ Lane lane_of() {
    const int warp = threadIdx.x / lowbit::kWarpSize, lane = threadIdx.x % lowbit::kWarpSize;
    const int rg = lane / kColGroups;
    return Lane{warp, rg, lane % kColGroups, warp * kRowGroups * kVec<T> + rg};
}

// Stores this lane's chunks of its rows row0 + kRowGroups * i (i < V) of a [rows, dim] result,
// times mul, into dst[((blk.r0 + row) * heads + head) * dim + col] for rows in the segment.
template <typename T, int NC>
__device__ __forceinline__ void store_rows(T* __restrict__ dst,
                                           const T (&acc)[kVec<T>][NC][kVec<T>], T mul,
                                           const Rows& blk, const Lane& ln, int64_t heads,
                                           int64_t head, int64_t dim) {
    constexpr int V = kVec<T>;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int r = ln.row0 + i * kRowGroups;
#pragma unroll
        for (int cw = 0; cw < NC * V; ++cw) {
            const int64_t col = (cw / V * kColGroups + ln.cg) * V + cw % V;
            if (r < blk.count && col < dim) {
                dst[((blk.r0 + r) * heads + head) * dim + col] = acc[i][cw / V][cw % V] * mul;
            }
        }
    }
}

}  // namespace segattn
