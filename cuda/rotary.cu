// Rotary position embedding: every pair of the head dimension turned by its token's angle, for
// float and double, in the half style (pairs j, j + D/2) or the interleaved one (2j, 2j + 1).
// Launchers: lowbit/ops/rotary/_cuda.py; reference: reference/rotary.py; tests:
// tests/test_rotary.py.
//
// The cos/sin tables [T, D/2] come from the host side (lowbit.ops.rotary.rotary_tables: float64
// angles rounded once to T), so the kernel is a pure element-wise rotation: the forward with
// sign = +1, the backward (the transpose) with sign = -1, the same two products and one sum per
// output on every backend. One block per token (grid-stride over tokens), its threads over the
// H * D/2 pairs of the token; no thread writes what another one reads, so the results are
// bitwise deterministic.
#include "common.cuh"

namespace lowbit_rotary {

// Threads per block (pairs of one token in flight).
constexpr int kThreads = 128;

}  // namespace lowbit_rotary

// y_a = x_a cos - x_b (sign sin), y_b = x_b cos + x_a (sign sin), for the pair (a, b) of pair
// index j of every head. Grid: min(T, cap) blocks of kThreads threads.
template <typename T, bool kInterleaved>
__global__ void rotary_rotate(const T* __restrict__ x,      // [tokens, H, D]
                              const T* __restrict__ cos_t,  // [tokens, D / 2]
                              const T* __restrict__ sin_t,  // [tokens, D / 2]
                              T* __restrict__ y,            // [tokens, H, D]
                              int64_t tokens, int64_t H, int64_t D, T sign) {
    using namespace lowbit_rotary;
    const int64_t half = D / 2;
    // Each thread walks (h, j) by kThreads pairs a step, (dh, dj) in (head, pair) terms:
    // divisions once, none inside the loops.
    const int64_t h0 = threadIdx.x / half;
    const int64_t j0 = threadIdx.x - h0 * half;
    const int64_t dh = kThreads / half;
    const int64_t dj = kThreads - dh * half;
    for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
        const T* ct = cos_t + t * half;
        const T* st = sin_t + t * half;
        int64_t h = h0;
        int64_t j = j0;
        while (h < H) {
            const int64_t base = (t * H + h) * D;
            const int64_t ia = base + (kInterleaved ? 2 * j : j);
            const int64_t ib = ia + (kInterleaved ? 1 : half);
            const T c = ct[j];
            const T s = sign * st[j];
            const T a = x[ia];
            const T b = x[ib];
            y[ia] = a * c - b * s;
            y[ib] = b * c + a * s;
            h += dh;
            j += dj;
            if (j >= half) {
                j -= half;
                ++h;
            }
        }
    }
}
