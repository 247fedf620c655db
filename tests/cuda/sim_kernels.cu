// Test-only kernels for the cudasim emulation header (cuda/cudasim.cuh, run by
// tests/test_cudasim.py) and the NVRTC compile check (lowbit/_nvrtc.py, tests/test_nvrtc.py).
// They use no standard headers: NVRTC has none.
#include "common.cuh"

namespace {
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxWarps = 32;
constexpr int kTile = 32;
constexpr int kTileRows = 8;
}  // namespace

// Sum of x[0:n] per block: warp shuffles, then one partial per warp through shared memory.
extern "C" __global__ void block_reduce_sum(const float* __restrict__ x,  // [n]
                                            float* __restrict__ partial,  // [gridDim.x]
                                            int n) {
    __shared__ float warp_sums[kMaxWarps];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    for (int offset = warpSize / 2; offset > 0; offset /= 2) {
        v += __shfl_down_sync(kFull, v, offset);
    }
    const int lane = threadIdx.x % warpSize;
    const int warp = threadIdx.x / warpSize;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int nwarps = (blockDim.x + warpSize - 1) / warpSize;
        float s = lane < nwarps ? warp_sums[lane] : 0.0f;
        for (int offset = warpSize / 2; offset > 0; offset /= 2) {
            s += __shfl_xor_sync(kFull, s, offset);
        }
        if (lane == 0) partial[blockIdx.x] = s;
    }
}

// out = in^T through a padded shared tile; blocks of (kTile, kTileRows) threads.
extern "C" __global__ void transpose_tiled(const float* __restrict__ in,  // [rows, cols]
                                           float* __restrict__ out,       // [cols, rows]
                                           int rows, int cols) {
    __shared__ float tile[kTile][kTile + 1];
    const int c0 = blockIdx.x * kTile;
    const int r0 = blockIdx.y * kTile;
    for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
        const int r = r0 + dy, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[dy][threadIdx.x] = in[r * cols + c];
    }
    __syncthreads();
    for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
        const int c = c0 + dy, r = r0 + threadIdx.x;
        if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][dy];
    }
}

// Reverses each block's chunk of x through dynamic shared memory of blockDim.x floats; also
// reports the buffer's alignment and whether it was already written when the block started
// (poisoned under cudasim).
extern "C" __global__ void dyn_shared_reverse(const float* __restrict__ x,  // [n]
                                              float* __restrict__ y,        // [n]
                                              int* __restrict__ info,       // [2]
                                              int n) {
    LOWBIT_DYNAMIC_SHARED(float, buf);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        info[0] = static_cast<int>(reinterpret_cast<unsigned long long>(buf) % 16);
        info[1] = __float_as_int(buf[0]);
    }
    __syncthreads();
    buf[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    const int j = blockIdx.x * blockDim.x + (blockDim.x - 1 - threadIdx.x);
    if (j < n) y[j] = buf[threadIdx.x];
}

extern "C" __global__ void histogram(const int* __restrict__ x,  // [n]
                                     int* __restrict__ bins,     // [nbins]
                                     int n, int nbins) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        atomicAdd(&bins[x[i] % nbins], 1);
    }
}

// out: [8] accumulators, every thread of the grid contributes its global index g.
extern "C" __global__ void atomics_misc(int* __restrict__ out,             // [8]
                                        unsigned* __restrict__ uout,       // [2]
                                        float* __restrict__ fout,          // [1]
                                        unsigned long long* __restrict__ big) {  // [1]
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicMax(&out[0], g);
    atomicMin(&out[1], g);
    atomicOr(&out[2], 1 << (g % 31));
    atomicExch(&out[3], 7);
    atomicCAS(&out[4], 0, g + 1);  // only the first thread to arrive swaps
    atomicAdd(&out[5], g);
    atomicSub(&out[6], 1);
    atomicAnd(&out[7], ~(1 << (g % 31)));
    atomicAdd(&uout[0], 2u);
    atomicInc(&uout[1], 9u);
    atomicAdd(&fout[0], 0.5f);
    atomicAdd(&big[0], 1ull << 33);
}

// out[b, t, :] = (blockIdx xyz, threadIdx xyz, gridDim xyz, blockDim xyz) for a 3-D launch.
extern "C" __global__ void grid_coords(int* __restrict__ out) {  // [blocks, threads, 12]
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nthreads = blockDim.x * blockDim.y * blockDim.z;
    int* o = out + (static_cast<long long>(b) * nthreads + t) * 12;
    o[0] = blockIdx.x; o[1] = blockIdx.y; o[2] = blockIdx.z;
    o[3] = threadIdx.x; o[4] = threadIdx.y; o[5] = threadIdx.z;
    o[6] = gridDim.x; o[7] = gridDim.y; o[8] = gridDim.z;
    o[9] = blockDim.x; o[10] = blockDim.y; o[11] = blockDim.z;
}

template <int kScale, typename T>
__global__ void scale_add(const T* __restrict__ x,  // [n]
                          T* __restrict__ y,        // [n]
                          T offset, long long n) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = x[i] * static_cast<T>(kScale) + offset;
}

// One row per shuffle flavour: out[k, t] for thread t of a single-block launch.
constexpr int kShuffleRows = 9;
extern "C" __global__ void shuffle_ops(const int* __restrict__ x,  // [blockDim.x]
                                       int* __restrict__ out,      // [kShuffleRows, blockDim.x]
                                       int src, int delta, int width) {
    const int t = threadIdx.x;
    const int n = blockDim.x;
    const int v = x[t];
    out[0 * n + t] = __shfl_sync(kFull, v, src, width);
    out[1 * n + t] = __shfl_up_sync(kFull, v, delta, width);
    out[2 * n + t] = __shfl_down_sync(kFull, v, delta, width);
    out[3 * n + t] = __shfl_xor_sync(kFull, v, delta, width);
    out[4 * n + t] = static_cast<int>(__ballot_sync(kFull, v & 1));
    out[5 * n + t] = __any_sync(kFull, v == 3);
    out[6 * n + t] = __all_sync(kFull, v >= 0);
    __syncwarp();
    out[7 * n + t] = static_cast<int>(__activemask());
    out[8 * n + t] = __reduce_add_sync(kFull, v);
}

// Lanes 0-15 and 16-31 of each warp shuffle in separate groups with their own masks, in
// different branches.
extern "C" __global__ void shuffle_halves(const int* __restrict__ x,  // [blockDim.x]
                                          int* __restrict__ out) {    // [blockDim.x]
    const int t = threadIdx.x;
    const int lane = t % warpSize;
    if (lane < 16) {
        out[t] = __shfl_sync(0x0000ffffu, x[t], 15);
    } else {
        out[t] = -__shfl_sync(0xffff0000u, x[t], 16);
    }
}

// 64-bit shuffles and a butterfly over doubles.
extern "C" __global__ void shuffle_wide(const double* __restrict__ x,    // [32]
                                        double* __restrict__ sums,       // [32]
                                        long long* __restrict__ rot) {   // [32]
    const int t = threadIdx.x;
    double v = x[t];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFull, v, offset);
    sums[t] = v;
    const long long big = (1ll << 40) + t;
    rot[t] = __shfl_sync(kFull, big, (t + 1) % 32);
}

extern "C" __global__ void dp4a_kernel(const int* __restrict__ a,       // [n]
                                       const int* __restrict__ b,       // [n]
                                       const int* __restrict__ c,       // [n]
                                       int* __restrict__ out_signed,    // [n]
                                       unsigned* __restrict__ out_uns,  // [n]
                                       int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out_signed[i] = __dp4a(a[i], b[i], c[i]);
    out_uns[i] = __dp4a(static_cast<unsigned>(a[i]), static_cast<unsigned>(b[i]),
                        static_cast<unsigned>(c[i]));
}

// ldmatrix x4 and x2 (cuda/common.cuh) from a shared tile of 4 matrices x 8 rows of 16 bytes
// (32-byte rows: 16-byte aligned, half padding) filled from x; lane l gives the address of row
// 7 - l % 8 of matrix l / 8, so every row travels to other lanes. One warp.
extern "C" __global__ void ldmatrix_probe(const unsigned* __restrict__ x,  // [4 * 8 * 4]
                                          unsigned* __restrict__ out) {    // [32, 6]
    __shared__ __align__(16) unsigned tile[4 * 8][8];
    const int lane = threadIdx.x;
    for (int i = lane; i < 4 * 8 * 4; i += 32) tile[i / 4][i % 4] = x[i];
    __syncthreads();
    unsigned r4[4], r2[2];
    const int row = lane / 8 * 8 + 7 - lane % 8;
    lowbit::ldmatrix_x4(r4, tile[row]);
    lowbit::ldmatrix_x2(r2, tile[row]);  // the addresses of lanes 16..31 are not read
    for (int i = 0; i < 4; ++i) out[lane * 6 + i] = r4[i];
    for (int i = 0; i < 2; ++i) out[lane * 6 + 4 + i] = r2[i];
}

// cp.async (cuda/common.cuh) of 16, then 8 and 4 bytes per thread from src + 32 t with
// src_bytes[3 t + i] bytes read (the rest zero-filled), in two commit groups. Destinations start
// as 0xab bytes; out[t] gets: the first byte of the 16-byte destination right after the copy
// was issued (still 0xab under cudasim, which writes at the wait), the 16 bytes after wait<1>
// (the first group is complete), and the 28 bytes of thread (t + 1) % n after wait<0> and a
// barrier.
constexpr int kAsyncMax = 64;
extern "C" __global__ void cp_async_probe(const unsigned char* __restrict__ src,  // [32 n]
                                          const int* __restrict__ src_bytes,      // [3 n]
                                          unsigned char* __restrict__ out) {      // [n, 45]
    __shared__ __align__(16) unsigned char buf[kAsyncMax][32];
    const int t = threadIdx.x;
    const int n = blockDim.x;
    for (int i = 0; i < 32; ++i) buf[t][i] = 0xab;
    unsigned char* o = out + t * 45;
    lowbit::cp_async<16>(buf[t], src + 32 * t, src_bytes[3 * t]);
    o[0] = buf[t][0];
    lowbit::cp_async_commit();
    lowbit::cp_async<8>(buf[t] + 16, src + 32 * t + 16, src_bytes[3 * t + 1]);
    lowbit::cp_async<4>(buf[t] + 24, src + 32 * t + 24, src_bytes[3 * t + 2]);
    lowbit::cp_async_commit();
    lowbit::cp_async_wait<1>();
    for (int i = 0; i < 16; ++i) o[1 + i] = buf[t][i];
    lowbit::cp_async_wait<0>();
    __syncthreads();
    for (int i = 0; i < 28; ++i) o[17 + i] = buf[(t + 1) % n][i];
}

// One thread computes a row of intrinsic results for the input x[t].
constexpr int kMathCols = 12;
extern "C" __global__ void math_ops(const float* __restrict__ x,  // [n]
                                    float* __restrict__ out,      // [n, kMathCols]
                                    int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float v = x[t];
    float* o = out + t * kMathCols;
    o[0] = __expf(v);
    o[1] = rsqrtf(fabsf(v) + 1.0f);
    o[2] = static_cast<float>(__float2int_rn(v));
    o[3] = rintf(v);
    o[4] = fmaxf(v, 0.5f);
    o[5] = fminf(v, 0.5f);
    o[6] = __saturatef(v);
    o[7] = log1pf(fabsf(v));
    o[8] = exp2f(v);
    o[9] = __fdividef(v, 3.0f);
    o[10] = static_cast<float>(min(__float_as_int(v), 0) + max(t, 3));
    o[11] = __int_as_float(__float_as_int(v) ^ static_cast<int>(0x80000000u));
}

// Integer bit intrinsics of x[t]: popc, clz, ffs, brev, byte_perm.
extern "C" __global__ void bit_ops(const unsigned* __restrict__ x,  // [n]
                                   unsigned* __restrict__ out,      // [n, 5]
                                   int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const unsigned v = x[t];
    out[t * 5 + 0] = __popc(v);
    out[t * 5 + 1] = __clz(static_cast<int>(v));
    out[t * 5 + 2] = __ffs(static_cast<int>(v));
    out[t * 5 + 3] = __brev(v);
    out[t * 5 + 4] = __byte_perm(v, 0x76543210u, 0x4152u);
}

// __syncthreads_count / _and / _or over a predicate per thread.
extern "C" __global__ void sync_votes(const int* __restrict__ pred,  // [blockDim.x]
                                      int* __restrict__ out) {      // [3]
    const int p = pred[threadIdx.x];
    const int c = __syncthreads_count(p);
    const int a = __syncthreads_and(p);
    const int o = __syncthreads_or(p);
    if (threadIdx.x == 0) {
        out[0] = c;
        out[1] = a;
        out[2] = o;
    }
}

// Threads past n return before the barrier; the rest still synchronize (exited threads do not
// take part, as on Volta and later GPUs).
extern "C" __global__ void early_exit_barrier(const float* __restrict__ x,  // [n]
                                              float* __restrict__ y,        // [n]
                                              int n) {
    __shared__ float buf[1024];
    const int t = threadIdx.x;
    if (t >= n) return;
    buf[t] = x[t];
    __syncthreads();
    y[t] = buf[n - 1 - t];
}

// A __syncthreads() that only the first 16 threads reach, then one that all reach: the
// barrier diverges (a hang or corruption on a GPU).
extern "C" __global__ void divergent_barrier(int* __restrict__ out) {  // [blockDim.x]
    if (threadIdx.x < 16) __syncthreads();
    __syncthreads();
    out[threadIdx.x] = 1;
}

// Lanes 0-15 wait at __syncthreads() while lanes 16-31 of the same warp wait for them at
// __syncwarp(): nobody can proceed.
extern "C" __global__ void true_deadlock(int* __restrict__ out) {  // [blockDim.x]
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncwarp();
    }
    out[threadIdx.x] = 1;
}

// Thread 0 keeps the others waiting at a barrier for `spin` clock ticks.
extern "C" __global__ void slow_thread(int* __restrict__ out, long long spin) {  // [blockDim.x]
    if (threadIdx.x == 0) {
        const long long start = clock64();
        while (clock64() - start < spin) {
        }
    }
    __syncthreads();
    out[threadIdx.x] = 1;
}

// Thread t sleeps t * step_ns before the barrier: the block arrives slowly but keeps making
// progress, as on a heavily loaded machine.
extern "C" __global__ void staggered_barrier(int* __restrict__ out,  // [blockDim.x]
                                             unsigned step_ns) {
    for (unsigned i = 0; i < threadIdx.x; ++i) __nanosleep(step_ns);
    __syncthreads();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void trap_kernel(int* __restrict__ out) {  // [blockDim.x]
    if (threadIdx.x == 3) __trap();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void assert_kernel(int* __restrict__ out) {  // [blockDim.x]
    assert(threadIdx.x != 5);
    out[threadIdx.x] = 1;
}
