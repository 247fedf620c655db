"""Suite ``cross_entropy``: forward + backward of the mean cross-entropy against plain NumPy.

Op: ``lowbit/ops/cross_entropy``; reference: ``reference/cross_entropy.py``. The baseline is the
textbook array implementation (log-softmax with the row max subtracted, a gather, then
``softmax - onehot``) on the same array module, timed in the same run. Bytes per call: the
forward reads the logits, the backward reads them and writes the gradient.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.reference.cross_entropy import cross_entropy_bwd_ref, cross_entropy_ref

from . import _harness
from ._harness import Case, Config

IGNORE = -100



def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def plain(xp, logits, targets):
    """Plain array cross-entropy: ``(loss, dlogits)`` for dloss = 1, ignore_index -100."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    counted = targets != IGNORE
    safe = xp.where(counted, targets, 0)
    picked = xp.take_along_axis(log_probs, safe[:, None], axis=-1)[:, 0]
    count = counted.sum()
    loss = -(picked * counted).sum() / count
    grad = xp.exp(log_probs)
    grad[xp.arange(logits.shape[0]), safe] -= 1
    grad *= (counted / count)[:, None].astype(logits.dtype)
    return loss, grad


def _problem(xp, rows, classes, seed=0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, classes)) * 2).astype(np.float32)
    targets = rng.integers(0, classes, rows)
    targets[rng.random(rows) < 0.1] = IGNORE
    return xp.asarray(logits), xp.asarray(targets)


def cases(config: Config):
    xp = _harness.xp(config)
    backend = config.backend or ("cuda" if config.gpu else None)
    shapes = [(1024, 256)] if config.quick else [(4096, 256), (256, 32768)]
    small_logits, small_targets = _problem(xp, 37, 101, seed=1)
    host_logits, host_targets = _host(small_logits), _host(small_targets)
    small_loss = cross_entropy_ref(host_logits, host_targets)
    small_grad = cross_entropy_bwd_ref(1.0, host_logits, host_targets)

    def step(logits, targets):
        with _maybe(backend):
            loss, ctx = lowbit.cross_entropy_forward(logits, targets)
            return loss, lowbit.cross_entropy_backward(1.0, ctx)

    def check(run, logits, targets):
        loss, grad = run(small_logits, small_targets)
        np.testing.assert_allclose(float(_host(loss)), small_loss, rtol=1e-5)
        np.testing.assert_allclose(_host(grad), small_grad, rtol=1e-4, atol=1e-9)
        loss, grad = run(logits, targets)
        ref_loss, ref_grad = plain(xp, logits.astype(np.float64), targets)
        np.testing.assert_allclose(float(_host(loss)), float(_host(ref_loss)), rtol=1e-5)
        np.testing.assert_allclose(_host(grad), _host(ref_grad), rtol=1e-4, atol=1e-9)

    for rows, classes in shapes:
        logits, targets = _problem(xp, rows, classes)
        info = {"shape": f"{rows}x{classes}", "dtype": "float32"}
        nbytes = 3 * logits.nbytes
        base = f"fwd+bwd {rows}x{classes} plain {'cupy' if config.gpu else 'numpy'}"
        yield Case("cross_entropy", base, fn=lambda x=logits, t=targets: plain(xp, x, t),
                   check=lambda x=logits, t=targets: check(lambda a, b: plain(xp, a, b), x, t),
                   nbytes=nbytes, info=info)
        for name in ([] if config.gpu else ["numpy"]) + [backend or "auto"]:
            def run(x, t, name=name):
                if name == "numpy":
                    with lowbit.use_backend("numpy"):
                        return step(x, t)
                return step(x, t)

            yield Case("cross_entropy", f"fwd+bwd {rows}x{classes} {name}",
                       fn=lambda x=logits, t=targets, run=run: run(x, t),
                       check=lambda x=logits, t=targets, run=run: check(run, x, t),
                       baseline=base, nbytes=nbytes, info=info)
