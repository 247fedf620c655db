"""Suite ``adamw``: one AdamW step over ~4 M float32 parameters against a vectorized AdamW.

Op: ``lowbit/ops/adamw``; reference: ``reference/adamw.py``. The baseline is AdamW written
plainly in whole-array NumPy (CuPy on GPU) operations, timed on the same parameters. GB/s counts
the bytes a step must move (read p, g, m, v and write p, m, v: 28 B per float32 parameter, plus
4 B for the gradient-norm and finiteness pass that precedes any write) against a plain copy
measured in the same run.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

import lowbit
from lowbit import _backend
from lowbit.reference.adamw import adamw_ref

from . import _harness
from ._harness import Case, Config

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
#: Bytes per float32 parameter of one lowbit step (see the module docstring).
BYTES_PER_PARAM = 32
#: The baseline has no norm pass; it is credited the 28 B a step must move, so its GB/s says how
#: far its many whole-array passes are from that minimum.
BASELINE_BYTES_PER_PARAM = 28



def _shapes(quick):
    # A layer's worth of matrices and vectors: ~4.2 M parameters (quick: ~0.26 M).
    d = 256 if quick else 1024
    return {"attn.w": (d, 2 * d), "mlp.w": (2 * d, d), "norm.g": (d,), "mlp.b": (d + 3,)}


def vectorized_adamw(params, grads, state, lr, betas, eps, weight_decay):
    """The baseline: AdamW as a plain whole-array NumPy/CuPy program, in place."""
    beta1, beta2 = betas
    xp = _backend.array_module(*params.values())
    state["step"] += 1
    bias1 = 1.0 - beta1 ** state["step"]
    bias2 = 1.0 - beta2 ** state["step"]
    for k, p in params.items():
        g, m, v = grads[k], state["m"][k], state["v"][k]
        p *= 1.0 - lr * weight_decay
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * g * g
        p -= (lr / bias1) * m / (xp.sqrt(v) / math.sqrt(bias2) + eps)


def _fresh_state(params, xp):
    return {"step": 0, "m": {k: xp.zeros_like(p) for k, p in params.items()},
            "v": {k: xp.zeros_like(p) for k, p in params.items()}}


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _check(run, xp, max_grad_norm):
    """Three steps of ``run`` on small odd shapes against the float64 reference."""
    rng = np.random.default_rng(1)
    shapes = {"a": (37,), "b": (3, 301)}
    params0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params = {k: xp.asarray(v.copy()) for k, v in params0.items()}
    ref, ref_state = {k: v.astype(np.float64) for k, v in params0.items()}, None
    stepper = run()
    for _ in range(3):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        stepper(params, {k: xp.asarray(g) for k, g in grads.items()})
        ref, ref_state, _ = adamw_ref(ref, grads, ref_state, max_grad_norm=max_grad_norm,
                                      **HYPER)
    for k in shapes:
        np.testing.assert_allclose(_host(params[k]), ref[k], rtol=0, atol=1e-5)


def cases(config: Config):
    xp = _harness.xp(config)
    backend = config.backend or ("cuda" if config.gpu else None)
    rng = np.random.default_rng(0)
    shapes = _shapes(config.quick)
    n = sum(math.prod(s) for s in shapes.values())
    params = {k: xp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    grads = {k: xp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    info = {"params": n}

    src = xp.asarray(rng.standard_normal(n).astype(np.float32))
    dst = xp.empty_like(src)
    yield Case("adamw", "copy", fn=lambda: xp.copyto(dst, src), nbytes=2 * 4 * n, info=info)

    base_name = f"vectorized {xp.__name__}"
    base_params = {k: p.copy() for k, p in params.items()}
    base_state = _fresh_state(base_params, xp)

    def base_stepper():
        state = None

        def stepper(p, g):
            nonlocal state
            state = state or _fresh_state(p, xp)
            vectorized_adamw(p, g, state, **HYPER)
        return stepper

    yield Case("adamw", base_name,
               fn=lambda: vectorized_adamw(base_params, grads, base_state, **HYPER),
               check=lambda: _check(base_stepper, xp, None),
               nbytes=BASELINE_BYTES_PER_PARAM * n, info=info)

    runs = [(backend or "auto", backend)]
    if not config.gpu and backend is None:
        runs.append(("numpy backend", "numpy"))
    for label, forced in runs:
        for clip in (None, 1.0):
            opt = lowbit.AdamW(max_grad_norm=clip, **HYPER)
            mine = {k: p.copy() for k, p in params.items()}

            def fn(opt=opt, mine=mine, forced=forced):
                with _maybe(forced):
                    opt.step(mine, grads)

            def lowbit_stepper(clip=clip, forced=forced):
                small = lowbit.AdamW(max_grad_norm=clip, **HYPER)

                def stepper(p, g):
                    with _maybe(forced):
                        small.step(p, g)
                return stepper

            name = f"lowbit {label}" + (" clip" if clip else "")
            yield Case("adamw", name, fn=fn, check=lambda s=lowbit_stepper, c=clip:
                       _check(s, xp, c),
                       baseline=base_name, nbytes=BYTES_PER_PARAM * n,
                       info={**info, "max_grad_norm": clip})
