"""Suite ``memory``: bytes, error and pack/unpack bandwidth of every saved-activation format.

A BDH-like activation (B=4, H=4, T=256, N=2048; ``--quick``: 2x2x64x512), once dense Gaussian
(``kind="values"``) and once ReLU'd to 5% nonzeros (``kind="nonneg"``, plus ``"sparse"``). Each
row gives the bytes held, the ratio against fp32, max and RMS error, and GB/s (bytes read plus
bytes written) against a plain NumPy copy of the fp32 tensor (``x.copy()``: a fresh output, as
pack and unpack return) measured in the same run. A row's target is 50% of the copy's GB/s,
written as the time ratio it implies. The suite ends with ``lowbit.memory_report`` of a
``linear_forward`` ctx saved as int8.

Op: ``lowbit/ops/saved_activation``; reference: ``reference/saved_activation.py``.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

import lowbit
from lowbit.reference.saved_activation import pack_activation_ref, unpack_activation_ref

from ._harness import Case, Config

#: Pack and unpack must reach this fraction of the copy bandwidth.
BANDWIDTH_TARGET = 0.5
DENSE_FORMATS = ("fp32", "int8", "int4", "int2")


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _data(shape, quick):
    rng = np.random.default_rng(0)
    dense = rng.standard_normal(shape, dtype=np.float32)
    # The 95th percentile of a standard normal: ReLU(x - 1.645) keeps about 5% nonzeros.
    relu = np.maximum(dense - np.float32(1.645), np.float32(0))
    return dense, relu


def _check_small(x, fmt, kind, rounding, backend, xp):
    """Bitwise agreement with the reference on a corner of the tensor, before any timing."""
    small = np.ascontiguousarray(x.reshape(-1, x.shape[-1])[:3, :600])
    with _maybe(backend):
        packed = lowbit.pack_activation(xp.asarray(small), fmt, kind=kind, rounding=rounding)
        out = _host(packed.unpack())
    ref = pack_activation_ref(small, fmt, kind, rounding=rounding)
    for name, want in ref.items():
        np.testing.assert_array_equal(_host(packed.arrays[name]), want, err_msg=name)
    np.testing.assert_array_equal(out, unpack_activation_ref(ref, small.shape, fmt, kind))


def cases(config: Config):
    xp = np
    if config.gpu:
        import cupy

        xp = cupy
    backend = config.backend or ("cuda" if config.gpu else None)
    # Other processes share these cores: a loaded machine slows the parallel kernels first.
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")
    shape = (2, 2, 64, 512) if config.quick else (4, 4, 256, 2048)
    dense, relu = _data(shape, config.quick)
    dense_bytes = dense.nbytes
    src = xp.asarray(dense)
    dst = xp.empty_like(src)
    yield Case("memory", "copy", fn=lambda: src.copy(), nbytes=2 * dense_bytes,
               info={"format": "fp32 copy", "bytes": dense_bytes})
    yield Case("memory", "copyto (preallocated)", fn=lambda: xp.copyto(dst, src),
               nbytes=2 * dense_bytes, baseline="copy", info={"format": "fp32 copy"})
    for data_name, host, kind, formats, rounding in (
        ("gaussian", dense, "values", DENSE_FORMATS, "nearest"),
        ("relu 5%", relu, "nonneg", DENSE_FORMATS + ("sparse",), "nearest"),
        ("gaussian", dense, "values", ("int2",), "stochastic"),
    ):
        x = xp.asarray(host)
        for fmt in formats:
            with _maybe(backend):
                packed = lowbit.pack_activation(x, fmt, kind=kind, rounding=rounding)
                out = _host(packed.unpack()).astype(np.float64)
            err = np.abs(out - host)
            moved = dense_bytes + packed.nbytes
            info = {
                "data": data_name, "format": fmt, "kind": kind, "rounding": rounding,
                "bytes": packed.nbytes,
                "bytes/fp32": f"1/{packed.dense_nbytes / packed.nbytes:.1f}",
                "max err": float(err.max()), "rms err": float(np.sqrt(np.mean(err**2))),
            }
            # GB/s of this case >= 50% of the copy's GB/s, as a time ratio against the copy.
            target = BANDWIDTH_TARGET * moved / (2 * dense_bytes)

            def pack(x=x, fmt=fmt, kind=kind, rounding=rounding):
                with _maybe(backend):
                    lowbit.pack_activation(x, fmt, kind=kind, rounding=rounding)

            def unpack(packed=packed):
                with _maybe(backend):
                    packed.unpack()

            check = (lambda h=host, f=fmt, k=kind, r=rounding:
                     _check_small(h, f, k, r, backend, xp))
            label = f"{fmt} {data_name}" + (" stochastic" if rounding == "stochastic" else "")
            yield Case("memory", f"pack {label}", fn=pack, check=check, baseline="copy",
                       target=target, nbytes=moved, info=info)
            yield Case("memory", f"unpack {label}", fn=unpack, baseline="copy", target=target,
                       nbytes=moved, info=dict(info))
    yield from _linear_report(xp, backend)


def _linear_report(xp, backend):
    """``memory_report`` of a ``linear_forward`` ctx with ``saved="int8"``."""
    if not hasattr(lowbit, "linear_forward"):
        print("(lowbit.linear_forward not available: no linear ctx report)")
        return
    rng = np.random.default_rng(1)
    x = xp.asarray(rng.standard_normal((8, 256, 1024), dtype=np.float32))
    w = xp.asarray(rng.standard_normal((1024, 1024), dtype=np.float32))
    for saved in (None, "int8"):
        with _maybe(backend):
            _, ctx = lowbit.linear_forward(x, w, "ternary", None, saved=saved)
        report = lowbit.memory_report(ctx)
        print(f"\nlowbit.memory_report(linear_forward(..., act_format=None, saved={saved!r})):")
        print(report)
        yield Case("memory", f"linear_forward ctx saved={saved}",
                   info={"format": saved or "exact", "bytes": report.nbytes,
                         "bytes/fp32": f"1/{report.dense_nbytes / report.nbytes:.1f}"})
