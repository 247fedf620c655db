"""Block-sparse latent patterns of the low-rank residual layer (``lowbit.BlockPattern``).

A pattern marks which blocks of ``block_size`` consecutive latent neurons of each head are
active; the layer (``_layer.py``) then computes, saves and differentiates only those neurons: it
gathers the active columns of the encoders, the active rows of the decoder (packed weights by
their codes, never re-quantized: the scale stays the whole tensor's) and the rotary angles of
the active pairs, and runs every product and the attention on the compacted latent axis.
Siblings: ``__init__.py`` (API), ``_layer.py``; reference ``block_mask_ref`` in
``reference/lowrank_residual.py``; tests ``tests/test_lowrank_residual_pattern.py``.
"""

from __future__ import annotations

import numpy as np

from ... import _backend, _kernels, _validate
from ..quantize import PackedWeight, weight_rows_at


class BlockPattern:
    """Which blocks of latent neurons are active: frozen, hashable, printable.

    Args:
        block_size: neurons per block (>= 1); the last block of a head may be partial. With
            ``attention="causal_linear"`` a sparse pattern needs an even ``block_size``, so that
            the rotary pairs (2j, 2j + 1) stay in one block.
        active: boolean host array ``[blocks]`` (shared by every head) or ``[H, blocks]`` (per
            head), ``blocks = ceil(N / block_size)``; None: every block active (``dense``). A
            head with no active block contributes nothing (allowed).
    """

    __slots__ = ("block_size", "_active")
    block_size: int
    _active: np.ndarray | None

    def __init__(self, block_size, active=None):
        block_size = _validate.integer(block_size, "block_size", minimum=1)
        if active is not None:
            if _backend.is_cupy_array(active):
                raise TypeError("active must be a host (numpy) boolean array, got a cupy array")
            a = np.asarray(active)
            if a.dtype != np.bool_:
                raise TypeError(f"active must be a boolean array, got {a.dtype}")
            if a.ndim not in (1, 2) or 0 in a.shape:
                raise ValueError(f"active must have shape [blocks] or [H, blocks] with positive "
                                 f"sizes, got {a.shape}")
            active = a.copy()
            active.flags.writeable = False
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "_active", active)

    def __setattr__(self, name, value):
        raise AttributeError("BlockPattern is frozen")

    @classmethod
    def dense(cls, block_size) -> "BlockPattern":
        """Every block active, for any N."""
        return cls(block_size, None)

    @classmethod
    def from_mask(cls, mask, block_size) -> "BlockPattern":
        """The pattern whose active blocks are those holding at least one set neuron of
        ``mask`` (boolean ``[N]`` or ``[H, N]``)."""
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean array, got {m.dtype}")
        if m.ndim not in (1, 2) or 0 in m.shape:
            raise ValueError(f"mask must have shape [N] or [H, N], got {m.shape}")
        block_size = _validate.integer(block_size, "block_size", minimum=1)
        blocks = -(-m.shape[-1] // block_size)
        pad = np.zeros(m.shape[:-1] + (blocks * block_size,), dtype=bool)
        pad[..., :m.shape[-1]] = m
        return cls(block_size, pad.reshape(m.shape[:-1] + (blocks, block_size)).any(axis=-1))

    @property
    def active(self):
        """The read-only boolean array of active blocks, or None (dense)."""
        return self._active

    def _key(self):
        a = self._active
        return (self.block_size, None if a is None else (a.shape, a.tobytes()))

    def __eq__(self, other):
        return isinstance(other, BlockPattern) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        if self._active is None:
            return f"BlockPattern.dense({self.block_size})"
        rows = ["".join("1" if v else "0" for v in row) for row in np.atleast_2d(self._active)]
        shown = rows[0] if self._active.ndim == 1 else "/".join(rows)
        return f"BlockPattern(block_size={self.block_size}, active={shown!r})"

    def indices(self, H: int, N: int):
        """Active latent indices per head: None when every neuron of every head is active,
        else a tuple of H sorted int64 host arrays. Raises ValueError naming
        ``latent_pattern`` when the pattern does not fit ``H`` heads of ``N`` neurons."""
        blocks = -(-N // self.block_size)
        a = self._active
        if a is None:
            return None
        if a.shape[-1] != blocks:
            raise ValueError(f"latent_pattern has {a.shape[-1]} blocks but N = {N} neurons in "
                             f"blocks of {self.block_size} make {blocks}")
        if a.ndim == 2 and a.shape[0] != H:
            raise ValueError(f"latent_pattern has {a.shape[0]} heads of blocks but the layer "
                             f"has H = {H}")
        if a.all():
            return None
        per_head = np.broadcast_to(a, (H, blocks))
        neuron = np.arange(N) // self.block_size
        return tuple(np.flatnonzero(per_head[h][neuron]).astype(np.int64) for h in range(H))


def latent_pattern(pattern, H, N, attention):
    """``latent_pattern=`` checked against the layer: the indices of ``BlockPattern.indices``."""
    if pattern is None:
        return None
    if not isinstance(pattern, BlockPattern):
        raise TypeError(f"latent_pattern must be a lowbit.BlockPattern or None, got "
                        f"{type(pattern).__name__}")
    idx = pattern.indices(H, N)
    if idx is not None and attention == "causal_linear" and pattern.block_size % 2:
        raise ValueError(f"latent_pattern.block_size must be even with attention="
                         f"'causal_linear' (rotary pairs stay in one block), got "
                         f"{pattern.block_size}")
    return idx


def gather_columns(pw, cols):
    """Output columns ``cols`` (host int64) of a ``PackedWeight``: its rows of codes, the scale
    kept (a per-column scale gathered too)."""
    xp = _backend.array_module(pw.data)
    c = _kernels.device_constant(cols, pw.data)
    scale = pw.scale if pw.scale.ndim == 0 else xp.ascontiguousarray(pw.scale[c])
    return PackedWeight(pw.format, (pw.shape[0], len(cols)), xp.ascontiguousarray(pw.data[c]),
                        scale)


def runs(index):
    """``[(start, stop), ...]``: the runs of consecutive values of sorted host int64 ``index``."""
    if not len(index):
        return []
    cut = np.flatnonzero(np.diff(index) != 1) + 1
    first = np.concatenate([[0], cut])
    last = np.concatenate([cut, [len(index)]]) - 1
    return list(zip(index[first].tolist(), (index[last] + 1).tolist()))


def gather_rows(pw, rows):
    """Input rows ``rows`` (host int64, sorted) of a ``PackedWeight`` with the same scale
    (nothing is re-quantized): their bytes when every run of consecutive rows starts on a byte
    and ends on one (or at K), as a pattern's blocks do, else re-packed from the codes."""
    per, K = pw.codes_per_byte, pw.shape[0]
    spans = runs(rows)
    if all(s % per == 0 and (e % per == 0 or e == K) for s, e in spans):
        data_cols = np.concatenate([np.arange(s // per, -(-e // per)) for s, e in spans])
        xp = _backend.array_module(pw.data)
        data = xp.ascontiguousarray(pw.data[:, _kernels.device_constant(data_cols, pw.data)])
        return PackedWeight(pw.format, (len(rows), pw.shape[1]), data, pw.scale)
    return weight_rows_at(pw, _kernels.device_constant(rows, pw.data))
