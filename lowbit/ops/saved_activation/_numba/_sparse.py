"""Numba sparse-format kernels: a 1-bit nonzero mask plus 8-bit codes of the nonzeros.

Package ``lowbit/ops/saved_activation/_numba/``: the entry points in ``__init__.py`` call these;
siblings ``_pack_dense.py``, ``_unpack_dense.py`` and ``_common.py`` (the scale floor, status
bits and stochastic-rounding noise used here). The ``_cttz`` intrinsic and ``_mask_word`` stay in
this file, with every kernel that inlines them (Numba's cache tracks only a kernel's own file).

Packing (float32): per chunk, in one parallel pass, count the nonzeros, write the mask and compact
the nonzeros into a slot while the chunk is in cache; then prefix-sum the counts, concatenate the
slots (a chunk too dense for its slot is gathered again) and quantize the compacted values in
groups. float64 input counts first and gathers in a second parallel pass. Unpacking popcounts the
mask per chunk, prefix-sums, and scatters the dequantized nonzeros.
"""
import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from ._common import EPS, STATUS_NEGATIVE, STATUS_NONFINITE
from ._common import noise as _noise
from ._pack_dense import KEY_INF

#: Elements per sparse chunk (a multiple of 8, so chunks own whole mask bytes).
SPARSE_CHUNK = 1 << 14
#: Nonzeros a float32 chunk compacts while it is in cache (12.5% density; scratch of 1/8 of the
#: tensor). A denser chunk is gathered from memory again after the prefix sum.
SPARSE_SLOT = SPARSE_CHUNK // 8


@intrinsic
def _cttz(typingctx, word):
    """Trailing zero count of a nonzero uint64 (LLVM cttz: one instruction)."""
    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))
    return numba.types.uint64(numba.types.uint64), codegen


@numba.njit(inline="always")
def _mask_word(mask, b, stop_byte):
    """Mask bytes b..b+8 (those below stop_byte) as one little-endian uint64."""
    word = np.uint64(0)
    for j in range(min(8, stop_byte - b)):
        word |= np.uint64(mask[b + j]) << np.uint64(8 * j)
    return word


#: byte k of a uint64 holding 0/1 bytes lands on bit 56 + k of the product (bits to a byte).
BYTES_TO_BITS = np.uint64(0x0102040810204080)
SHIFT56 = np.uint64(56)


@numba.njit(cache=True)
def _sparse_count_chunk_f32(bits, flat, mask, nonzero, start, stop, slot, slot_noise,
                            stochastic, key):
    """float32 elements ``start..stop`` (start a multiple of 8): mask bytes, and the nonzeros
    (with their noise) compacted into ``slot`` when they fit; returns (count, status).

    Serial; ``bits`` is ``flat`` viewed as int32: integer reductions vectorize.
    """
    count = 0
    top = np.int32(0)
    negative = np.int32(0)
    m = stop - start
    seg = bits[start:stop]
    # Reductions and the byte stores in separate loops: together they do not vectorize.
    for i in range(m):
        b = seg[i]
        magnitude = b & np.int32(0x7FFFFFFF)
        count += magnitude != 0
        top = max(top, magnitude)
        negative = max(negative, magnitude if b < 0 else np.int32(0))
    for i in range(m):
        nonzero[i] = (seg[i] & np.int32(0x7FFFFFFF)) != 0
    for i in range(m, m + 8):
        nonzero[i] = 0
    words = nonzero[:(m + 7) // 8 * 8].view(np.uint64)
    for w in range((m + 7) // 8):
        mask[start // 8 + w] = np.uint8((words[w] * BYTES_TO_BITS) >> SHIFT56)
    if count <= slot.size:
        _sparse_gather_chunk(flat, mask, start, stop, 0, stochastic, key, slot, slot_noise)
    flag = STATUS_NONFINITE if top >= KEY_INF else 0
    return count, flag | (STATUS_NEGATIVE if negative > 0 else 0)


@numba.njit(parallel=True, cache=True)
def _sparse_count_f32(bits, flat, mask, counts, status, slots, slot_noise, stochastic, key):
    size = bits.size
    for chunk in numba.prange(counts.size):
        nonzero = np.empty(SPARSE_CHUNK + 8, np.uint8)
        start = chunk * SPARSE_CHUNK
        counts[chunk], status[chunk] = _sparse_count_chunk_f32(
            bits, flat, mask, nonzero, start, min(start + SPARSE_CHUNK, size), slots[chunk],
            slot_noise[chunk], stochastic, key)


@numba.njit(cache=True)
def _sparse_collect(flat, mask, counts, offsets, slots, slot_noise, stochastic, key, values,
                    noise):
    """Concatenates the compacted slots (serial: 5% of the tensor); gathers overflowing chunks."""
    size = flat.size
    for chunk in range(counts.size):
        k = offsets[chunk]
        count = counts[chunk]
        if count <= slots.shape[1]:
            values[k:k + count] = slots[chunk, :count]
            if stochastic:
                noise[k:k + count] = slot_noise[chunk, :count]
        else:
            start = chunk * SPARSE_CHUNK
            _sparse_gather_chunk(flat, mask, start, min(start + SPARSE_CHUNK, size), k,
                                 stochastic, key, values, noise)


@numba.njit(cache=True)
def _sparse_count_chunk(flat, mask, start, stop):
    """float64 elements ``start..stop`` (start a multiple of 8); returns (count, status)."""
    count = 0
    bad = False
    negative = False
    for b in range(start // 8, (stop + 7) // 8):
        byte = 0
        for j in range(min(8, stop - b * 8)):
            v = np.float32(flat[b * 8 + j])
            # v - v is 0 for every finite v, NaN (!= 0) for inf and NaN.
            bad |= v - v != 0
            negative |= v < 0
            if v != 0:
                byte |= 1 << j
                count += 1
        mask[b] = byte
    return count, (STATUS_NONFINITE if bad else 0) | (STATUS_NEGATIVE if negative else 0)


@numba.njit(parallel=True, cache=True)
def _sparse_count(flat, mask, counts, status):
    size = flat.size
    for chunk in numba.prange(counts.size):
        start = chunk * SPARSE_CHUNK
        counts[chunk], status[chunk] = _sparse_count_chunk(flat, mask, start,
                                                           min(start + SPARSE_CHUNK, size))


@numba.njit(cache=True)
def _sparse_gather_chunk(flat, mask, start, stop, k, stochastic, key, values, noise):
    """Compacts the nonzeros of elements ``start..stop`` to ``values[k:]`` (serial): whole mask
    words at a time, one trailing-zero count per nonzero."""
    stop_byte = (stop + 7) // 8
    for b in range(start // 8, stop_byte, 8):
        word = _mask_word(mask, b, stop_byte)
        while word:
            i = b * 8 + np.int64(_cttz(word))
            word &= word - np.uint64(1)
            values[k] = np.float32(flat[i])
            if stochastic:
                noise[k] = _noise(i, key)
            k += 1


@numba.njit(parallel=True, cache=True)
def _sparse_gather(flat, mask, offsets, stochastic, key, values, noise):
    size = flat.size
    for chunk in numba.prange(offsets.size):
        start = chunk * SPARSE_CHUNK
        _sparse_gather_chunk(flat, mask, start, min(start + SPARSE_CHUNK, size), offsets[chunk],
                             stochastic, key, values, noise)


@numba.njit(cache=True)
def _sparse_quantize_group(values, noise, start, stop, stochastic, codes, scales, g):
    """Scale and 8-bit codes of one group of compacted nonzeros (serial)."""
    hi = np.float32(0.0)
    for k in range(start, stop):
        hi = max(hi, values[k])
    scale = max(hi, EPS) / np.float32(255.0)
    scales[g] = scale
    if stochastic:
        for k in range(start, stop):
            q = np.floor(values[k] / scale + noise[k])
            # Every compacted value is positive: code 0 would turn it into a zero.
            codes[k] = np.uint8(min(max(q, np.float32(1.0)), np.float32(255.0)))
    else:
        for k in range(start, stop):
            q = np.rint(values[k] / scale)
            codes[k] = np.uint8(min(max(q, np.float32(1.0)), np.float32(255.0)))


@numba.njit(cache=True)
def _sparse_quantize(values, noise, group_size, stochastic, codes, scales):
    # Serial: it reads only the compacted nonzeros, less work than waking the thread pool costs
    # on a loaded machine.
    nnz = values.size
    for g in range(scales.size):
        start = g * group_size
        _sparse_quantize_group(values, noise, start, min(start + group_size, nnz), stochastic,
                               codes, scales, g)


@numba.njit(cache=True)
def _popcount_bytes(mask, start, stop):
    count = 0
    for b in range(start, stop):
        byte = np.int32(mask[b])
        byte = (byte & 0x55) + ((byte >> 1) & 0x55)
        byte = (byte & 0x33) + ((byte >> 2) & 0x33)
        count += (byte & 0x0F) + (byte >> 4)
    return count


@numba.njit(cache=True)
def _sparse_popcount(mask, size, counts):
    # Serial: one byte per 8 elements, cheaper than a parallel region's wake-up.
    for chunk in range(counts.size):
        start = chunk * SPARSE_CHUNK // 8
        counts[chunk] = _popcount_bytes(mask, start, min(start + SPARSE_CHUNK // 8, mask.size))


@numba.njit(cache=True)
def _sparse_scatter_chunk(mask, codes, scales, start, stop, k, group_size, out):
    """Zeros and dequantized nonzeros of elements ``start..stop`` (serial)."""
    # A slice fill becomes a memset; the element loop does not vectorize here.
    out[start:stop] = 0
    stop_byte = (stop + 7) // 8
    # The group of nonzero k, tracked instead of divided out per element.
    g = k // group_size
    boundary = (g + 1) * group_size
    for b in range(start // 8, stop_byte, 8):
        word = _mask_word(mask, b, stop_byte)
        while word:
            i = b * 8 + np.int64(_cttz(word))
            word &= word - np.uint64(1)
            if k == boundary:
                g += 1
                boundary += group_size
            out[i] = np.float32(codes[k]) * scales[g]
            k += 1


@numba.njit(parallel=True, cache=True)
def _sparse_scatter(mask, codes, scales, offsets, group_size, out):
    size = out.size
    for chunk in numba.prange(offsets.size):
        start = chunk * SPARSE_CHUNK
        _sparse_scatter_chunk(mask, codes, scales, start, min(start + SPARSE_CHUNK, size),
                              offsets[chunk], group_size, out)
