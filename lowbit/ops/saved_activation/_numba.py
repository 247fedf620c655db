"""Numba saved-activation packing: quantize-and-pack and unpack-and-dequantize in one pass each.

Siblings: ``_numpy.py``, ``_cuda.py``; reference ``reference/saved_activation.py``.

Dense formats: a parallel driver hands contiguous ranges of groups to a serial function (compiled
on its own, its inner loops vectorize; inside a parfor body they do not). Each group is read from
memory once: its min/max (through integer order keys of the float bits, which also flag inf/NaN),
then, from cache, its codes, packed into bytes. float32 groups that start on byte boundaries take
that path (``_pack_aligned``); float64 input or groups that share bytes take ``_pack_dense``,
whose tasks hold whole groups starting on a byte boundary. Sparse (float32): per chunk, in one
parallel pass, count the nonzeros, write the mask and compact the nonzeros into a slot while the
chunk is in cache; then prefix-sum the counts, concatenate the slots (a chunk too dense for its
slot is gathered again) and quantize the compacted values in groups. float64 input counts first
and gathers in a second parallel pass.
"""
import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from ... import _backend

EPS = np.float32(1e-5)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
SHIFT30, SHIFT27, SHIFT31, SHIFT40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
INV_2_24 = np.float32(2.0**-24)
STATUS_NONFINITE = 1
STATUS_NEGATIVE = 2
#: Elements per sparse chunk (a multiple of 8, so chunks own whole mask bytes).
SPARSE_CHUNK = 1 << 14
#: Nonzeros a float32 chunk compacts while it is in cache (12.5% density; scratch of 1/8 of the
#: tensor). A denser chunk is gathered from memory again after the prefix sum.
SPARSE_SLOT = SPARSE_CHUNK // 8
#: Elements a dense task covers at least, so small groups do not make tiny tasks.
TASK_ELEMENTS = 2048
#: Below this many elements the serial functions run directly: waking the thread pool costs more
#: than the work (tens of microseconds on an idle machine, milliseconds on a loaded one).
SERIAL_ELEMENTS = 1 << 18


@numba.njit(inline="always")
def _noise(index, key):
    z = np.uint64(index) + key
    z = (z ^ (z >> SHIFT30)) * MIX1
    z = (z ^ (z >> SHIFT27)) * MIX2
    z = z ^ (z >> SHIFT31)
    return np.float32(z >> SHIFT40) * INV_2_24


@numba.njit(inline="always")
def _code(v, lo, scale, levels, nonneg, stochastic, index, key):
    t = (v - lo) / scale
    if stochastic:
        q = np.floor(t + _noise(index, key))
    else:
        q = np.rint(t)
    q = min(max(q, np.float32(0.0)), np.float32(levels))
    c = np.uint32(q)
    if nonneg and c == 0 and v > 0:
        c = np.uint32(1)
    return c


@numba.njit(parallel=True, cache=True)
def _pack_dense(x, bits, nonneg, group_size, groups_per_task, stochastic, key, codes, scales,
                mins, status):
    """Any dtype and group size: tasks of whole groups whose first element is byte-aligned."""
    rows, n = x.shape
    groups = scales.shape[1]
    tasks_per_row = (groups + groups_per_task - 1) // groups_per_task
    per = 8 // bits
    levels = (1 << bits) - 1
    for task in numba.prange(rows * tasks_per_row):
        r = task // tasks_per_row
        g0 = (task - r * tasks_per_row) * groups_per_task
        g1 = min(g0 + groups_per_task, groups)
        for g in range(g0, g1):
            start = g * group_size
            stop = min(start + group_size, n)
            lo = np.float32(np.inf)
            hi = np.float32(-np.inf)
            # v - v is 0 for every finite v and NaN for inf or NaN.
            finite = np.float32(0.0)
            for i in range(start, stop):
                v = np.float32(x[r, i])
                lo = min(lo, v)
                hi = max(hi, v)
                finite += v - v
            flag = 0
            if finite != 0:
                flag |= STATUS_NONFINITE
            if nonneg:
                if lo < 0:
                    flag |= STATUS_NEGATIVE
                lo = np.float32(0.0)
            # +0.0 canonicalizes a -0.0 minimum, so every backend stores the same bits.
            lo = lo + np.float32(0.0)
            status[r, g] = flag
            scales[r, g] = max(hi - lo, EPS) / np.float32(levels)
            if not nonneg:
                mins[r, g] = lo
        first = g0 * group_size
        last = min(g1 * group_size, n)
        g = g0
        boundary = min(first + group_size, n)
        lo = np.float32(0.0) if nonneg else mins[r, g]
        scale = scales[r, g]
        for b in range(first // per, (last + per - 1) // per):
            byte = np.uint32(0)
            for j in range(per):
                i = b * per + j
                if i < last:
                    if i == boundary:
                        g += 1
                        boundary = min(boundary + group_size, n)
                        lo = np.float32(0.0) if nonneg else mins[r, g]
                        scale = scales[r, g]
                    c = _code(np.float32(x[r, i]), lo, scale, levels, nonneg, stochastic,
                              r * n + i, key)
                    byte |= c << np.uint32(j * bits)
            codes[r, b] = byte


#: int32 order keys of float32 bit patterns (``_key``): +inf and above (NaN) ...
KEY_INF = np.int32(0x7F800000)
#: ... and -inf and below (negative NaN) flag a non-finite group.
KEY_NEG_INF = np.int32(-0x7F800001)
#: Keys of -0.0 and +0.0 are -1 and 0: a key below -1 is a negative value.
KEY_NEG_ZERO = np.int32(-1)
KEY_LOW_BITS = np.int32(0x7FFFFFFF)
KEY_SIGN_SHIFT = np.int32(31)
#: Tasks per parallel chunk are contiguous; each chunk allocates its code buffer once.
MAX_CHUNKS = 256


@numba.njit(inline="always")
def _key(b):
    """Order-preserving int32 key of float32 bits b (an involution: ``_key(_key(b)) == b``)."""
    return np.int32(b ^ ((b >> KEY_SIGN_SHIFT) & KEY_LOW_BITS))


@numba.njit(cache=True)
def _pack_aligned_tasks(x, xbits, bits, nonneg, group_size, stochastic, key, codes, scales, mins,
                        status, first, last):
    """Groups ``first..last`` (row-major over [rows, groups]), one after another.

    A serial function called from the parallel driver: compiled on its own, its inner loops
    vectorize (inside a parfor body they do not).
    """
    rows, n = x.shape
    groups = scales.shape[1]
    per = 8 // bits
    levels = np.float32((1 << bits) - 1)
    buf = np.zeros(group_size + 8, np.uint8)
    # Bit casts of keys back to float32 go through this pair of views.
    cast = np.zeros(2, np.int32)
    cast_f = cast.view(np.float32)
    for task in range(first, last):
        r = task // groups
        g = task - r * groups
        start = g * group_size
        m = min(group_size, n - start)
        row = x[r, start:start + m]
        # Group min and max through integer keys: vectorizes without fast-math, and the keys
        # of inf/NaN flag a non-finite group for free.
        lo_key = np.int32(0x7FFFFFFF)
        hi_key = np.int32(-0x80000000)
        bits_row = xbits[r, start:start + m]
        for i in range(m):
            k = _key(bits_row[i])
            lo_key = min(lo_key, k)
            hi_key = max(hi_key, k)
        flag = 0
        if hi_key >= KEY_INF or lo_key <= KEY_NEG_INF:
            flag |= STATUS_NONFINITE
        cast[0] = _key(lo_key)
        cast[1] = _key(hi_key)
        lo = np.float32(0.0)
        if nonneg:
            if lo_key < KEY_NEG_ZERO:
                flag |= STATUS_NEGATIVE
        else:
            lo = cast_f[0] + np.float32(0.0)
            mins[r, g] = lo
        scale = max(cast_f[1] - lo, EPS) / levels
        status[r, g] = flag
        scales[r, g] = scale
        if stochastic:
            base = r * n + start
            for i in range(m):
                q = np.floor((row[i] - lo) / scale + _noise(base + i, key))
                buf[i] = np.uint8(min(max(q, np.float32(0.0)), levels))
        else:
            for i in range(m):
                q = np.rint((row[i] - lo) / scale)
                buf[i] = np.uint8(min(max(q, np.float32(0.0)), levels))
        if nonneg:
            for i in range(m):
                buf[i] += np.uint8((buf[i] == 0) & (row[i] > 0))
        for i in range(m, m + per):
            buf[i] = 0
        out = codes[r, start // per:]
        if per == 1:
            for b in range(m):
                out[b] = buf[b]
        elif per == 2:
            for b in range((m + 1) // 2):
                out[b] = buf[2 * b] | (buf[2 * b + 1] << 4)
        else:
            for b in range((m + 3) // 4):
                out[b] = (buf[4 * b] | (buf[4 * b + 1] << 2) | (buf[4 * b + 2] << 4)
                          | (buf[4 * b + 3] << 6))


@numba.njit(parallel=True, cache=True)
def _pack_aligned(x, xbits, bits, nonneg, group_size, stochastic, key, codes, scales, mins,
                  status):
    """float32 rows whose groups start on byte boundaries: one vectorized pass per group."""
    total = scales.size
    chunks = min(total, MAX_CHUNKS)
    for chunk in numba.prange(chunks):
        _pack_aligned_tasks(x, xbits, bits, nonneg, group_size, stochastic, key, codes, scales,
                            mins, status, chunk * total // chunks, (chunk + 1) * total // chunks)


@numba.njit(cache=True)
def _unpack_aligned_tasks(codes, scales, mins, bits, group_size, nonneg, out, first, last):
    """Groups ``first..last`` of ``_unpack_aligned``, serially (see ``_pack_aligned_tasks``)."""
    rows, n = out.shape
    groups = scales.shape[1]
    per = 8 // bits
    mask = (1 << bits) - 1
    for task in range(first, last):
        r = task // groups
        g = task - r * groups
        start = g * group_size
        m = min(group_size, n - start)
        scale = scales[r, g]
        # 0 + step is step exactly (step >= 0): nonneg shares the values formula.
        lo = np.float32(0.0) if nonneg else mins[r, g]
        src = codes[r, start // per:]
        dst = out[r, start:start + m]
        if per == 1:
            for i in range(m):
                dst[i] = lo + np.float32(src[i]) * scale
        elif per == 2:
            for b in range(m // 2):
                c = src[b]
                dst[2 * b] = lo + np.float32(c & 15) * scale
                dst[2 * b + 1] = lo + np.float32(c >> 4) * scale
        else:
            for b in range(m // 4):
                c = src[b]
                dst[4 * b] = lo + np.float32(c & 3) * scale
                dst[4 * b + 1] = lo + np.float32((c >> 2) & 3) * scale
                dst[4 * b + 2] = lo + np.float32((c >> 4) & 3) * scale
                dst[4 * b + 3] = lo + np.float32(c >> 6) * scale
        for i in range(m - m % per, m):
            c = (np.int64(src[i // per]) >> ((i % per) * bits)) & mask
            dst[i] = lo + np.float32(c) * scale


@numba.njit(parallel=True, cache=True)
def _unpack_aligned(codes, scales, mins, bits, group_size, nonneg, out):
    """Inverse of ``_pack_aligned``: one vectorized pass per group."""
    total = scales.size
    chunks = min(total, MAX_CHUNKS)
    for chunk in numba.prange(chunks):
        _unpack_aligned_tasks(codes, scales, mins, bits, group_size, nonneg, out,
                              chunk * total // chunks, (chunk + 1) * total // chunks)


@numba.njit(parallel=True, cache=True)
def _unpack_dense(codes, scales, mins, bits, group_size, groups_per_task, nonneg, out):
    """Inverse of ``_pack_dense`` for groups that share packed bytes."""
    rows, n = out.shape
    groups = scales.shape[1]
    tasks_per_row = (groups + groups_per_task - 1) // groups_per_task
    per = 8 // bits
    mask = np.uint32((1 << bits) - 1)
    for task in numba.prange(rows * tasks_per_row):
        r = task // tasks_per_row
        g0 = (task - r * tasks_per_row) * groups_per_task
        g1 = min(g0 + groups_per_task, groups)
        for g in range(g0, g1):
            start = g * group_size
            stop = min(start + group_size, n)
            scale = scales[r, g]
            lo = np.float32(0.0) if nonneg else mins[r, g]
            for i in range(start, stop):
                c = (np.uint32(codes[r, i // per]) >> np.uint32((i % per) * bits)) & mask
                value = np.float32(c) * scale
                out[r, i] = value if nonneg else lo + value


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


def _groups_per_task(group_size, bits):
    """Whole groups per task: a multiple of the groups that end on a byte boundary."""
    per = 8 // bits
    aligned = per // np.gcd(group_size, per)
    return aligned * max(1, TASK_ELEMENTS // (aligned * group_size))


def _aligned(dtype, group_size, bits):
    """float32 groups that start on byte boundaries take the one-pass vectorized kernels."""
    return np.dtype(dtype) == np.float32 and group_size % (8 // bits) == 0


def pack_dense(x, bits, nonneg, group_size, stochastic, key):
    """Per-group quantize and bit-pack rows; see ``_numpy.pack_dense`` for shapes."""
    rows, n = x.shape
    groups = -(-n // group_size)
    codes = _backend.empty((rows, -(-n // (8 // bits))), np.uint8)
    scales = _backend.empty((rows, groups), np.float32)
    mins = _backend.empty((rows, 0 if nonneg else groups), np.float32)
    status = _backend.empty((rows, groups), np.uint8)
    if _aligned(x.dtype, group_size, bits):
        args = (x, x.view(np.int32), bits, nonneg, group_size, stochastic, np.uint64(key), codes,
                scales, mins, status)
        if x.size < SERIAL_ELEMENTS:
            _pack_aligned_tasks(*args, 0, scales.size)
        else:
            _pack_aligned(*args)
    else:
        _pack_dense(x, bits, nonneg, group_size, _groups_per_task(group_size, bits), stochastic,
                    np.uint64(key), codes, scales, mins, status)
    return codes, scales, None if nonneg else mins, status


def unpack_dense(codes, scales, mins, bits, n, group_size):
    """Inverse of ``pack_dense``: [rows, n] float32 (``mins`` None means nonneg)."""
    rows = codes.shape[0]
    out = _backend.empty((rows, n), np.float32)
    nonneg = mins is None
    mins = np.empty((rows, 0), np.float32) if nonneg else mins
    if _aligned(np.float32, group_size, bits):
        if out.size < SERIAL_ELEMENTS:
            _unpack_aligned_tasks(codes, scales, mins, bits, group_size, nonneg, out, 0,
                                  scales.size)
        else:
            _unpack_aligned(codes, scales, mins, bits, group_size, nonneg, out)
    else:
        _unpack_dense(codes, scales, mins, bits, group_size, _groups_per_task(group_size, bits),
                      nonneg, out)
    return out


def pack_sparse(flat, group_size, stochastic, key):
    """Mask plus 8-bit codes of the nonzeros; see ``_numpy.pack_sparse`` for shapes."""
    size = flat.size
    chunks = -(-size // SPARSE_CHUNK)
    mask = _backend.empty((-(-size // 8),), np.uint8)
    counts = np.empty(chunks, np.int64)
    status = _backend.empty((chunks,), np.uint8)
    serial = size < SERIAL_ELEMENTS
    key = np.uint64(key)
    f32 = flat.dtype == np.float32
    if f32:
        slots = np.empty((chunks, SPARSE_SLOT), np.float32)
        slot_noise = np.empty((chunks, SPARSE_SLOT if stochastic else 0), np.float32)
        args = (flat.view(np.int32), flat, mask, counts, status, slots, slot_noise, stochastic,
                key)
        if serial:
            # The driver's Python body: prange is range there, each chunk runs compiled.
            _sparse_count_f32.py_func(*args)
        else:
            _sparse_count_f32(*args)
    else:
        _sparse_count(flat, mask, counts, status)
    offsets = np.zeros(chunks, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    nnz = int(counts.sum())
    # Compacted nonzeros (and their noise): scratch of nnz elements, not of the full tensor.
    values = np.empty(nnz, np.float32)
    noise = np.empty(nnz if stochastic else 0, np.float32)
    if f32:
        _sparse_collect(flat, mask, counts, offsets, slots, slot_noise, stochastic, key, values,
                        noise)
    elif serial:
        for chunk, start in enumerate(range(0, size, SPARSE_CHUNK)):
            _sparse_gather_chunk(flat, mask, start, min(start + SPARSE_CHUNK, size),
                                 offsets[chunk], stochastic, key, values, noise)
    else:
        _sparse_gather(flat, mask, offsets, stochastic, key, values, noise)
    codes = _backend.empty((nnz,), np.uint8)
    scales = _backend.empty((-(-nnz // group_size),), np.float32)
    _sparse_quantize(values, noise, group_size, stochastic, codes, scales)
    return mask, codes, scales, status


def unpack_sparse(mask, codes, scales, size, group_size):
    """Inverse of ``pack_sparse``: [size] float32."""
    chunks = -(-size // SPARSE_CHUNK)
    counts = np.empty(chunks, np.int64)
    _sparse_popcount(mask, size, counts)
    offsets = np.zeros(chunks, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    out = _backend.empty((size,), np.float32)
    if size < SERIAL_ELEMENTS:
        for chunk, start in enumerate(range(0, size, SPARSE_CHUNK)):
            _sparse_scatter_chunk(mask, codes, scales, start, min(start + SPARSE_CHUNK, size),
                                  offsets[chunk], group_size, out)
    else:
        _sparse_scatter(mask, codes, scales, offsets, group_size, out)
    return out
