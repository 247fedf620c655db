"""Shared test helpers: named float comparisons and central finite differences.

Used by every ``tests/test_<op>.py``; the ``backend`` fixture lives in ``tests/conftest.py``.
"""

from __future__ import annotations

import numpy as np


def to_numpy(x):
    """A host numpy array from numpy or cupy input (``None`` passes through)."""
    if x is None or isinstance(x, np.ndarray):
        return x
    return x.get()


def assert_close(name, ref, out, rtol, atol=0.0):
    """Compare ``out`` with ``ref`` and fail with a message naming the tensor.

    Passes when the relative RMS error ``||out - ref|| / ||ref||`` is at most ``rtol`` and the
    largest absolute error is at most ``atol + rtol * max|ref|``. Shapes must agree exactly.
    """
    ref = np.asarray(to_numpy(ref), dtype=np.float64)
    out = np.asarray(to_numpy(out), dtype=np.float64)
    assert ref.shape == out.shape, f"{name}: shape {out.shape}, expected {ref.shape}"
    if ref.size == 0:
        return
    bad = np.count_nonzero(~np.isfinite(out))
    assert bad == 0, f"{name}: {bad} non-finite values"
    err = np.abs(out - ref)
    max_abs = float(err.max())
    norm = float(np.sqrt(np.mean(ref**2)))
    rms = float(np.sqrt(np.mean(err**2)))
    rel_rms = rms / norm if norm > 0 else rms
    bound = atol + rtol * float(np.abs(ref).max())
    assert rel_rms <= rtol and max_abs <= bound, (
        f"{name}: max abs error {max_abs:.3e} (bound {bound:.3e}), "
        f"relative RMS error {rel_rms:.3e} (rtol {rtol:.1e})"
    )


def assert_equal(name, ref, out):
    """Exact comparison (integer codes, packed bytes, bitwise determinism)."""
    ref = to_numpy(ref)
    out = to_numpy(out)
    assert ref.shape == out.shape, f"{name}: shape {out.shape}, expected {ref.shape}"
    assert ref.dtype == out.dtype, f"{name}: dtype {out.dtype}, expected {ref.dtype}"
    mismatch = ~((ref == out) | (np.isnan(ref) & np.isnan(out)) if ref.dtype.kind == "f" else
                 (ref == out))
    assert not mismatch.any(), (
        f"{name}: {int(mismatch.sum())} of {ref.size} elements differ; first at "
        f"{np.unravel_index(int(np.flatnonzero(mismatch)[0]), ref.shape)}"
    )


def numerical_grad(f, x, eps=1e-6):
    """Central finite differences of the scalar ``f()`` with respect to float64 array ``x``.

    ``x`` is perturbed in place and restored; ``f`` must read it on every call.
    """
    grad = np.zeros_like(x, dtype=np.float64)
    flat = x.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        plus = f()
        flat[i] = keep - eps
        minus = f()
        flat[i] = keep
        grad.reshape(-1)[i] = (plus - minus) / (2 * eps)
    return grad
