// Low-bit quantization: weight codes (ternary, sign, int8) and per-row activation codes.
// Launchers: lowbit/ops/quantize/_cuda.py; reference: reference/quantize.py; tests:
// tests/test_quantize.py. Rounding is half to even (rint/rintf), quotients in the input's type.
#include "common.cuh"

namespace lowbit_quantize {

using lowbit::kInt8;
using lowbit::kSign;
using lowbit::kTernary;
constexpr int kInt8Max = 127;
// Scale floor applied to the statistic before dividing by the level count (BitNet b1.58's).
constexpr double kEps = 1e-5;
// Threads of the per-row kernel: a power of two for the shared-memory tree reduction.
constexpr int kRowThreads = 128;
// Bit pattern of a float quiet NaN: the scale reported for a row holding a non-finite value.
constexpr int kQuietNanBits = 0x7fc00000;

using lowbit::round_even;

template <typename T>
__device__ __forceinline__ T clamp(T v, T lo, T hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}

}  // namespace lowbit_quantize

// Stored code of every weight, output-major: one thread per code (grid-stride). The scale is the
// per-tensor statistic (ternary, sign: scale[0]) or one per output column (int8: scale[n]).
template <int FMT, typename T>
__global__ void weight_codes(const T* __restrict__ w,      // [K, N]
                             const T* __restrict__ scale,  // [1] or [N]
                             uint8_t* __restrict__ out,    // [N, K]; int8 codes for FMT int8
                             int64_t K, int64_t N) {
    using namespace lowbit_quantize;
    const int64_t total = K * N;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t n = idx / K;
        const int64_t k = idx - n * K;
        const T v = w[k * N + n];
        if (FMT == kSign) {
            out[idx] = v >= T(0) ? 1 : 0;
        } else if (FMT == kTernary) {
            const T q = clamp(round_even(v / scale[0]), T(-1), T(1));
            out[idx] = static_cast<uint8_t>(static_cast<int>(q) + 1);
        } else {
            const T q = clamp(round_even(v / scale[n]), T(-kInt8Max), T(kInt8Max));
            out[idx] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(q)));
        }
    }
}

// Per-row absmax quantization, one block of kRowThreads per row (grid-stride over rows). A NaN is
// caught in the absmax pass itself (it compares neither above nor at or below the running max);
// such a row gets a NaN scale, an infinite value an infinite one, and no codes.
template <typename T>
__global__ void quantize_rows(const T* __restrict__ x,     // [M, K]
                              int8_t* __restrict__ codes,  // [M, K]
                              float* __restrict__ scale,   // [M]
                              int64_t M, int64_t K, int32_t qmax) {
    using namespace lowbit_quantize;
    __shared__ T partial[kRowThreads];
    const int tid = threadIdx.x;
    for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
        const T* xr = x + row * K;
        T m = T(0);
        int bad = 0;
        for (int64_t k = tid; k < K; k += kRowThreads) {
            const T a = xr[k] < T(0) ? -xr[k] : xr[k];
            if (a > m) {
                m = a;
            } else if (!(a <= m)) {
                bad = 1;
            }
        }
        partial[tid] = m;
        bad = __syncthreads_or(bad);
        for (int stride = kRowThreads / 2; stride > 0; stride /= 2) {
            if (tid < stride && partial[tid + stride] > partial[tid]) {
                partial[tid] = partial[tid + stride];
            }
            __syncthreads();
        }
        const T absmax = partial[0];
        const T s = (absmax > T(kEps) ? absmax : T(kEps)) / T(qmax);
        if (tid == 0) scale[row] = bad ? __int_as_float(kQuietNanBits) : static_cast<float>(s);
        if (!bad) {
            for (int64_t k = tid; k < K; k += kRowThreads) {
                const T q = clamp(round_even(xr[k] / s), T(-qmax), T(qmax));
                codes[row * K + k] = static_cast<int8_t>(static_cast<int>(q));
            }
        }
        __syncthreads();  // partial[] is reused by the next row
    }
}
