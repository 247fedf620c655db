"""Suite ``generate``: BDH generation, one new byte after a context of L bytes, recurrent
against the full-context rerun.

The model is the main job's (``bench/train.py``'s ``MAIN`` shape: D = 128, H = 4, N = 512 per
head, 3 levels) under its low-bit plan (ternary weights, int8 activations), with random
parameters (the cost of a byte does not depend on what the model learnt). For each context
L in 256, 1024, 4096 (``--quick``: the ``QUICK`` shape at 32, 64, 128):

- ``full-context``: what ``bdh.generate(..., recurrent=False)`` does per byte, one
  ``bdh.logits`` over the last L bytes (the weights quantized again, every level's attention
  over the whole context) and the sampling of its last position;
- ``recurrent``: what ``bdh.generate`` does per byte after reading the prompt, one
  ``_recurrent.step`` (per level and head a [1, N] @ [N, D] product with the running state and
  its rank-one update) and the sampling; the model (weights quantized once) and the state of the
  L bytes (``prefill``) are made before the clock starts, as ``generate`` makes them once per
  call. A last row times it at the largest L against the first L: the aim is a ratio of 1
  (constant in the context), the target at least 1 / 1.5.

The ratio is bytes/s of the recurrent form over the full-context rerun's at the same L; the
target (at least 20x at L = 4096) applies to the largest context. Before timing, the recurrent
logits of position L are checked against the full forward's (``bdh.logits`` over L + 1 bytes),
to the int8 activation codes' rounding (2e-2 of the largest logit).

Op: ``lowbit/models/bdh/_recurrent.py``; tests ``tests/test_bdh_generate.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.models import bdh
from lowbit.models.bdh import _recurrent
from lowbit.models.bitnet._generate import sample

from . import _harness, train
from ._harness import Case, Config

CONTEXTS, QUICK_CONTEXTS = (256, 1024, 4096), (32, 64, 128)
#: Minimum speedup of the recurrent form at the largest context.
TARGET = 20.0
#: Most the recurrent step's time may grow from the first context to the largest.
FLAT = 1.5
#: Relative error of the recurrent logits allowed against the full forward's (int8 codes).
RTOL = 2e-2
#: Scale of the random parameters over the init's (ReLUs far from degenerate).
PARAM_SCALE = 25.0


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a, np.float64)


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _model(config: Config):
    run = train.shape(config)
    cfg = bdh.BDHConfig(**dict(train.model_config(run, train.PLAN).__dict__, dropout=0.0))
    xp = _harness.xp(config)
    params = {k: xp.asarray(v * PARAM_SCALE)
              for k, v in bdh.init_params(cfg, train.PARAM_SEED).items()}
    return cfg, params, xp


def cases(config: Config):
    cfg, params, xp = _model(config)
    backend = config.backend or ("cuda" if config.gpu else None)
    contexts = QUICK_CONTEXTS if config.quick else CONTEXTS
    rng = np.random.default_rng(0)
    data = rng.integers(32, 127, size=max(contexts) + 1)
    with _maybe(backend):
        model = _recurrent.Model(cfg, params)
    for L in contexts:
        ids = xp.asarray(data[None, :L])
        nxt = np.asarray(data[L:L + 1], np.int64)
        info = {"context": L, "plan": "ternary+int8", "shape": f"D={cfg.n_embd} H={cfg.n_head} "
                f"N={cfg.n_latent} levels={cfg.n_layer}"}
        draw = np.random.default_rng(1)

        def full(ids=ids):
            with _maybe(backend), _recurrent.blas_guard(params["embed"]):
                last = bdh.logits(cfg, params, ids)[0, -1]
            return sample(_host(last), 1.0, None, None, draw)

        with _maybe(backend), _recurrent.blas_guard(params["embed"]):
            state, _ = _recurrent.prefill(model, ids)
        # A copy kept at position L for the check (the timed calls advance ``state``).
        checked = _recurrent.State([[None if s is None else s.copy() for s in level]
                                    for level in state.kv], state.positions.copy())

        def recurrent(state=state, nxt=nxt):
            with _maybe(backend), _recurrent.blas_guard(params["embed"]):
                last = _recurrent.step(model, state, nxt)[0]
            return sample(_host(last), 1.0, None, None, draw)

        def check(ids=ids, nxt=nxt, checked=checked):
            with _maybe(backend), _recurrent.blas_guard(params["embed"]):
                ref = _host(bdh.logits(cfg, params, xp.concatenate(
                    [ids, xp.asarray(nxt[None])], axis=1))[0, -1])
                out = _host(_recurrent.step(model, checked, nxt)[0])
            err = np.abs(out - ref).max() / np.abs(ref).max()
            if not err <= RTOL:
                raise AssertionError(f"generate: recurrent logits at L={L} off the full "
                                     f"forward's by {err:.2e} (relative), above {RTOL:.0e}")

        yield Case("generate", f"full-context L={L}", fn=full, info=info)
        target = TARGET if L == CONTEXTS[-1] else None  # none on the quick contexts
        yield Case("generate", f"recurrent L={L}", fn=recurrent, check=check,
                   baseline=f"full-context L={L}", target=target, info=info)
        if L == contexts[-1]:
            # Constant in the context: the step at the largest L against the first L's.
            yield Case("generate", f"recurrent L={L} vs L={contexts[0]}", fn=recurrent,
                       baseline=f"recurrent L={contexts[0]}", target=1 / FLAT, info=info)

