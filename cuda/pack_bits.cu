// Bit packing: codes below 2**BITS, one per uint8, packed LSB-first into bytes along the last
// axis of a [rows, n] view. Launchers: lowbit/ops/pack_bits/_cuda.py; reference:
// reference/pack_bits.py; tests: tests/test_pack_bits.py.
#include "common.cuh"

// One thread per output byte: each packed byte is written exactly once, no atomics.
template <int BITS>
__global__ void pack_bits(const uint8_t* __restrict__ codes,  // [rows, n]
                          uint8_t* __restrict__ packed,       // [rows, nbytes]
                          int64_t rows, int64_t n, int64_t nbytes) {
    constexpr int kPerByte = lowbit::kCodesPerByte<BITS>;
    const int64_t total = rows * nbytes;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t r = idx / nbytes;
        const int64_t start = (idx - r * nbytes) * kPerByte;
        const uint8_t* row = codes + r * n;
        unsigned v = 0;
#pragma unroll
        for (int j = 0; j < kPerByte; ++j) {
            if (start + j < n) v |= lowbit::pack_code<BITS>(row[start + j], j);
        }
        packed[idx] = static_cast<uint8_t>(v);
    }
}

// One thread per output code.
template <int BITS>
__global__ void unpack_bits(const uint8_t* __restrict__ packed,  // [rows, nbytes]
                            uint8_t* __restrict__ codes,         // [rows, count]
                            int64_t rows, int64_t count, int64_t nbytes) {
    constexpr int kPerByte = lowbit::kCodesPerByte<BITS>;
    const int64_t total = rows * count;
    for (int64_t idx = lowbit::grid_index(); idx < total; idx += lowbit::grid_stride()) {
        const int64_t r = idx / count;
        const int64_t i = idx - r * count;
        const unsigned byte = packed[r * nbytes + i / kPerByte];
        codes[idx] = static_cast<uint8_t>(
            lowbit::unpack_code<BITS>(byte, static_cast<int>(i % kPerByte)));
    }
}
