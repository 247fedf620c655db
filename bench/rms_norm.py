"""Suite ``rms_norm``: forward and forward + backward against a plain NumPy (or CuPy) RMS norm.

8192 rows x 2560 features (BitNet b1.58 2B's hidden size; ``--quick``: 512 x 2560), float32 (the
fast path) and float64. The baseline is the array expression a user would write
(``weight * (x / sqrt(mean(x**2) + eps))`` and the matching backward from x), run on the same
array module; a plain copy of x gives the memory bandwidth the norm's traffic is compared with
(GB/s: bytes every pass must move at least, x and y forward, dy, x and dx backward).

Op: ``lowbit/ops/rms_norm``; reference: ``reference/rms_norm.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.reference.rms_norm import rms_norm_bwd_ref, rms_norm_ref

from . import _harness
from ._harness import Case, Config

FEATURES = 2560
#: Rows of the timed (and of the checked, against the loop reference) input.
ROWS, QUICK_ROWS, CHECK_ROWS = 8192, 512, 8
EPS = 1e-6
#: Relative error allowed against the float64 reference (dweight: a sum over every row, which
#: the plain baseline adds row after row: 2.9e-6 at 8192 float32 rows, measured).
RTOL = {np.float32: 1e-5, np.float64: 1e-12}
DWEIGHT_RTOL = {np.float32: 1e-4, np.float64: 1e-11}


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def plain_forward(x, weight, xp):
    """The baseline forward: the array expression, rstd kept for the backward."""
    rstd = 1 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(EPS))
    return weight * (x * rstd), rstd


def plain_backward(dy, x, weight, rstd):
    """The baseline backward from the input and rstd: ``(dx, dweight)``."""
    xhat = x * rstd
    g = dy * weight
    dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0)


def _check(x, weight, dy, y, dx, dweight, dtype):
    """The first CHECK_ROWS rows of y and dx against the float64 loop reference; dweight (a sum
    over every row) against the float64 closed form."""
    xs, dys, w = _host(x)[:CHECK_ROWS], _host(dy)[:CHECK_ROWS], _host(weight)
    ref_dx = rms_norm_bwd_ref(dys, xs, w, EPS)[0]
    x64, dy64 = _host(x).astype(np.float64), _host(dy).astype(np.float64)
    ref_dweight = (dy64 * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)).sum(0)
    for name, ref, out in (("y", rms_norm_ref(xs, w, EPS), _host(y)[:CHECK_ROWS]),
                           ("dx", ref_dx, _host(dx)[:CHECK_ROWS]),
                           ("dweight", ref_dweight, _host(dweight))):
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        bound = (DWEIGHT_RTOL if name == "dweight" else RTOL)[dtype]
        if not err <= bound:
            raise AssertionError(f"rms_norm {name} ({np.dtype(dtype).name}): relative error "
                                 f"{err:.2e} above {bound:.0e}")


def cases(config: Config):
    xp = _harness.xp(config)
    rows = QUICK_ROWS if config.quick else ROWS
    backend = config.backend or ("cuda" if config.gpu else None)
    label = backend or "auto"
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        name = np.dtype(dtype).name
        x = xp.asarray((rng.standard_normal((rows, FEATURES)) * 2 + 0.5).astype(dtype))
        weight = xp.asarray((1 + 0.1 * rng.standard_normal(FEATURES)).astype(dtype))
        dy = xp.asarray(rng.standard_normal((rows, FEATURES)).astype(dtype))
        n = x.size * x.itemsize
        info = {"dtype": name, "shape": f"{rows}x{FEATURES}"}
        out = xp.empty_like(x)
        yield Case("rms_norm", f"copy {name}", fn=lambda x=x, out=out: xp.copyto(out, x),
                   nbytes=2 * n, info=info)

        def plain_fwd(x=x, weight=weight):
            plain_forward(x, weight, xp)

        def plain_step(x=x, weight=weight, dy=dy):
            _, rstd = plain_forward(x, weight, xp)
            plain_backward(dy, x, weight, rstd)

        def lowbit_fwd(x=x, weight=weight):
            with _maybe(backend):
                lowbit.rms_norm(x, weight)

        def lowbit_step(x=x, weight=weight, dy=dy):
            with _maybe(backend):
                _, ctx = lowbit.rms_norm_forward(x, weight)
                lowbit.rms_norm_backward(dy, ctx)

        def check_plain(x=x, weight=weight, dy=dy, dtype=dtype):
            y, rstd = plain_forward(x, weight, xp)
            _check(x, weight, dy, y, *plain_backward(dy, x, weight, rstd), dtype)

        def check_lowbit(x=x, weight=weight, dy=dy, dtype=dtype):
            with _maybe(backend):
                y, ctx = lowbit.rms_norm_forward(x, weight)
                dx, dweight = lowbit.rms_norm_backward(dy, ctx)
            _check(x, weight, dy, y, dx, dweight, dtype)

        fwd_bytes, step_bytes = 2 * n, 5 * n
        yield Case("rms_norm", f"forward plain {name}", fn=plain_fwd, check=check_plain,
                   nbytes=fwd_bytes, info=info)
        yield Case("rms_norm", f"forward {label} {name}", fn=lowbit_fwd, check=check_lowbit,
                   baseline=f"forward plain {name}", nbytes=fwd_bytes, info=info)
        yield Case("rms_norm", f"fwd+bwd plain {name}", fn=plain_step, nbytes=step_bytes,
                   info=info)
        yield Case("rms_norm", f"fwd+bwd {label} {name}", fn=lowbit_step,
                   baseline=f"fwd+bwd plain {name}", nbytes=step_bytes, info=info)
