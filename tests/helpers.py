"""Shared test helpers: named float comparisons, central finite differences, the ``Backend`` the
``backend`` fixture of ``tests/conftest.py`` yields, and layer inputs.

Used by every ``tests/test_<op>.py`` (import from here, never from ``conftest``: the property
tests' folder has a conftest of its own).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowbit import _backend


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


def cosine(a, b):
    """Cosine similarity of two arrays (any backend), flattened, in float64."""
    a, b = to_numpy(a).ravel().astype(np.float64), to_numpy(b).ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


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


def lowrank_inputs(rng, B, T, D, H, N, dtype=np.float32):
    """``(current, encoder, encoder_v, decoder)`` of a low-rank residual layer: unit-variance
    input, 1/sqrt(fan-in) weights."""
    current = rng.standard_normal((B, T, D)).astype(dtype)
    encoder = (rng.standard_normal((H, D, N)) / np.sqrt(D)).astype(dtype)
    encoder_v = (rng.standard_normal((H, D, N)) / np.sqrt(D)).astype(dtype)
    decoder = (rng.standard_normal((H * N, D)) / np.sqrt(H * N)).astype(dtype)
    return current, encoder, encoder_v, decoder


@dataclasses.dataclass(frozen=True)
class Backend:
    """The backend under test (the ``backend`` fixture of ``conftest.py`` yields one), with its
    array module for moving test data."""

    name: str

    @property
    def xp(self):
        return _backend.cupy_module() if self.name == "cuda" else np

    def to(self, x):
        """Host array -> this backend's array kind (``None`` passes through)."""
        if x is None or self.name != "cuda":
            return x
        return self.xp.asarray(x)

    def __str__(self):
        return self.name
