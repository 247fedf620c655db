"""Vectorized NumPy conversions between lowbit's ternary layout and ggml's / Hugging Face's.

Siblings: ``_numba.py`` (the same functions as kernels, used when Numba is present), ``gguf.py``
and ``hf_bitnet.py`` (validation, scales, the public API); tests ``tests/test_io_gguf.py`` and
``tests/test_io_hf_bitnet.py`` check both modules against the formats' own implementations.

Every function takes validated contiguous uint8 arrays. lowbit's ternary data is ``[N, ceil(K /
4)]``: 2-bit fields ``code + 1``, LSB-first along K. Block functions return ``flags [N, nb]``
uint8: bit 0 set where a block holds a non-zero code, bit 1 where it holds the 2-bit value 3
(which is no ternary code; the callers reject it); the ``from_`` ones also return the blocks'
fp16 scale bits ``[N, nb]`` uint16.

ggml's 256-element blocks (``block_tq2_0``, ``block_tq1_0`` in ggml-common.h):

- TQ2_0, 66 bytes: 64 bytes of 2-bit fields, then the fp16 scale. Element ``128 c + 32 s + l``
  (``c < 2, s < 4, l < 32``) is field ``s`` of byte ``32 c + l``.
- TQ1_0, 54 bytes: 48 bytes of five trits, 4 bytes of four trits, the fp16 scale. Byte ``l`` of
  a group holds elements ``base + p * width + l`` as the base-3 number ``sum_p t_p 3^(4-p)``,
  stored as ``ceil(q * 256 / 243)`` so that trit ``p`` is ``((byte * 3^p) mod 256) * 3 >> 8``.
  The groups are (base, width, trits): (0, 32, 5), (160, 16, 5), (240, 4, 4).
"""

from __future__ import annotations

import numpy as np

from ..ops.pack_bits import _numpy as _pack_bits_numpy

QK = 256
TQ2_BYTES = 66
TQ1_BYTES = 54
#: TQ1_0's trit groups: (first element, bytes, trits per byte).
TQ1_GROUPS = ((0, 32, 5), (160, 16, 5), (240, 4, 4))
_POW3 = np.array([81, 27, 9, 3, 1], dtype=np.uint16)


def _codes(data: np.ndarray, nb: int) -> np.ndarray:
    return _pack_bits_numpy.unpack(data, 2, nb * QK).reshape(data.shape[0], nb, QK)


def _flags(codes: np.ndarray) -> np.ndarray:
    return ((codes != 1).any(-1) | ((codes == 3).any(-1) << 1)).astype(np.uint8)


def scale_bits(blocks: np.ndarray, nb: int, nbytes: int) -> np.ndarray:
    """The fp16 scales' bits [N, nb] uint16 of blocks [N, nb * nbytes] (the last two bytes of
    each block, little-endian)."""
    b = blocks.reshape(blocks.shape[0], nb, nbytes)
    return b[:, :, -2].astype(np.uint16) | (b[:, :, -1].astype(np.uint16) << 8)


def _with_scales(qs: np.ndarray, flags: np.ndarray, d16: int) -> np.ndarray:
    d = np.where(flags & 1, np.uint16(d16), np.uint16(0)).astype("<u2")
    return np.concatenate([qs, d[..., None].view(np.uint8)], axis=-1)


def to_tq2(data: np.ndarray, nb: int, d16: int) -> tuple[np.ndarray, np.ndarray]:
    """data [N, 64 nb] -> (blocks [N, 66 nb], flags [N, nb]); ``d16`` the fp16 scale's bits,
    written into every block that holds a non-zero code (0 into the others, as ggml does)."""
    N = data.shape[0]
    codes = _codes(data, nb)
    fields = codes.reshape(N, nb, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qs = np.bitwise_or.reduce(fields, axis=3).reshape(N, nb, 64)
    flags = _flags(codes)
    return _with_scales(qs, flags, d16).reshape(N, nb * TQ2_BYTES), flags


def from_tq2(blocks: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks [N, 66 nb] -> (data [N, 64 nb], flags [N, nb], scale bits [N, nb] uint16)."""
    N = blocks.shape[0]
    qs = blocks.reshape(N, nb, TQ2_BYTES)[:, :, :64].reshape(N, nb, 2, 1, 32)
    codes = ((qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(N, nb, QK)
    return (_pack_bits_numpy.pack(codes.reshape(N, nb * QK), 2), _flags(codes),
            scale_bits(blocks, nb, TQ2_BYTES))


def to_tq1(data: np.ndarray, nb: int, d16: int) -> tuple[np.ndarray, np.ndarray]:
    """data [N, 64 nb] -> (blocks [N, 54 nb], flags [N, nb]); scales as in ``to_tq2``."""
    N = data.shape[0]
    codes = _codes(data, nb)
    parts: list[np.ndarray] = []
    for base, width, trits in TQ1_GROUPS:
        group = codes[..., base:base + width * trits].reshape(N, nb, trits, width)
        q = (group.astype(np.uint16) * _POW3[:trits, None]).sum(axis=2, dtype=np.uint16)
        parts.append(((q * 256 + 242) // 243).astype(np.uint8))
    flags = _flags(codes)
    return _with_scales(np.concatenate(parts, -1), flags, d16).reshape(N, nb * TQ1_BYTES), flags


def from_tq1(blocks: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks [N, 54 nb] -> (data [N, 64 nb], flags [N, nb], scale bits [N, nb] uint16)."""
    N = blocks.shape[0]
    b = blocks.reshape(N, nb, TQ1_BYTES)
    parts: list[np.ndarray] = []
    start = 0
    for _, width, trits in TQ1_GROUPS:
        group = b[..., None, start:start + width].astype(np.uint16)
        scaled = (group * _POW3[::-1][:trits, None]) & 255
        parts.append(((scaled * 3) >> 8).astype(np.uint8).reshape(N, nb, trits * width))
        start += width
    codes = np.concatenate(parts, -1)
    return (_pack_bits_numpy.pack(codes.reshape(N, nb * QK), 2), _flags(codes),
            scale_bits(blocks, nb, TQ1_BYTES))


def to_hf(data: np.ndarray, K: int) -> tuple[np.ndarray, bool]:
    """data [N, ceil(K / 4)] -> (packed [ceil(N / 4), K], bad): output ``n`` is field ``n // R``
    of row ``n % R`` (``R = ceil(N / 4)``), missing outputs are 0 fields; ``bad`` is True where a
    field holds 3."""
    N = data.shape[0]
    R = -(-N // 4)
    codes = _pack_bits_numpy.unpack(data, 2, K)
    padded = np.zeros((4 * R, K), np.uint8)
    padded[:N] = codes
    fields = padded.reshape(4, R, K) << (2 * np.arange(4, dtype=np.uint8))[:, None, None]
    return np.bitwise_or.reduce(fields, axis=0), bool((codes == 3).any())


def from_hf(packed: np.ndarray, N: int) -> tuple[np.ndarray, bool]:
    """packed [ceil(N / 4), K] -> (data [N, ceil(K / 4)], bad); padding outputs are ignored."""
    R, K = packed.shape
    fields = (packed[None] >> (2 * np.arange(4, dtype=np.uint8))[:, None, None]) & 3
    codes = fields.reshape(4 * R, K)[:N]
    return _pack_bits_numpy.pack(codes, 2), bool((codes == 3).any())
