"""Suite ``rotary``: rotary position embedding against a plain NumPy (or CuPy) rotate_half.

x [2048, 16, 128] (``--quick``: [256, 8, 64]) at positions 0 .. T - 1, theta 10000; float32
half and interleaved styles, float64 half. The baseline is the array expression of transformers'
``apply_rotary_pos_emb`` a user would write (``x * cos + rotate_half(x) * sin`` with full-width
tables), from float64 angles like the op's (float32 angles would fail the check at these
positions), its tables built once before the clock starts (as a model builds them once for all
its layers; the op keeps its host tables in a cache); for the interleaved style the same with
even/odd views. A plain copy of x gives the memory bandwidth the rotation's
traffic (x and y forward, dy and dx backward; the tables are 1/H of it and not counted) is
compared with.

Op: ``lowbit/ops/rotary``; reference: ``reference/rotary.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.reference.rotary import rotary_bwd_ref, rotary_ref

from . import _harness
from ._harness import Case, Config

SHAPE, QUICK_SHAPE = (2048, 16, 128), (256, 8, 64)
THETA = 10000.0
#: Tokens of the result checked against the float64 loop reference (the last ones: the largest
#: positions).
CHECK_TOKENS = 4
#: Relative error allowed against the float64 reference.
RTOL = {np.float32: 2e-6, np.float64: 1e-12}
#: (dtype, style) of the timed rows.
ROWS = ((np.float32, "half"), (np.float32, "interleaved"), (np.float64, "half"))


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _tables(positions, D, dtype, xp):
    """Full-width cos/sin [T, 1, D] from float64 angles (transformers' layout)."""
    inv = THETA ** (-xp.arange(0, D, 2, dtype=np.float64) / D)
    angle = positions.astype(np.float64)[:, None] * inv[None, :]
    full = xp.concatenate([angle, angle], axis=-1)[:, None, :]
    return xp.cos(full).astype(dtype), xp.sin(full).astype(dtype)


def plain_rotary(x, tables, style, xp, inverse=False):
    """The baseline: ``x * cos + rotate_half(x) * sin`` (``inverse``: minus the angles), from
    the full-width ``tables`` of ``_tables``."""
    cos, sin = tables
    if inverse:
        sin = -sin
    half = x.shape[-1] // 2
    if style == "half":
        turned = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + turned * sin
    y = xp.empty_like(x)
    a, b = x[..., 0::2], x[..., 1::2]
    y[..., 0::2] = a * cos[..., :half] - b * sin[..., :half]
    y[..., 1::2] = b * cos[..., :half] + a * sin[..., :half]
    return y


def _check(x, dy, positions, y, dx, dtype, style):
    """The last CHECK_TOKENS tokens of a result against the float64 loop reference."""
    rows = slice(-CHECK_TOKENS, None)
    xs, dys, ps = _host(x)[rows], _host(dy)[rows], _host(positions)[rows]
    for name, ref, out in (("y", rotary_ref(xs, ps, THETA, style), _host(y)[rows]),
                           ("dx", rotary_bwd_ref(dys, ps, THETA, style), _host(dx)[rows])):
        err = np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max()
        if not err <= RTOL[dtype]:
            raise AssertionError(f"rotary {name} ({np.dtype(dtype).name}, {style}): relative "
                                 f"error {err:.2e} above {RTOL[dtype]:.0e}")


def cases(config: Config):
    xp = _harness.xp(config)
    shape = QUICK_SHAPE if config.quick else SHAPE
    backend = config.backend or ("cuda" if config.gpu else None)
    label = backend or "auto"
    rng = np.random.default_rng(0)
    positions = xp.arange(shape[0], dtype=np.int64)
    for dtype, style in ROWS:
        name = f"{np.dtype(dtype).name} {style}"
        x = xp.asarray(rng.standard_normal(shape).astype(dtype))
        dy = xp.asarray(rng.standard_normal(shape).astype(dtype))
        n = x.size * x.itemsize
        info = {"dtype": np.dtype(dtype).name, "style": style, "shape": "x".join(map(str, shape))}
        out = xp.empty_like(x)
        tables = _tables(positions, shape[-1], dtype, xp)
        yield Case("rotary", f"copy {name}", fn=lambda x=x, out=out: xp.copyto(out, x),
                   nbytes=2 * n, info=info)

        def plain_fwd(x=x, tables=tables, style=style):
            plain_rotary(x, tables, style, xp)

        def plain_step(x=x, dy=dy, tables=tables, style=style):
            plain_rotary(x, tables, style, xp)
            plain_rotary(dy, tables, style, xp, inverse=True)

        def lowbit_fwd(x=x, style=style):
            with _maybe(backend):
                lowbit.rotary(x, positions, theta=THETA, style=style)

        def lowbit_step(x=x, dy=dy, style=style):
            with _maybe(backend):
                _, ctx = lowbit.rotary_forward(x, positions, theta=THETA, style=style)
                lowbit.rotary_backward(dy, ctx)

        def check_plain(x=x, dy=dy, tables=tables, dtype=dtype, style=style):
            _check(x, dy, positions, plain_rotary(x, tables, style, xp),
                   plain_rotary(dy, tables, style, xp, inverse=True), dtype, style)

        def check_lowbit(x=x, dy=dy, dtype=dtype, style=style):
            with _maybe(backend):
                y, ctx = lowbit.rotary_forward(x, positions, theta=THETA, style=style)
                dx = lowbit.rotary_backward(dy, ctx)
            _check(x, dy, positions, y, dx, dtype, style)

        yield Case("rotary", f"forward plain {name}", fn=plain_fwd, check=check_plain,
                   nbytes=2 * n, info=info)
        yield Case("rotary", f"forward {label} {name}", fn=lowbit_fwd, check=check_lowbit,
                   baseline=f"forward plain {name}", nbytes=2 * n, info=info)
        yield Case("rotary", f"fwd+bwd plain {name}", fn=plain_step, nbytes=4 * n, info=info)
        yield Case("rotary", f"fwd+bwd {label} {name}", fn=lowbit_step,
                   baseline=f"fwd+bwd plain {name}", nbytes=4 * n, info=info)
