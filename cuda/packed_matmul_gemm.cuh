// The packed matmul's GEMM (included by packed_matmul.cu, whose helpers it uses: Format,
// mma_m16n8k32_s8, scale_acc, aligned_to): y = Qa(x) @ W for more rows than the GEMV takes, on
// 128 x 128 tiles with the weights decoded once per tile into shared memory, ldmatrix and int8
// mma.sync, cp.async double-buffering. Launcher: lowbit/ops/packed_matmul/_cuda.py.
#pragma once
namespace lowbit_pm {

// ---- GEMM ---------------------------------------------------------------------------------
// A block of kGemmWarps = 8 warps computes a kTileM x kTileN = 128 x 128 tile of y; warp w a
// 64 x 32 piece (rows 64 (w / 4), columns 32 (w % 4)): 4 x 4 m16n8k32 mma per 32 k, 32 per
// kTileK = 64 stage. Shared memory holds, per stage, the activation tile and the weight tile
// decoded to int8, both [row][k] with rows of kSmemRow bytes (64 + 16: the pad puts the eight
// rows of an ldmatrix on distinct banks), double-buffered; ternary and sign weights arrive
// packed in a third, raw buffer and are decoded once per stage by the whole block.
// Pipeline of stage s (one barrier a stage): wait for this thread's copies of A(s) and raw
// W(s + 1); barrier; issue A(s + 1) and raw W(s + 2); decode W(s + 1); mma on stage s.
constexpr int kGemmWarps = 8;
constexpr int kGemmThreads = kGemmWarps * lowbit::kWarpSize;
constexpr int kTileM = 128;
constexpr int kTileN = 128;
constexpr int kTileK = 64;
constexpr int kWarpM = 64;
constexpr int kWarpN = 32;
constexpr int kSmemRow = kTileK + 16;
constexpr int kTileWords = kTileM * kSmemRow / 4;

template <int FMT>
struct Gemm {
    static constexpr bool kPacked = FMT != kInt8;
    // Packed bytes of one column per stage, copied in one cp.async (int8 loads like A).
    static constexpr int kRawBytes = kPacked ? kTileK / Format<FMT>::kPerByte : 16;
    static constexpr int kRawWords = kPacked ? kTileN * kRawBytes / 4 : 1;
};

template <int FMT>
struct __align__(16) GemmShared {
    unsigned a[2][kTileWords];
    unsigned b[2][kTileWords];
    unsigned raw[2][Gemm<FMT>::kRawWords];  // unused (one word) for int8
};

// Copies rows [row0, row0 + ROWS) x bytes [col0, col0 + COLS) of a [rows, len] byte matrix with
// row stride `stride` to a shared tile of DST_ROW-byte rows, in BYTES chunks, zero outside the
// matrix: by cp.async where `async` (len a multiple of BYTES, `src` BYTES-aligned), else by
// plain loads and stores.
template <int BYTES, int ROWS, int COLS, int DST_ROW>
__device__ __forceinline__ void load_tile(unsigned* dst, const uint8_t* __restrict__ src,
                                          int64_t row0, int64_t rows, int64_t stride,
                                          int64_t col0, int64_t len, bool async) {
    constexpr int kPerRow = COLS / BYTES;
    constexpr int kChunks = ROWS * kPerRow;
#pragma unroll
    for (int i = 0; i < (kChunks + kGemmThreads - 1) / kGemmThreads; ++i) {
        const int idx = static_cast<int>(threadIdx.x) + i * kGemmThreads;
        if (kChunks % kGemmThreads != 0 && idx >= kChunks) break;
        const int r = idx / kPerRow;
        const int cc = idx % kPerRow * BYTES;
        const int64_t row = row0 + r;
        const int64_t col = col0 + cc;
        const bool inside = row < rows && col < len;
        unsigned* d = dst + (r * DST_ROW + cc) / 4;
        if (async) {
            lowbit::cp_async<BYTES>(d, inside ? src + row * stride + col : src,
                                    inside ? BYTES : 0);
        } else {
            unsigned w[BYTES / 4];
            if (inside) {
                load_bytes<BYTES>(w, src + row * stride, col, len);
            } else {
#pragma unroll
                for (int i = 0; i < BYTES / 4; ++i) w[i] = 0;
            }
#pragma unroll
            for (int i = 0; i < BYTES / 4; ++i) d[i] = w[i];
        }
    }
}

// Ternary word (16 codes) -> out[q] = codes 4q..4q+3 as int8 lanes. Field j of each byte is
// masked out (codes 4 i + j), moved from f = c + 1 to c bytewise (+0x7f then flip bit 7: no
// carry leaves a byte), and the 4 x 4 byte matrix transposed with byte permutes.
__device__ __forceinline__ void decode_ternary(unsigned w, unsigned (&out)[4]) {
    unsigned f[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = (((w >> (2 * j)) & 0x03030303u) + 0x7f7f7f7fu) ^ 0x80808080u;
    const unsigned lo01 = __byte_perm(f[0], f[1], 0x5140), lo23 = __byte_perm(f[2], f[3], 0x5140);
    const unsigned hi01 = __byte_perm(f[0], f[1], 0x7362), hi23 = __byte_perm(f[2], f[3], 0x7362);
    out[0] = __byte_perm(lo01, lo23, 0x5410);
    out[1] = __byte_perm(lo01, lo23, 0x7632);
    out[2] = __byte_perm(hi01, hi23, 0x5410);
    out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Sign word (32 codes) -> out[q] = codes 4q..4q+3: the multiply spreads the four bits of nibble
// q to bit 0 of bytes 0..3 (the shifted copies do not overlap), then 0/1 -> 0xff/0x01.
__device__ __forceinline__ void decode_sign(unsigned w, unsigned (&out)[8]) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const unsigned bits = (((w >> (4 * q)) & 0xfu) * 0x00204081u) & 0x01010101u;
        out[q] = ~(bits * 0xfeu);
    }
}

// The whole block decodes one raw stage (kTileN columns x kRawBytes) into a shared int8 tile:
// thread t takes column t / 2, half t % 2 of its k (32 codes: 8 words out).
template <int FMT>
__device__ __forceinline__ void decode_stage(const unsigned* __restrict__ raw,
                                             unsigned* __restrict__ tile) {
    constexpr int kRawWords = Gemm<FMT>::kRawBytes / 4;  // per column
    const int col = threadIdx.x / 2;
    const int half = threadIdx.x % 2;
    const unsigned* src = raw + col * kRawWords + half * (kRawWords / 2);
    unsigned out[8];
    if (FMT == kTernary) {
        unsigned lo[4], hi[4];
        decode_ternary(src[0], lo);
        decode_ternary(src[1], hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) out[i] = lo[i], out[4 + i] = hi[i];
    } else {
        decode_sign(src[0], out);
    }
    uint4* d = reinterpret_cast<uint4*>(tile + (col * kSmemRow + half * kTileK / 2) / 4);
    d[0] = make_uint4(out[0], out[1], out[2], out[3]);
    d[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace lowbit_pm

// Tiled GEMM on int8 tensor cores (see the GEMM notes above): y[m, n] for a 128 x 128 tile per
// block, row tiles strided by gridDim.y (CUDA caps it at 65535: any M fits).
template <int FMT>
__global__ void __launch_bounds__(lowbit_pm::kGemmThreads, 2)
    gemm_int(const int8_t* __restrict__ codes_x,  // [M, K]
             const float* __restrict__ scale_x,   // [M]
             const uint8_t* __restrict__ data,    // [N, bytes_per_row]
             const float* __restrict__ scale_w,   // [1] or [N]
             float* __restrict__ y,               // [M, N]
             int64_t M, int64_t N, int64_t K, int64_t bytes_per_row, int64_t scale_w_stride) {
    using namespace lowbit_pm;
    using T = Gemm<FMT>;
    __shared__ GemmShared<FMT> s;
    const int warp = threadIdx.x / lowbit::kWarpSize;
    const int lane = threadIdx.x % lowbit::kWarpSize;
    const int wm = (warp / (kTileN / kWarpN)) * kWarpM;
    const int wn = (warp % (kTileN / kWarpN)) * kWarpN;
    const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileN;
    const int64_t stages = (K + kTileK - 1) / kTileK;
    const uint8_t* x8 = reinterpret_cast<const uint8_t*>(codes_x);
    const bool a_async = K % 16 == 0 && aligned_to(codes_x, 16);
    const bool w_async = bytes_per_row % T::kRawBytes == 0 && aligned_to(data, T::kRawBytes);
    // ldmatrix row of this lane: matrix lane / 8, row lane % 8 (see lowbit::ldmatrix_x4).
    const int mat = lane / 8;
    const int a_row = wm + lane % 8 + 8 * (mat % 2);  // + 16 mt; k + 16 (mat / 2)
    const int b_row = wn + lane % 8 + 8 * (mat / 2);  // + 16 np; k + 16 (mat % 2)

    const auto load_a = [&](unsigned* dst, int64_t m0, int64_t st) {
        load_tile<16, kTileM, kTileK, kSmemRow>(dst, x8, m0, M, K, st * kTileK, K, a_async);
    };
    const auto load_w = [&](int64_t st) {  // stage st of W into its buffer
        if (T::kPacked) {
            load_tile<T::kRawBytes, kTileN, T::kRawBytes, T::kRawBytes>(
                s.raw[st % 2], data, n0, N, bytes_per_row, st * T::kRawBytes, bytes_per_row,
                w_async);
        } else {
            load_tile<16, kTileN, kTileK, kSmemRow>(s.b[st % 2], data, n0, N, bytes_per_row,
                                                    st * kTileK, bytes_per_row, w_async);
        }
    };

    for (int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTileM; m0 < M;
         m0 += static_cast<int64_t>(gridDim.y) * kTileM) {
        int c[4][4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) c[mt][nt][i] = 0;

        // Prologue: A(0) and W(0) (and raw W(1)); the block decodes W(0).
        load_a(s.a[0], m0, 0);
        load_w(0);
        if (T::kPacked && stages > 1) load_w(1);
        lowbit::cp_async_commit();
        lowbit::cp_async_wait<0>();
        __syncthreads();
        if (T::kPacked) decode_stage<FMT>(s.raw[0], s.b[0]);

        for (int64_t st = 0; st < stages; ++st) {
            const int cur = static_cast<int>(st % 2);
            lowbit::cp_async_wait<0>();
            __syncthreads();
            if (st + 1 < stages) {
                load_a(s.a[cur ^ 1], m0, st + 1);
                if (!T::kPacked) load_w(st + 1);
                if (T::kPacked && st + 2 < stages) load_w(st + 2);
            }
            lowbit::cp_async_commit();
            if (T::kPacked && st + 1 < stages) decode_stage<FMT>(s.raw[cur ^ 1], s.b[cur ^ 1]);

            const unsigned char* a_tile = reinterpret_cast<const unsigned char*>(s.a[cur]);
            const unsigned char* b_tile = reinterpret_cast<const unsigned char*>(s.b[cur]);
#pragma unroll
            for (int kk = 0; kk < kTileK; kk += 32) {
                unsigned af[4][4];
                unsigned bf[4][2];
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    lowbit::ldmatrix_x4(
                        af[mt], a_tile + (a_row + 16 * mt) * kSmemRow + kk + 16 * (mat / 2));
                }
#pragma unroll
                for (int np = 0; np < 2; ++np) {
                    unsigned r[4];
                    lowbit::ldmatrix_x4(
                        r, b_tile + (b_row + 16 * np) * kSmemRow + kk + 16 * (mat % 2));
                    bf[2 * np][0] = r[0], bf[2 * np][1] = r[1];
                    bf[2 * np + 1][0] = r[2], bf[2 * np + 1][1] = r[3];
                }
#pragma unroll
                for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) mma_m16n8k32_s8(c[mt][nt], af[mt], bf[nt]);
            }
        }

        const int g = lane / 4;
        const int t = lane % 4;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int64_t m = m0 + wm + 16 * mt + g + (i >= 2 ? 8 : 0);
                    const int64_t n = n0 + wn + 8 * nt + 2 * t + (i % 2);
                    if (m < M && n < N) {
                        y[m * N + n] =
                            scale_acc(c[mt][nt][i], scale_x[m], scale_w[n * scale_w_stride]);
                    }
                }
            }
        }
        __syncthreads();  // the next row tile's prologue overwrites the shared tiles
    }
}
