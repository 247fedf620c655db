// Embedding lookup: a row gather and its gradient, a deterministic scatter-add (no atomics).
// Launchers: lowbit/ops/embedding/_cuda.py; reference: reference/embedding.py; tests:
// tests/test_embedding.py.
//
// The backward gets the positions sorted by id as unique keys id * P + position (sorted on the
// array module by the launcher). embedding_offsets decodes them into each row's slice of
// positions, and embedding_bwd gives each table row to one block that adds its positions in
// ascending order, so every sum has one order on every run and backend.
#include "common.cuh"

namespace lowbit_embedding {

// Threads of a backward block (one table row per block, threads over its D columns).
constexpr int kBwdThreads = 128;

}  // namespace lowbit_embedding

// out[p, d] = table[ids[p], d]: one thread per output element (grid-stride).
template <typename T>
__global__ void embedding_fwd(const T* __restrict__ table,     // [V, D]
                              const int64_t* __restrict__ ids,  // [P], values in [0, V)
                              T* __restrict__ out,              // [P, D]
                              int64_t P, int64_t D) {
    const int64_t total = P * D;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t p = idx / D;
        out[idx] = table[ids[p] * D + (idx - p * D)];
    }
}

// From the sorted keys (id * P + position, ascending): order[k] = the position of key k, and
// offsets[v] = the number of keys below v * P (positions whose id is below v), for v in [0, V],
// by a binary search per row so that rows no id picks cost no more than the others. One thread
// per entry of order and of offsets (grid-stride over P + V + 1 items).
__global__ void embedding_offsets(const int64_t* __restrict__ keys,  // [P], sorted
                                  int64_t* __restrict__ order,       // [P]
                                  int64_t* __restrict__ offsets,     // [V + 1]
                                  int64_t P, int64_t V) {
    const int64_t total = P + V + 1;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        if (idx < P) {
            order[idx] = keys[idx] % P;
            continue;
        }
        const int64_t v = idx - P;
        const int64_t target = v * P;
        int64_t lo = 0;
        int64_t hi = P;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (keys[mid] < target) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        offsets[v] = lo;
    }
}

// dtable[v, d] = sum of dout[order[k], d] for k in [offsets[v], offsets[v + 1]), added in
// ascending k (ascending position): one block per row (grid-stride over rows), threads over D.
template <typename T>
__global__ void embedding_bwd(const T* __restrict__ dout,           // [P, D]
                              const int64_t* __restrict__ order,    // [P]
                              const int64_t* __restrict__ offsets,  // [V + 1]
                              T* __restrict__ dtable,               // [V, D]
                              int64_t V, int64_t D) {
    using namespace lowbit_embedding;
    for (int64_t v = blockIdx.x; v < V; v += gridDim.x) {
        const int64_t begin = offsets[v];
        const int64_t end = offsets[v + 1];
        for (int64_t d = threadIdx.x; d < D; d += kBwdThreads) {
            T acc = T(0);
            for (int64_t k = begin; k < end; ++k) acc += dout[order[k] * D + d];
            dtable[v * D + d] = acc;
        }
    }
}
