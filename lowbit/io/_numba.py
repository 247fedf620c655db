"""Numba kernels for the conversions of ``_numpy.py`` (same functions, same results; the layouts
are described there). Siblings: ``gguf.py``, ``hf_bitnet.py``; tests ``tests/test_io_gguf.py``,
``tests/test_io_hf_bitnet.py``.

TQ2_0 and the Hugging Face layout are both 4 x 4 transposes of 2-bit fields. Hugging Face's
byte ``[r, 4 j + t]`` holds field ``t`` of lowbit's bytes ``[i R + r, j]`` for ``i < 4``: the four
source bytes make one uint32 (byte ``i`` at bits ``8 i``), two delta swaps transpose it, and its
bytes are the destination's (``_transpose4``). TQ2_0's byte ``4 a + t`` of a 32-byte half block
holds field ``t`` of lowbit's byte ``8 s + a`` for ``s < 4``: the half block is four uint64 words
(``s``) of eight lanes (``a``); ``_cross4`` transposes the fields in every lane at once and
``_interleave`` puts lane ``a`` of word ``t`` at byte ``4 a + t``. Both transposes are their own
inverses. The word loops are plain loops over contiguous words, which LLVM vectorizes; the
block bookkeeping (66-byte blocks, scales, flags) is a second, memcpy-like pass.
"""

import numba
import numpy as np

from .. import _backend

_backend.numba_cache_guard(__file__)  # the kernels freeze constants of ``_numpy.py``

from ._numpy import QK, TQ1_BYTES, TQ2_BYTES, scale_bits  # noqa: E402

_U64 = np.uint64
_U32 = np.uint32
_M33, _MCC = _U64(0x3333333333333333), _U64(0xCCCCCCCCCCCCCCCC)
_M0F, _MF0 = _U64(0x0F0F0F0F0F0F0F0F), _U64(0xF0F0F0F0F0F0F0F0)
_LO32, _S16, _S8 = _U64(0xFFFFFFFF), _U64(0x0000FFFF0000FFFF), _U64(0x00FF00FF00FF00FF)
_LOW64, _ONES64 = _U64(0x5555555555555555), _U64(0x5555555555555555)  # fields' low bits; codes 0
#: Fewest blocks a parallel chunk of the TQ2_0 kernels covers.
_CHUNK_BLOCKS = 1 << 11


@numba.njit(cache=True, inline="always")
def _transpose4(x):
    """Field ``t`` of byte ``i`` <-> field ``i`` of byte ``t`` in a 32-bit word (uint32)."""
    t = ((x >> _U32(6)) ^ x) & _U32(0x00CC00CC)
    x = x ^ t ^ (t << _U32(6))
    t = ((x >> _U32(12)) ^ x) & _U32(0x0000F0F0)
    return x ^ t ^ (t << _U32(12))


@numba.njit(cache=True, inline="always")
def _threes32(x):
    """Non-zero where a 2-bit field of the uint32 ``x`` holds 3."""
    return x & (x >> _U32(1)) & _U32(0x55555555)


@numba.njit(cache=True, inline="always")
def _cross4(w0, w1, w2, w3):
    """The 4 x 4 field transpose of ``_transpose4`` in all 8 byte lanes of four uint64 words at
    once: field ``t`` of lane ``a`` of word ``s`` <-> field ``s`` of lane ``a`` of word ``t``."""
    a0 = (w0 & _M33) | ((w1 << _U64(2)) & _MCC)
    a1 = ((w0 >> _U64(2)) & _M33) | (w1 & _MCC)
    a2 = (w2 & _M33) | ((w3 << _U64(2)) & _MCC)
    a3 = ((w2 >> _U64(2)) & _M33) | (w3 & _MCC)
    return ((a0 & _M0F) | ((a2 << _U64(4)) & _MF0), (a1 & _M0F) | ((a3 << _U64(4)) & _MF0),
            ((a0 >> _U64(4)) & _M0F) | (a2 & _MF0), ((a1 >> _U64(4)) & _M0F) | (a3 & _MF0))


@numba.njit(cache=True, inline="always")
def _spread8(x):
    """The 4 bytes of a 32-bit value into the even bytes of a 64-bit one."""
    x = (x | (x << _U64(16))) & _S16
    return (x | (x << _U64(8))) & _S8


@numba.njit(cache=True, inline="always")
def _spread16(x):
    return (x | (x << _U64(16))) & _S16


@numba.njit(cache=True, inline="always")
def _compact8(y):
    """The even bytes of a 64-bit value, packed into 32 bits (inverse of ``_spread8``)."""
    y = y & _S8
    y = (y | (y >> _U64(8))) & _S16
    return (y | (y >> _U64(16))) & _LO32


@numba.njit(cache=True, inline="always")
def _compact16(y):
    y = y & _S16
    return (y | (y >> _U64(16))) & _LO32


@numba.njit(cache=True, inline="always")
def _interleave(o0, o1, o2, o3):
    """Bytes ``a`` of words ``t`` -> byte ``4 a + t`` of the 32 bytes the four words span."""
    l01 = _spread8(o0 & _LO32) | (_spread8(o1 & _LO32) << _U64(8))
    l23 = _spread8(o2 & _LO32) | (_spread8(o3 & _LO32) << _U64(8))
    h01 = _spread8(o0 >> _U64(32)) | (_spread8(o1 >> _U64(32)) << _U64(8))
    h23 = _spread8(o2 >> _U64(32)) | (_spread8(o3 >> _U64(32)) << _U64(8))
    return (_spread16(l01 & _LO32) | (_spread16(l23 & _LO32) << _U64(16)),
            _spread16(l01 >> _U64(32)) | (_spread16(l23 >> _U64(32)) << _U64(16)),
            _spread16(h01 & _LO32) | (_spread16(h23 & _LO32) << _U64(16)),
            _spread16(h01 >> _U64(32)) | (_spread16(h23 >> _U64(32)) << _U64(16)))


@numba.njit(cache=True, inline="always")
def _deinterleave(q0, q1, q2, q3):
    """Inverse of ``_interleave``."""
    l01 = _compact16(q0) | (_compact16(q1) << _U64(32))
    l23 = _compact16(q0 >> _U64(16)) | (_compact16(q1 >> _U64(16)) << _U64(32))
    h01 = _compact16(q2) | (_compact16(q3) << _U64(32))
    h23 = _compact16(q2 >> _U64(16)) | (_compact16(q3 >> _U64(16)) << _U64(32))
    return (_compact8(l01) | (_compact8(h01) << _U64(32)),
            _compact8(l01 >> _U64(8)) | (_compact8(h01 >> _U64(8)) << _U64(32)),
            _compact8(l23) | (_compact8(h23) << _U64(32)),
            _compact8(l23 >> _U64(8)) | (_compact8(h23 >> _U64(8)) << _U64(32)))


@numba.njit(cache=True, inline="always")
def _put_word(out16, o, q):
    """A uint64 word as 4 uint16 at ``out16[o:]`` (TQ2_0 blocks are only 2-byte aligned)."""
    m = _U64(0xFFFF)
    out16[o] = q & m
    out16[o + 1] = (q >> _U64(16)) & m
    out16[o + 2] = (q >> _U64(32)) & m
    out16[o + 3] = q >> _U64(48)


@numba.njit(cache=True, inline="always")
def _get_word(in16, o):
    return (_U64(in16[o]) | (_U64(in16[o + 1]) << _U64(16)) | (_U64(in16[o + 2]) << _U64(32))
            | (_U64(in16[o + 3]) << _U64(48)))


@numba.njit(cache=True, inline="always")
def _field_flags(w0, w1, w2, w3):
    """Bit 0: a field other than 1 (a non-zero code); bit 1: a field holding 3."""
    nz = (w0 ^ _ONES64) | (w1 ^ _ONES64) | (w2 ^ _ONES64) | (w3 ^ _ONES64)
    bad = ((w0 & (w0 >> _U64(1))) | (w1 & (w1 >> _U64(1))) | (w2 & (w2 >> _U64(1)))
           | (w3 & (w3 >> _U64(1)))) & _LOW64
    return np.uint8((nz != 0) | ((bad != 0) << 1))


@numba.njit(cache=True)
def _tq2_words(src, dst, hflags, forward):
    """Half blocks of four uint64 words, lowbit -> TQ2_0 order (``forward``) or back, and each
    half block's ``_field_flags``: a plain loop over contiguous words, which LLVM vectorizes."""
    for g in range(hflags.shape[0]):
        w0, w1, w2, w3 = src[4 * g], src[4 * g + 1], src[4 * g + 2], src[4 * g + 3]
        if forward:
            hflags[g] = _field_flags(w0, w1, w2, w3)
            o0, o1, o2, o3 = _cross4(w0, w1, w2, w3)
            q0, q1, q2, q3 = _interleave(o0, o1, o2, o3)
        else:
            o0, o1, o2, o3 = _deinterleave(w0, w1, w2, w3)
            q0, q1, q2, q3 = _cross4(o0, o1, o2, o3)
            hflags[g] = _field_flags(q0, q1, q2, q3)
        dst[4 * g], dst[4 * g + 1], dst[4 * g + 2], dst[4 * g + 3] = q0, q1, q2, q3


@numba.njit(cache=True)
def _tq2_scatter(qs, out16, hflags, flags, d16, lo, hi):
    """Blocks ``lo:hi``: 8 words of ``qs`` each -> 33 uint16 of ``out16`` (the 64 bytes, then
    the scale), and the block flags."""
    for blk in range(lo, hi):
        f = hflags[2 * blk] | hflags[2 * blk + 1]
        for w in range(8):
            _put_word(out16, 33 * blk + 4 * w, qs[8 * blk + w])
        out16[33 * blk + 32] = d16 if f & 1 else 0
        flags[blk] = f


@numba.njit(cache=True)
def _tq2_gather(in16, qs, scales, lo, hi):
    for blk in range(lo, hi):
        for w in range(8):
            qs[8 * blk + w] = _get_word(in16, 33 * blk + 4 * w)
        scales[blk] = in16[33 * blk + 32]


@numba.njit(cache=True, parallel=True)
def _tq2_out(src, qs, out16, hflags, flags, d16, chunks):
    blocks = flags.shape[0]
    step = -(-blocks // chunks)
    for c in numba.prange(chunks):
        lo, hi = c * step, min(blocks, (c + 1) * step)
        _tq2_words(src[8 * lo:8 * hi], qs[8 * lo:8 * hi], hflags[2 * lo:2 * hi], True)
        _tq2_scatter(qs, out16, hflags, flags, d16, lo, hi)


@numba.njit(cache=True, parallel=True)
def _tq2_in(in16, qs, out, hflags, flags, scales, chunks):
    blocks = flags.shape[0]
    step = -(-blocks // chunks)
    for c in numba.prange(chunks):
        lo, hi = c * step, min(blocks, (c + 1) * step)
        _tq2_gather(in16, qs, scales, lo, hi)
        _tq2_words(qs[8 * lo:8 * hi], out[8 * lo:8 * hi], hflags[2 * lo:2 * hi], False)
        for blk in range(lo, hi):
            flags[blk] = hflags[2 * blk] | hflags[2 * blk + 1]


def _chunks(blocks):
    return max(1, min(numba.get_num_threads() * 4, blocks // _CHUNK_BLOCKS))


def _aligned(a):
    """``a`` itself when its data may be read as words, else an aligned copy."""
    return a if a.ctypes.data % 8 == 0 else a.copy()


def to_tq2(data, nb, d16):
    N = data.shape[0]
    out = np.empty((N, nb * TQ2_BYTES), np.uint8)
    flags = np.empty((N, nb), np.uint8)
    _tq2_out(_aligned(data).reshape(-1).view(np.uint64), np.empty(N * nb * 8, np.uint64),
             out.reshape(-1).view(np.uint16), np.empty(N * nb * 2, np.uint8), flags.reshape(-1),
             d16, _chunks(N * nb))
    return out, flags


def from_tq2(blocks, nb):
    N = blocks.shape[0]
    out = np.empty((N, nb * 64), np.uint8)
    flags = np.empty((N, nb), np.uint8)
    scales = np.empty((N, nb), np.uint16)
    src = blocks if blocks.ctypes.data % 2 == 0 else blocks.copy()
    _tq2_in(src.reshape(-1).view(np.uint16), np.empty(N * nb * 8, np.uint64),
            out.reshape(-1).view(np.uint64), np.empty(N * nb * 2, np.uint8), flags.reshape(-1),
            scales.reshape(-1), _chunks(N * nb))
    return out, flags, scales


@numba.njit(cache=True, inline="always")
def _block_flags(words, b):
    """``_field_flags`` of block ``b`` of a row of lowbit data held as uint64 words."""
    i = 8 * b
    return (_field_flags(words[i], words[i + 1], words[i + 2], words[i + 3])
            | _field_flags(words[i + 4], words[i + 5], words[i + 6], words[i + 7]))


@numba.njit(cache=True, inline="always")
def _tq1_group(c, base, width, trits, dst, o):
    """TQ1_0 bytes ``dst[o:o + width]`` of one trit group: ``ceil(q * 256 / 243)`` of the base-3
    number ``q`` (unsigned arithmetic, so the division by a constant vectorizes)."""
    for l in range(width):
        q = (_U32(c[base + l]) * _U32(81) + _U32(c[base + width + l]) * _U32(27)
             + _U32(c[base + 2 * width + l]) * _U32(9) + _U32(c[base + 3 * width + l]) * _U32(3))
        if trits == 5:
            q += _U32(c[base + 4 * width + l])
        dst[o + l] = (q * _U32(256) + _U32(242)) // _U32(243)


@numba.njit(cache=True, parallel=True)
def _to_tq1(data, nb, d16, out, flags):
    for n in numba.prange(data.shape[0]):
        src, dst = data[n], out[n]
        c = np.empty(nb * QK, np.uint8)
        for j in range(nb * 64):
            v = src[j]
            c[4 * j] = v & 3
            c[4 * j + 1] = (v >> 2) & 3
            c[4 * j + 2] = (v >> 4) & 3
            c[4 * j + 3] = v >> 6
        words = src.view(np.uint64)
        for b in range(nb):
            f = _block_flags(words, b)
            o, cb = b * TQ1_BYTES, c[b * QK:(b + 1) * QK]
            _tq1_group(cb, 0, 32, 5, dst, o)
            _tq1_group(cb, 160, 16, 5, dst, o + 32)
            _tq1_group(cb, 240, 4, 4, dst, o + 48)
            d = d16 if f & 1 else 0
            dst[o + 52] = d & 0xFF
            dst[o + 53] = d >> 8
            flags[n, b] = f


def to_tq1(data, nb, d16):
    data = _aligned(data)
    N = data.shape[0]
    out = np.empty((N, nb * TQ1_BYTES), np.uint8)
    flags = np.empty((N, nb), np.uint8)
    _to_tq1(data, nb, d16, out, flags)
    return out, flags


@numba.njit(cache=True, inline="always")
def _trits(src, i0, width, trits, c, base):
    """Byte ``l`` of a group -> its trits, most significant first: ``((v * 3^p) mod 256) * 3
    >> 8`` for digit ``p``."""
    for l in range(width):
        v = np.uint32(src[i0 + l])
        for p in range(trits):
            c[base + p * width + l] = (v * np.uint32(3)) >> np.uint32(8)
            v = (v * np.uint32(3)) & np.uint32(0xFF)


@numba.njit(cache=True, parallel=True)
def _from_tq1(blocks, nb, out, flags):
    for n in numba.prange(blocks.shape[0]):
        src, dst = blocks[n], out[n]
        c = np.empty(QK, np.uint8)
        words = dst.view(np.uint64)
        for b in range(nb):
            i0 = b * TQ1_BYTES
            _trits(src, i0, 32, 5, c, 0)
            _trits(src, i0 + 32, 16, 5, c, 160)
            _trits(src, i0 + 48, 4, 4, c, 240)
            for j in range(64):
                dst[b * 64 + j] = (_U32(c[4 * j]) | (_U32(c[4 * j + 1]) << _U32(2))
                                   | (_U32(c[4 * j + 2]) << _U32(4))
                                   | (_U32(c[4 * j + 3]) << _U32(6)))
            flags[n, b] = _block_flags(words, b)


def from_tq1(blocks, nb):
    N = blocks.shape[0]
    out = np.empty((N, nb * 64), np.uint8)
    flags = np.empty((N, nb), np.uint8)
    _from_tq1(blocks, nb, out, flags)
    return out, flags, scale_bits(blocks, nb, TQ1_BYTES)


@numba.njit(cache=True, parallel=True)
def _to_hf(data, out, zero, bad):
    """data [N, K / 4] -> out [R, K / 4] uint32 (K a multiple of 4); rows past N read ``zero``."""
    N, KB = data.shape
    R = out.shape[0]
    for r in numba.prange(R):
        d0 = data[r]
        d1 = data[R + r] if R + r < N else zero
        d2 = data[2 * R + r] if 2 * R + r < N else zero
        d3 = data[3 * R + r] if 3 * R + r < N else zero
        o = out[r]
        seen = _U32(0)
        for j in range(KB):
            x = (_U32(d0[j]) | (_U32(d1[j]) << _U32(8)) | (_U32(d2[j]) << _U32(16))
                 | (_U32(d3[j]) << _U32(24)))
            seen |= _threes32(x)
            o[j] = _transpose4(x)
        bad[r] = seen != 0


def to_hf(data, K):
    N, KB = data.shape
    R = -(-N // 4)
    out = np.empty((R, 4 * KB), np.uint8)
    bad = np.empty(R, np.bool_)
    if K % 4:  # the padding fields of lowbit's last byte must not count as codes
        data = data.copy()
        data[:, -1] &= (1 << (2 * (K % 4))) - 1
    _to_hf(data, out.view(np.uint32), np.zeros(KB, np.uint8), bad)
    return (out if K % 4 == 0 else np.ascontiguousarray(out[:, :K])), bool(bad.any())


@numba.njit(cache=True, parallel=True)
def _from_hf(packed, out, sink, bad):
    """packed [R, K / 4] uint32 -> out [N, K / 4]; rows past N go to ``sink``."""
    R, KB = packed.shape
    N = out.shape[0]
    for r in numba.prange(R):
        d0 = out[r]
        d1 = out[R + r] if R + r < N else sink[r]
        d2 = out[2 * R + r] if 2 * R + r < N else sink[r]
        d3 = out[3 * R + r] if 3 * R + r < N else sink[r]
        p = packed[r]
        valid = _U32(0)  # the bytes of x that are outputs, not padding
        for i in range(4):
            if i * R + r < N:
                valid |= _U32(0xFF) << _U32(8 * i)
        seen = _U32(0)
        for j in range(KB):
            x = _transpose4(p[j])
            seen |= _threes32(x) & valid
            d0[j] = x & _U32(0xFF)
            d1[j] = (x >> _U32(8)) & _U32(0xFF)
            d2[j] = (x >> _U32(16)) & _U32(0xFF)
            d3[j] = x >> _U32(24)
        bad[r] = seen != 0


def from_hf(packed, N):
    R, K = packed.shape
    KB = -(-K // 4)
    if K % 4 or packed.ctypes.data % 4:  # whole aligned words; zero fields become padding
        wide = np.zeros((R, 4 * KB), np.uint8)
        wide[:, :K] = packed
        packed = wide
    out = np.empty((N, KB), np.uint8)
    bad = np.empty(R, np.bool_)
    _from_hf(packed.view(np.uint32), out, np.empty((R, KB), np.uint8), bad)
    return out, bool(bad.any())
