// Packed low-bit matmul: y = Qa(x) @ W with W held as packed ternary/sign/int8 codes, and the
// straight-through backward (dx from the packed codes, dw from the saved activations).
// Launchers: lowbit/ops/packed_matmul/_cuda.py; reference: reference/packed_matmul.py; tests:
// tests/test_packed_matmul.py; benchmark: bench/matmul.py. The GEMM is packed_matmul_gemm.cuh.
//
// Weights are output-major and packed along K, LSB-first (docs/ops.rst): row n of `data` holds
// the codes of column n of W. Stored codes: ternary code + 1 in 2 bits, sign 1 bit (1 means +1),
// int8 one signed byte.
#include "common.cuh"

namespace lowbit_pm {

using lowbit::kInt8;
using lowbit::kSign;
using lowbit::kTernary;

template <int FMT>
struct Format {
    static constexpr int kBits = FMT == kTernary ? 2 : (FMT == kSign ? 1 : 8);
    static constexpr int kPerByte = lowbit::kCodesPerByte<kBits>;
};

// Signed code of weight (k, n); `row` is data + n * bytes_per_row.
template <int FMT>
__device__ __forceinline__ int weight_code(const uint8_t* __restrict__ row, int64_t k) {
    if (FMT == kInt8) return static_cast<int8_t>(row[k]);
    constexpr int kPer = Format<FMT>::kPerByte;
    const int field = static_cast<int>(
        lowbit::unpack_code<Format<FMT>::kBits>(row[k / kPer], static_cast<int>(k % kPer)));
    return FMT == kTernary ? field - 1 : 2 * field - 1;
}

// D = A * B + C on int8 tensor cores: mma.sync m16n8k32, A row-major 16x32, B column-major
// 32x8, s32 accumulators. Fragment layout (PTX ISA, per lane: group g = lane / 4, t = lane % 4):
//   a[0]: A[g][4t..4t+3]      a[1]: A[g+8][4t..4t+3]
//   a[2]: A[g][16+4t..+3]     a[3]: A[g+8][16+4t..+3]
//   b[0]: B[4t..4t+3][g]      b[1]: B[16+4t..+3][g]
//   c[0], c[1]: C[g][2t], C[g][2t+1]      c[2], c[3]: C[g+8][2t], C[g+8][2t+1]
// The twin (cudasim, or GPUs below sm_80) computes the same fragment from the same registers:
// each lane fetches the A and B words it needs from the lanes that hold them (lowbit::WarpValues,
// two words to a 64-bit value) and accumulates with __dp4a, so the CPU tests check the layout
// the hardware path assumes.
__device__ __forceinline__ void mma_m16n8k32_s8(int (&c)[4], const unsigned (&a)[4],
                                                const unsigned (&b)[2]) {
#if defined(LOWBIT_CUDASIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
    const int lane = lowbit::thread_rank() % lowbit::kWarpSize;
    const int g = lane / 4;
    const int t = lane % 4;
    const auto pair = [](unsigned lo, unsigned hi) {
        return static_cast<unsigned long long>(hi) << 32 | lo;
    };
    const unsigned long long mine[3] = {pair(a[0], a[1]), pair(a[2], a[3]), pair(b[0], b[1])};
    const lowbit::WarpValues<3> frag(mine);
#pragma unroll
    for (int kq = 0; kq < 8; ++kq) {  // k = 4 kq .. 4 kq + 3, held by lanes with t = kq % 4
        const int holder_t = kq % 4;
        const bool high = kq >= 4;
        const unsigned long long rows = frag(g * 4 + holder_t, high ? 1 : 0);  // rows g, g + 8
        const unsigned long long col0 = frag(2 * t * 4 + holder_t, 2);
        const unsigned long long col1 = frag((2 * t + 1) * 4 + holder_t, 2);
        const int a_lo = static_cast<int>(rows), a_hi = static_cast<int>(rows >> 32);
        const int b0 = static_cast<int>(high ? col0 >> 32 : col0);
        const int b1 = static_cast<int>(high ? col1 >> 32 : col1);
        c[0] = __dp4a(a_lo, b0, c[0]);
        c[1] = __dp4a(a_lo, b1, c[1]);
        c[2] = __dp4a(a_hi, b0, c[2]);
        c[3] = __dp4a(a_hi, b1, c[3]);
    }
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// y = float(acc) * scale_x * scale_w, rounded in float32 in that order (as the reference).
__device__ __forceinline__ float scale_acc(int acc, float sx, float sw) {
    const float partial = static_cast<float>(acc) * sx;
    return partial * sw;
}

__device__ __forceinline__ bool aligned_to(const void* p, int bytes) {
    return reinterpret_cast<unsigned long long>(p) % static_cast<unsigned>(bytes) == 0;
}

// Bytes [col, col + BYTES) of a row of `len` bytes as BYTES / 4 words, zero past the row.
template <int BYTES>
__device__ __forceinline__ void load_bytes(unsigned (&w)[BYTES / 4], const uint8_t* row,
                                           int64_t col, int64_t len) {
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) {
        unsigned v = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int64_t k = col + 4 * i + j;
            if (k < len) v |= static_cast<unsigned>(row[k]) << (8 * j);
        }
        w[i] = v;
    }
}

// ---- GEMV ---------------------------------------------------------------------------------
// One warp per column n, all M (<= kGemvMaxRows) rows at once, so each packed weight byte is
// read once. A lane loads 16 packed bytes (one 128-bit load: 64 ternary, 128 sign or 16 int8
// codes) and turns each 32-bit word into kPerByte int8 words with a shift and a mask, without
// reordering: word j holds field j of each of the four bytes, i.e. codes 4 P i + j (P codes a
// byte, i = 0..3). The activations were put in that same order by gemv_codes, so __dp4a pairs
// each weight with its activation. For ternary and sign the decoded bytes are -64 c (the field
// lands in the top two bits of its byte), so the sum is -64 x the exact sum; the launcher keeps
// K <= kGemvMaxK so that this never leaves int32.
constexpr int kGemvWarps = 8;
constexpr int kGemvMaxRows = 8;
constexpr int kGemvChunk = 16;  // packed bytes a lane loads at once
// |sum| <= 127 K must stay below 2^25 for 64 |sum| to fit in an int32.
constexpr int kGemvMaxK = (1 << 25) / 127;

template <int FMT>
struct Gemv {
    static constexpr int kPer = Format<FMT>::kPerByte;
    // Codes of one lane chunk, and the padded activation rows are a multiple of it.
    static constexpr int kChunkCodes = kGemvChunk * kPer;
    static constexpr int kShift = FMT == kInt8 ? 0 : 6;
};

// Field j of each byte of w as an int8 lane: -64 c for ternary and sign, c for int8.
template <int FMT>
__device__ __forceinline__ int gemv_field(unsigned w, int j) {
    if (FMT == kTernary) {
        // Stored field f = c + 1 in bits 6..7 with bit 6 flipped: 01, 00, 11 = -c in two bits.
        return static_cast<int>(((w << (6 - 2 * j)) & 0xc0c0c0c0u) ^ 0x40404040u);
    }
    if (FMT == kSign) {
        // Bit 1 (+1) -> 0xc0 = -64, bit 0 (-1) -> 0x40 = +64.
        return static_cast<int>(((w << (7 - j)) & 0x80808080u) | 0x40404040u);
    }
    return static_cast<int>(w);
}

}  // namespace lowbit_pm

// Activation codes in the GEMV's order, zero-padded to Kp (a multiple of kChunkCodes) columns:
// within each group of 4 P codes, xp[4 j + i] = x[P i + j] (i < 4, j < P). A thread writes 16
// bytes (one 128-bit store); grid-stride.
template <int FMT>
__global__ void gemv_codes(const int8_t* __restrict__ codes_x,  // [M, K]
                           int8_t* __restrict__ xp,             // [M, Kp]
                           int64_t M, int64_t K, int64_t Kp) {
    constexpr int kPer = lowbit_pm::Format<FMT>::kPerByte;
    const int64_t words = M * Kp / 16;
    for (int64_t idx = lowbit::grid_index(); idx < words; idx += lowbit::grid_stride()) {
        const int64_t m = idx / (Kp / 16);
        const int64_t p0 = (idx - m * (Kp / 16)) * 16;
        unsigned w[4];
#pragma unroll
        for (int b = 0; b < 16; ++b) {
            const int64_t p = p0 + b;
            const int q = static_cast<int>(p % (4 * kPer));
            const int64_t k = p - q + kPer * (q % 4) + q / 4;
            const unsigned code = k < K ? static_cast<uint8_t>(codes_x[m * K + k]) : 0u;
            w[b / 4] = (b % 4 ? w[b / 4] : 0u) | code << (8 * (b % 4));
        }
        reinterpret_cast<uint4*>(xp)[idx] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// y[m, n] for m < M <= kGemvMaxRows: one warp per column, lanes over 16-byte chunks of its packed
// row, one warp reduction per output (see the GEMV notes above).
template <int FMT>
__global__ void __launch_bounds__(lowbit_pm::kGemvWarps * lowbit::kWarpSize)
    gemv_int(const int8_t* __restrict__ xp,      // [M, Kp] from gemv_codes
             const float* __restrict__ scale_x,  // [M]
             const uint8_t* __restrict__ data,   // [N, bytes_per_row]
             const float* __restrict__ scale_w,  // [1] or [N]
             float* __restrict__ y,              // [M, N]
             int64_t M, int64_t N, int64_t Kp, int64_t bytes_per_row, int64_t scale_w_stride) {
    using namespace lowbit_pm;
    using G = Gemv<FMT>;
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t n =
        static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / lowbit::kWarpSize;
    if (n >= N) return;  // whole warps leave together
    const uint8_t* row = data + n * bytes_per_row;
    // Whole-row 128-bit loads where every row starts 16-byte aligned; else bytes.
    const bool vector = bytes_per_row % kGemvChunk == 0 && aligned_to(data, kGemvChunk);
    const int64_t chunks = (bytes_per_row + kGemvChunk - 1) / kGemvChunk;
    int acc[kGemvMaxRows];
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) acc[m] = 0;
    for (int64_t ch = lane; ch < chunks; ch += lowbit::kWarpSize) {
        unsigned w[4];
        if (vector) {
            const uint4 v = reinterpret_cast<const uint4*>(row)[ch];
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        } else {
            load_bytes<kGemvChunk>(w, row, ch * kGemvChunk, bytes_per_row);
        }
#pragma unroll
        for (int m = 0; m < kGemvMaxRows; ++m) {
            if (m >= M) break;
            const uint4* xq = reinterpret_cast<const uint4*>(xp + m * Kp) + ch * G::kPer;
#pragma unroll
            for (int v4 = 0; v4 < G::kPer; ++v4) {  // 16 activation bytes = 4 words
                const uint4 a = xq[v4];
                const int aw[4] = {static_cast<int>(a.x), static_cast<int>(a.y),
                                   static_cast<int>(a.z), static_cast<int>(a.w)};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // Activation word 4 v4 + e of the chunk pairs with field j of weight word q.
                    const int q = (4 * v4 + e) / G::kPer;
                    const int j = (4 * v4 + e) % G::kPer;
                    acc[m] = __dp4a(aw[e], gemv_field<FMT>(w[q], j), acc[m]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) {
        if (m >= M) break;
        const int sum = lowbit::warp_sum(acc[m]);
        // -64 x the exact sum (ternary, sign): an exact arithmetic shift, then the sign.
        const int exact = G::kShift ? -(sum >> G::kShift) : sum;
        if (lane == m) y[m * N + n] = scale_acc(exact, scale_x[m], scale_w[n * scale_w_stride]);
    }
}

#include "packed_matmul_gemm.cuh"

// y = (x @ codes_w) * scale_w with float32 accumulation: one warp per (m, n), lanes over k, a
// fixed-order warp reduction (deterministic). Blocks stride over (row, group of kGemvWarps
// columns) tasks on a 1-D grid, so the number of rows meets no grid limit.
template <int FMT>
__global__ void matmul_float(const float* __restrict__ x,        // [M, K]
                             const uint8_t* __restrict__ data,   // [N, bytes_per_row]
                             const float* __restrict__ scale_w,  // [1] or [N]
                             float* __restrict__ y,              // [M, N]
                             int64_t M, int64_t N, int64_t K, int64_t bytes_per_row,
                             int64_t scale_w_stride) {
    using namespace lowbit_pm;
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t groups = (N + kGemvWarps - 1) / kGemvWarps;
    for (int64_t task = blockIdx.x; task < M * groups; task += gridDim.x) {
        const int64_t m = task / groups;
        const int64_t n = (task % groups) * kGemvWarps + threadIdx.x / lowbit::kWarpSize;
        if (n >= N) continue;  // whole warps skip together
        const uint8_t* row = data + n * bytes_per_row;
        const float* xr = x + m * K;
        float acc = 0.0f;
        for (int64_t k = lane; k < K; k += lowbit::kWarpSize) {
            acc += xr[k] * static_cast<float>(weight_code<FMT>(row, k));
        }
        acc = lowbit::warp_sum(acc);
        if (lane == 0) y[m * N + n] = acc * scale_w[n * scale_w_stride];
    }
}

// dx of int8 gradient codes: float32(dy_codes @ codes_w^T) * dy_scale[m] * scale, exact int32
// sums, one thread per (m, k) (grid-stride), looping over n; the two products in that order.
template <int FMT>
__global__ void matmul_dx_int(const int8_t* __restrict__ dy_codes,  // [M, N]
                              const float* __restrict__ dy_scale,   // [M]
                              const uint8_t* __restrict__ data,     // [N, bytes_per_row]
                              const float* __restrict__ scale,      // [1]
                              float* __restrict__ dx,               // [M, K]
                              int64_t M, int64_t N, int64_t K, int64_t bytes_per_row) {
    using namespace lowbit_pm;
    const int64_t total = M * K;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t m = idx / K;
        const int64_t k = idx - m * K;
        const int8_t* g = dy_codes + m * N;
        int acc = 0;
        for (int64_t n = 0; n < N; ++n) {
            acc += static_cast<int>(g[n]) * weight_code<FMT>(data + n * bytes_per_row, k);
        }
        dx[idx] = static_cast<float>(acc) * dy_scale[m] * scale[0];
    }
}

// dx = dy @ (codes_w * scale_w)^T: one thread per (m, k) (grid-stride), looping over n. Ternary
// and sign add or subtract dy and multiply by the per-tensor scale once; int8 weighs each term by
// its column scale.
template <int FMT>
__global__ void matmul_dx(const float* __restrict__ dy,       // [M, N]
                          const uint8_t* __restrict__ data,   // [N, bytes_per_row]
                          const float* __restrict__ scale_w,  // [1] or [N]
                          float* __restrict__ dx,             // [M, K]
                          int64_t M, int64_t N, int64_t K, int64_t bytes_per_row) {
    using namespace lowbit_pm;
    const int64_t total = M * K;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t m = idx / K;
        const int64_t k = idx - m * K;
        const float* g = dy + m * N;
        float acc = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
            const int code = weight_code<FMT>(data + n * bytes_per_row, k);
            if (FMT == kInt8) {
                acc += g[n] * scale_w[n] * static_cast<float>(code);
            } else if (code > 0) {
                acc += g[n];
            } else if (code < 0) {
                acc -= g[n];
            }
        }
        dx[idx] = FMT == kInt8 ? acc : acc * scale_w[0];
    }
}

// dw = Qa(x)^T @ dy from the saved int8 codes and row scales: one thread per (k, n), grid-stride,
// looping over m in order (deterministic).
__global__ void matmul_dw_codes(const int8_t* __restrict__ codes,   // [M, K]
                                const float* __restrict__ scale_x,  // [M]
                                const float* __restrict__ dy,       // [M, N]
                                float* __restrict__ dw,             // [K, N]
                                int64_t M, int64_t N, int64_t K) {
    const int64_t total = K * N;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t k = idx / N;
        const int64_t n = idx - k * N;
        float acc = 0.0f;
        for (int64_t m = 0; m < M; ++m) {
            acc += (static_cast<float>(codes[m * K + k]) * scale_x[m]) * dy[m * N + n];
        }
        dw[idx] = acc;
    }
}

// dw = x^T @ dy from the saved float activations (no activation format).
__global__ void matmul_dw_float(const float* __restrict__ x,   // [M, K]
                                const float* __restrict__ dy,  // [M, N]
                                float* __restrict__ dw,        // [K, N]
                                int64_t M, int64_t N, int64_t K) {
    const int64_t total = K * N;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t k = idx / N;
        const int64_t n = idx - k * N;
        float acc = 0.0f;
        for (int64_t m = 0; m < M; ++m) acc += x[m * K + k] * dy[m * N + n];
        dw[idx] = acc;
    }
}
