// Cross-entropy over rows of logits: a fused forward (row max, sum of exponentials, logsumexp,
// the target's loss), a fixed-order mean of the per-row losses, and the backward
// dloss * (softmax - onehot) / count. One warp per row, lanes striding over the classes, with the
// xor-butterfly reductions of common.cuh: every result is bitwise deterministic.
// Launchers: lowbit/ops/cross_entropy/_cuda.py; reference: reference/cross_entropy.py; tests:
// tests/test_cross_entropy.py.
#include "common.cuh"

namespace lowbit_cross_entropy {

using lowbit::kWarpSize;
// Threads of the row kernels: one warp per row, kRowsPerBlock rows per block.
constexpr int kThreads = 128;
constexpr int kRowsPerBlock = kThreads / kWarpSize;
// Threads of the single block that sums the per-row losses.
constexpr int kMeanThreads = 256;
constexpr int kMeanWarps = kMeanThreads / kWarpSize;

}  // namespace lowbit_cross_entropy

// Per-row loss and logsumexp; ignored rows get loss 0. The logsumexp is formed in double (the
// backward subtracts it from logits that may be near 1e4). A NaN never wins fmax, but it turns
// the sum of exponentials (so the lse) into NaN; +inf gives inf - inf = NaN there too.
template <typename T>
__global__ void cross_entropy_fwd(const T* __restrict__ logits,         // [M, V]
                                  const int64_t* __restrict__ targets,  // [M]
                                  double* __restrict__ losses,          // [M]
                                  double* __restrict__ lse,             // [M]
                                  int64_t M, int64_t V, int64_t ignore_index) {
    using namespace lowbit_cross_entropy;
    const int lane = threadIdx.x % kWarpSize;
    const int64_t first =
        static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
    for (int64_t row = first; row < M; row += stride) {
        const T* xr = logits + row * V;
        T top = xr[0];
        for (int64_t j = lane; j < V; j += kWarpSize) top = lowbit::max_of(top, xr[j]);
        top = lowbit::warp_max(top);
        T total = T(0);
        for (int64_t j = lane; j < V; j += kWarpSize) total += lowbit::exp_of(xr[j] - top);
        total = lowbit::warp_sum(total);
        if (lane == 0) {
            const double log_sum = lowbit::log_of(static_cast<double>(total));
            const double top64 = static_cast<double>(top);
            lse[row] = top64 + log_sum;
            const int64_t t = targets[row];
            // log(sum) + (max - x_t): the difference is formed before the large max comes back.
            losses[row] = t == ignore_index ? 0.0
                                            : log_sum + (top64 - static_cast<double>(xr[t]));
        }
    }
}

// loss[0] = sum(losses) / count, summed in a fixed order: thread i takes rows i, i + 256, ...,
// then warp and block reductions. The launcher never calls it with count == 0 (every row
// ignored: the loss is NaN without a kernel).
__global__ void cross_entropy_mean(const double* __restrict__ losses,  // [M]
                                   double* __restrict__ loss,          // [1]
                                   int64_t M, int64_t count) {
    using namespace lowbit_cross_entropy;
    __shared__ double partial[kMeanWarps];
    const int tid = threadIdx.x;
    double total = 0.0;
    for (int64_t i = tid; i < M; i += kMeanThreads) total += losses[i];
    total = lowbit::warp_sum(total);
    if (tid % kWarpSize == 0) partial[tid / kWarpSize] = total;
    __syncthreads();
    if (tid < kWarpSize) {
        total = tid < kMeanWarps ? partial[tid] : 0.0;
        total = lowbit::warp_sum(total);
        if (tid == 0) loss[0] = total / static_cast<double>(count);
    }
}

// dlogits = dloss / count * (exp(logits - lse) - onehot(target)) in counted rows, 0 in ignored
// rows. logits - lse in double, exp in T.
template <typename T>
__global__ void cross_entropy_bwd(const double* __restrict__ dloss,     // [1]
                                  const T* __restrict__ logits,         // [M, V]
                                  const double* __restrict__ lse,       // [M]
                                  const int64_t* __restrict__ targets,  // [M]
                                  T* __restrict__ dlogits,              // [M, V]
                                  int64_t M, int64_t V, int64_t ignore_index, int64_t count) {
    using namespace lowbit_cross_entropy;
    const int lane = threadIdx.x % kWarpSize;
    const int64_t first =
        static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
    const T scale = static_cast<T>(dloss[0] / static_cast<double>(count > 0 ? count : 1));
    for (int64_t row = first; row < M; row += stride) {
        const T* xr = logits + row * V;
        T* gr = dlogits + row * V;
        const int64_t t = targets[row];
        if (t == ignore_index) {
            for (int64_t j = lane; j < V; j += kWarpSize) gr[j] = T(0);
            continue;
        }
        const double c = lse[row];
        for (int64_t j = lane; j < V; j += kWarpSize) {
            const T p = lowbit::exp_of(static_cast<T>(static_cast<double>(xr[j]) - c));
            gr[j] = scale * (j == t ? p - T(1) : p);
        }
    }
}
