"""Suite ``layer_norm``: forward and forward + backward against a plain NumPy (or CuPy) layer norm.

8192 rows x 256 features (``--quick``: 1024 x 256), float32 (the fast path) and float64. The
baseline is the textbook array expression a user would write (``(x - mean) / sqrt(var + eps)``
and the matching backward from x), run on the same array module; a plain copy of x gives the
memory bandwidth the norm's traffic is compared with (GB/s: bytes every pass must move at least,
x and y forward, dy, y and dx backward).

Op: ``lowbit/ops/layer_norm``; reference: ``reference/layer_norm.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.reference.layer_norm import layer_norm_bwd_ref, layer_norm_ref

from . import _harness
from ._harness import Case, Config

FEATURES = 256
#: Rows of the timed (and of the checked, against the loop reference) input.
ROWS, QUICK_ROWS, CHECK_ROWS = 8192, 1024, 64
EPS = 1e-5
#: Relative error allowed against the float64 reference.
RTOL = {np.float32: 1e-5, np.float64: 1e-12}



def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def plain_forward(x, xp):
    """The baseline forward: the array expression, statistics kept for the backward."""
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    rstd = 1 / xp.sqrt(var + x.dtype.type(EPS))
    return (x - mean) * rstd, rstd


def plain_backward(dy, y, rstd):
    """The baseline backward from the normalized output and rstd."""
    return rstd * (dy - dy.mean(axis=-1, keepdims=True)
                   - y * (dy * y).mean(axis=-1, keepdims=True))


def _check(x, dy, y, dx, dtype):
    """The first CHECK_ROWS rows of a result against the float64 loop reference."""
    xs, dys = _host(x)[:CHECK_ROWS], _host(dy)[:CHECK_ROWS]
    for name, ref, out in (("y", layer_norm_ref(xs, EPS), _host(y)[:CHECK_ROWS]),
                           ("dx", layer_norm_bwd_ref(dys, xs, EPS), _host(dx)[:CHECK_ROWS])):
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        if not err <= RTOL[dtype]:
            raise AssertionError(f"layer_norm {name} ({np.dtype(dtype).name}): relative error "
                                 f"{err:.2e} above {RTOL[dtype]:.0e}")


def cases(config: Config):
    xp = _harness.xp(config)
    rows = QUICK_ROWS if config.quick else ROWS
    backend = config.backend or ("cuda" if config.gpu else None)
    label = backend or "auto"
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        name = np.dtype(dtype).name
        x = xp.asarray((rng.standard_normal((rows, FEATURES)) * 2 + 0.5).astype(dtype))
        dy = xp.asarray(rng.standard_normal((rows, FEATURES)).astype(dtype))
        n = x.size * x.itemsize
        info = {"dtype": name, "shape": f"{rows}x{FEATURES}"}
        out = xp.empty_like(x)
        yield Case("layer_norm", f"copy {name}", fn=lambda x=x, out=out: xp.copyto(out, x),
                   nbytes=2 * n, info=info)

        def plain_fwd(x=x):
            plain_forward(x, xp)

        def plain_step(x=x, dy=dy):
            y, rstd = plain_forward(x, xp)
            plain_backward(dy, y, rstd)

        def lowbit_fwd(x=x):
            with _maybe(backend):
                lowbit.layer_norm(x)

        def lowbit_step(x=x, dy=dy):
            with _maybe(backend):
                _, ctx = lowbit.layer_norm_forward(x)
                lowbit.layer_norm_backward(dy, ctx)

        def check_plain(x=x, dy=dy, dtype=dtype):
            y, rstd = plain_forward(x, xp)
            _check(x, dy, y, plain_backward(dy, y, rstd), dtype)

        def check_lowbit(x=x, dy=dy, dtype=dtype):
            with _maybe(backend):
                y, ctx = lowbit.layer_norm_forward(x)
                dx = lowbit.layer_norm_backward(dy, ctx)
            _check(x, dy, y, dx, dtype)

        fwd_bytes, step_bytes = 2 * n, 5 * n
        yield Case("layer_norm", f"forward plain {name}", fn=plain_fwd, check=check_plain,
                   nbytes=fwd_bytes, info=info)
        yield Case("layer_norm", f"forward {label} {name}", fn=lowbit_fwd, check=check_lowbit,
                   baseline=f"forward plain {name}", nbytes=fwd_bytes, info=info)
        yield Case("layer_norm", f"fwd+bwd plain {name}", fn=plain_step, nbytes=step_bytes,
                   info=info)
        yield Case("layer_norm", f"fwd+bwd {label} {name}", fn=lowbit_step,
                   baseline=f"fwd+bwd plain {name}", nbytes=step_bytes, info=info)
