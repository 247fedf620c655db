"""Suite ``embedding``: the row gather and the table gradient's scatter-add against NumPy/CuPy.

Op: ``lowbit/ops/embedding``; reference: ``reference/embedding.py``. Baselines, measured in the
same run: on CPU ``table[ids]`` and ``np.add.at`` (what a NumPy user writes; ``add.at`` adds in
position order, like lowbit); on GPU ``table[ids]`` and ``cupyx.scatter_add`` (float atomics:
fast, but its sums vary run to run, which lowbit's backward does not).
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.reference.embedding import embedding_bwd_ref, embedding_ref

from ._harness import Case, Config

#: Vocabulary rows, columns and the ids' shape of the timed cases.
VOCAB, DIM = 256, 256
IDS_SHAPE = (8, 512)
#: float32 sums of up to a few dozen rows against the float64 reference.
RTOL = 1e-6


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _check(name, ref, got, rtol=0.0):
    got = np.asarray(_host(got), dtype=np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {got.shape}, expected {ref.shape}")
    err = float(np.abs(got - ref).max()) if ref.size else 0.0
    if err > rtol * float(np.abs(ref).max()):
        raise AssertionError(f"{name}: max abs error {err:.3e} against the reference")


def cases(config: Config):
    if config.gpu:
        import cupy as xp
        import cupyx
    else:
        xp = np
    backend = config.backend or ("cuda" if config.gpu else None)
    shape = (2, 512) if config.quick else IDS_SHAPE
    rng = np.random.default_rng(0)
    table_h = rng.standard_normal((VOCAB, DIM)).astype(np.float32)
    ids_h = rng.integers(0, VOCAB, shape)
    dout_h = rng.standard_normal(shape + (DIM,)).astype(np.float32)
    out_ref = embedding_ref(table_h, ids_h)
    dtable_ref = embedding_bwd_ref(dout_h, ids_h, VOCAB)
    table, ids, dout = xp.asarray(table_h), xp.asarray(ids_h), xp.asarray(dout_h)
    flat_ids, flat_dout = ids.reshape(-1), dout.reshape(-1, DIM)
    positions = ids.size
    info = {"V": VOCAB, "D": DIM, "ids": "x".join(map(str, shape))}
    # Bytes a call must move: the rows read and written (ids are 1/D of that).
    gather_bytes = 2 * positions * DIM * 4 + ids.nbytes
    scatter_bytes = positions * DIM * 4 + VOCAB * DIM * 4 + ids.nbytes

    def numpy_gather():
        return table[ids]

    def numpy_scatter():
        dtable = xp.zeros((VOCAB, DIM), np.float32)
        if config.gpu:
            cupyx.scatter_add(dtable, flat_ids, flat_dout)
        else:
            np.add.at(dtable, flat_ids, flat_dout)
        return dtable

    def lowbit_gather():
        with _maybe(backend):
            return lowbit.embedding(table, ids)

    with _maybe(backend):
        _, ctx = lowbit.embedding_forward(table, ids)

    def lowbit_scatter():
        with _maybe(backend):
            return lowbit.embedding_backward(dout, ctx)

    peer = "cupy" if config.gpu else "numpy"
    label = backend or "auto"
    # The copy bandwidth the gather's GB/s is read against: its output's bytes, read and written.
    src = xp.asarray(dout_h)
    dst = xp.empty_like(src)
    yield Case("embedding", "copy", fn=lambda: xp.copyto(dst, src), nbytes=2 * src.nbytes,
               info=info)
    yield Case("embedding", f"gather {peer}", fn=numpy_gather, nbytes=gather_bytes,
               check=lambda: _check("gather baseline", out_ref, numpy_gather()), info=info)
    yield Case("embedding", f"gather {label}", fn=lowbit_gather, nbytes=gather_bytes,
               check=lambda: _check("gather", out_ref, lowbit_gather()),
               baseline=f"gather {peer}", info=info)
    base = "scatter_add (atomics)" if config.gpu else "add.at"
    yield Case("embedding", f"bwd {peer} {base}", fn=numpy_scatter, nbytes=scatter_bytes,
               check=lambda: _check("scatter baseline", dtable_ref, numpy_scatter(), RTOL),
               info=info)
    yield Case("embedding", f"bwd {label}", fn=lowbit_scatter, nbytes=scatter_bytes,
               check=lambda: _check("scatter", dtable_ref, lowbit_scatter(), RTOL),
               baseline=f"bwd {peer} {base}", info=info)


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()
