// Packed low-bit matmul: y = Qa(x) @ W with W held as packed ternary/sign/int8 codes, and the
// straight-through backward (dx from the packed codes, dw from the saved activations).
// Launchers: lowbit/ops/packed_matmul/_cuda.py; reference: reference/packed_matmul.py; tests:
// tests/test_packed_matmul.py; benchmark: bench/matmul.py.
//
// Weights are output-major and packed along K, LSB-first (DESIGN.md): row n of `data` holds the
// codes of column n of W. Stored codes: ternary code + 1 in 2 bits, sign 1 bit (1 means +1),
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

// Four consecutive codes k0..k0+3 (k0 a multiple of 4) as the bytes of one int, lowest k in the
// lowest byte; codes at k >= K are zero.
template <int FMT>
__device__ __forceinline__ int weight_code4(const uint8_t* __restrict__ row, int64_t k0,
                                            int64_t K) {
    unsigned word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (k0 + j < K) {
            word |= (static_cast<unsigned>(weight_code<FMT>(row, k0 + j)) & 0xffu) << (8 * j);
        }
    }
    return static_cast<int>(word);
}

__device__ __forceinline__ int act_code4(const int8_t* __restrict__ row, int64_t k0, int64_t K) {
    unsigned word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (k0 + j < K) word |= (static_cast<unsigned>(row[k0 + j]) & 0xffu) << (8 * j);
    }
    return static_cast<int>(word);
}

// D = A * B + C on int8 tensor cores: mma.sync m16n8k32, A row-major 16x32, B column-major
// 32x8, s32 accumulators. Fragment layout (PTX ISA, per lane: group g = lane / 4, t = lane % 4):
//   a[0]: A[g][4t..4t+3]      a[1]: A[g+8][4t..4t+3]
//   a[2]: A[g][16+4t..+3]     a[3]: A[g+8][16+4t..+3]
//   b[0]: B[4t..4t+3][g]      b[1]: B[16+4t..+3][g]
//   c[0], c[1]: C[g][2t], C[g][2t+1]      c[2], c[3]: C[g+8][2t], C[g+8][2t+1]
// The twin (cudasim, or GPUs below sm_80) computes the same fragment from the same registers:
// each lane fetches the A and B words it needs from the lanes that hold them with __shfl_sync
// and accumulates with __dp4a, so the CPU tests check the layout the hardware path assumes.
__device__ __forceinline__ void mma_m16n8k32_s8(int (&c)[4], const int (&a)[4],
                                                const int (&b)[2]) {
#if defined(LOWBIT_CUDASIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int g = lane / 4;
    const int t = lane % 4;
#pragma unroll
    for (int kq = 0; kq < 8; ++kq) {  // k = 4 kq .. 4 kq + 3
        const int holder_t = kq % 4;
        const bool high = kq >= 4;
        const int a_lo = __shfl_sync(lowbit::kFullMask, high ? a[2] : a[0], g * 4 + holder_t);
        const int a_hi = __shfl_sync(lowbit::kFullMask, high ? a[3] : a[1], g * 4 + holder_t);
        const int b0 = __shfl_sync(lowbit::kFullMask, high ? b[1] : b[0], (2 * t) * 4 + holder_t);
        const int b1 =
            __shfl_sync(lowbit::kFullMask, high ? b[1] : b[0], (2 * t + 1) * 4 + holder_t);
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

// GEMM tiling: a block of kGemmWarps warps computes a kTileM x kTileN tile of y, each warp a
// 16 x 16 piece (two m16n8 fragments), over K in steps of kTileK = one mma k32.
constexpr int kGemmWarps = 4;
constexpr int kTileM = 32;
constexpr int kTileN = 32;
constexpr int kTileK = 32;
constexpr int kWordsK = kTileK / 4;
// One spare word per shared row staggers the rows across banks.
constexpr int kRowWords = kWordsK + 1;
// GEMV: one warp per output column.
constexpr int kGemvWarps = 8;

}  // namespace lowbit_pm

// GEMV for few rows: one warp per (row m, column n). Each lane takes groups of four k, decodes the
// four weight codes into the bytes of one int and multiplies them with four activation codes in
// one __dp4a; the warp reduces the exact int32 sum.
template <int FMT>
__global__ void gemv_int(const int8_t* __restrict__ codes_x,  // [M, K]
                         const float* __restrict__ scale_x,   // [M]
                         const uint8_t* __restrict__ data,    // [N, bytes_per_row]
                         const float* __restrict__ scale_w,   // [1] or [N]
                         float* __restrict__ y,               // [M, N]
                         int64_t M, int64_t N, int64_t K, int64_t bytes_per_row,
                         int64_t scale_w_stride) {
    using namespace lowbit_pm;
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int64_t n =
        static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / lowbit::kWarpSize;
    const int64_t m = blockIdx.y;
    if (n >= N) return;  // whole warps leave together
    const uint8_t* row = data + n * bytes_per_row;
    const int8_t* xr = codes_x + m * K;
    int acc = 0;
    for (int64_t k0 = 4 * static_cast<int64_t>(lane); k0 < K; k0 += 4 * lowbit::kWarpSize) {
        acc = __dp4a(act_code4(xr, k0, K), weight_code4<FMT>(row, k0, K), acc);
    }
    acc = lowbit::warp_sum(acc);
    if (lane == 0) y[m * N + n] = scale_acc(acc, scale_x[m], scale_w[n * scale_w_stride]);
}

// Tiled GEMM on int8 tensor cores. The block stages a kTileM x kTileK tile of activation codes and
// a kTileN x kTileK tile of decoded weight codes (both k-contiguous, four codes to a word) in
// shared memory, then each warp issues two m16n8k32 mma per k step.
template <int FMT>
__global__ void gemm_int(const int8_t* __restrict__ codes_x,  // [M, K]
                         const float* __restrict__ scale_x,   // [M]
                         const uint8_t* __restrict__ data,    // [N, bytes_per_row]
                         const float* __restrict__ scale_w,   // [1] or [N]
                         float* __restrict__ y,               // [M, N]
                         int64_t M, int64_t N, int64_t K, int64_t bytes_per_row,
                         int64_t scale_w_stride) {
    using namespace lowbit_pm;
    __shared__ int a_tile[kTileM][kRowWords];
    __shared__ int b_tile[kTileN][kRowWords];
    constexpr int kThreads = kGemmWarps * lowbit::kWarpSize;
    const int tid = threadIdx.x;
    const int warp = tid / lowbit::kWarpSize;
    const int lane = tid % lowbit::kWarpSize;
    const int g = lane / 4;
    const int t = lane % 4;
    const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileN;
    const int wm = (warp / 2) * 16;
    const int wn = (warp % 2) * 16;
    // Row tiles stride by gridDim.y, which CUDA caps at 65535: any M fits.
    for (int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTileM; m0 < M;
         m0 += static_cast<int64_t>(gridDim.y) * kTileM) {
        int c[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
        for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
            for (int w = tid; w < kTileM * kWordsK; w += kThreads) {
                const int r = w / kWordsK;
                const int q = w % kWordsK;
                const int64_t m = m0 + r;
                a_tile[r][q] = m < M ? act_code4(codes_x + m * K, k0 + 4 * q, K) : 0;
                const int64_t n = n0 + r;
                b_tile[r][q] =
                    n < N ? weight_code4<FMT>(data + n * bytes_per_row, k0 + 4 * q, K) : 0;
            }
            __syncthreads();
            const int a[4] = {a_tile[wm + g][t], a_tile[wm + g + 8][t], a_tile[wm + g][4 + t],
                              a_tile[wm + g + 8][4 + t]};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int b[2] = {b_tile[wn + nt * 8 + g][t], b_tile[wn + nt * 8 + g][4 + t]};
                mma_m16n8k32_s8(c[nt], a, b);
            }
            __syncthreads();
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int64_t m = m0 + wm + g + (i >= 2 ? 8 : 0);
                const int64_t n = n0 + wn + nt * 8 + 2 * t + (i % 2);
                if (m < M && n < N) {
                    y[m * N + n] = scale_acc(c[nt][i], scale_x[m], scale_w[n * scale_w_stride]);
                }
            }
        }
    }
}

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
