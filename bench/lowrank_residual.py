"""Suite ``lowrank_residual``: the BDH layer's saved-activation policy table (``python -m bench
lowrank_residual``; the main job trains the whole model instead, ``bench/train.py``).

The model BDH trains: one low-rank residual layer applied 4 times with shared weights
(B = 2, T = 256, D = 256, H = 4, N = 1024; ternary weights and int8 activations on every
projection; ``relu_threshold`` calibrated so that about 5% of the neurons are active), forward
through all 4 applications then backward through all 4 (weight gradients summed in place with
``accumulate=``). One row per saved-activation policy: saved bytes and their ratio against fp32,
the peak memory measured during the step, the gradient cosine against fp32 (minimum over the
three weights), and the step time against the fp32 step's.

Peak memory: on CPU ``tracemalloc``'s peak over the step, i.e. every buffer allocated during it
(activations, saved tensors, temporaries, the input gradients); the weights and the weight
gradient buffers are training state allocated once before the steps (the step zeroes the
gradient buffers and accumulates into them), so they are not part of it. On GPU: the largest
``used_bytes`` of CuPy's memory pool at the end of any stage (``lowbit.profile``). Before the
measured steps a warm-up runs every policy on a tiny layer and one full fp32 step, so that no
measured step pays for JIT compilation or first-use caches.

Block patterns: the same step with exact saved tensors and 100%, 50% and 25% of the latent
blocks active (``PATTERN_BLOCK`` neurons each, spread evenly), timed against the dense step in
alternation (``Case.paired``: the ratio is the median over dense/patterned pairs, so that a
drift in the host's speed does not flip the verdict), with the saved bytes against dense
(targets ``PATTERN_TARGETS``). At 25% a head has D active neurons, so its attention output is
recomputed in the backward instead of saved (``lowbit/ops/lowrank_residual/_layer.py``,
``keeps_attention``); the step time includes that.

Op: ``lowbit/ops/lowrank_residual``; reference: ``reference/lowrank_residual.py``.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

import lowbit
from lowbit.reference.lowrank_residual import (block_mask_ref, lowrank_residual_bwd_ref,
                                               lowrank_residual_ref)

from . import _harness
from ._harness import Case, Config

POLICIES = ("fp32", "int8", "int4", "int2", "sparse")
#: Fraction of neurons the calibrated threshold keeps active (a trained BDH's density).
TARGET_DENSITY = 0.05
APPLICATIONS = 4


def shape(config: Config) -> dict:
    """B, T, D, H, N of the run (``--quick``: a CI-sized layer)."""
    if config.quick:
        return dict(B=1, T=64, D=64, H=2, N=256)
    return dict(B=2, T=256, D=256, H=4, N=1024)


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _cosine(a, b):
    a, b = _host(a).ravel().astype(np.float64), _host(b).ravel().astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def _backend(config):
    backend = config.backend or ("cuda" if config.gpu else None)
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _plan():
    return lowbit.LowBitPlan.uniform("ternary", "int8")


def calibrate_threshold(current, encoder, plan, density=TARGET_DENSITY):
    """The threshold that leaves ``density`` of the x-projection pre-activations above it.

    Computed on the quantized projection of the first application's input (the later
    applications' inputs are layer-normalized rows with the same statistics).
    """
    from lowbit.ops.quantize import fake_quantize_activation, fake_quantize_weight

    weight, act = plan.x
    x = fake_quantize_activation(current, act) if act else current
    pre = [_host(x @ (fake_quantize_weight(encoder[h], weight) if weight else encoder[h]))
           for h in range(encoder.shape[0])]
    return float(np.quantile(np.stack(pre), 1.0 - density))


def _check_small(config, pattern=None):
    """The quantized layer against the float64 reference on a small shape (before any timing),
    with a block pattern of the latent neurons if one is given."""
    rng = np.random.default_rng(1)
    B, T, D, H, N = 1, 16, 16, 2, 32
    xp = _harness.xp(config)
    current = rng.standard_normal((B, T, D)).astype(np.float32)
    encoder = (rng.standard_normal((H, D, N)) / np.sqrt(D)).astype(np.float32)
    encoder_v = (rng.standard_normal((H, D, N)) / np.sqrt(D)).astype(np.float32)
    decoder = (rng.standard_normal((H * N, D)) / np.sqrt(H * N)).astype(np.float32)
    dnext = rng.standard_normal((B, T, D)).astype(np.float32)
    kwargs = dict(plan=_plan(), relu_threshold=0.3)
    mask = None if pattern is None else block_mask_ref(pattern.block_size, pattern.active, H, N)
    with _backend(config):
        out, ctx = lowbit.lowrank_residual_forward(
            *(xp.asarray(a) for a in (current, encoder, encoder_v, decoder)),
            latent_pattern=pattern, **kwargs)
        grads = lowbit.lowrank_residual_backward(xp.asarray(dnext), ctx)
    ref = lowrank_residual_ref(current, encoder, encoder_v, decoder, latent_mask=mask, **kwargs)
    ref_grads = lowrank_residual_bwd_ref(dnext, current, encoder, encoder_v, decoder,
                                         latent_mask=mask, **kwargs)
    for name, r, g in zip(("next", "dcurrent", "dencoder", "dencoder_v", "ddecoder"),
                          (ref, *ref_grads), (out, *grads)):
        err = np.linalg.norm(_host(g) - r) / np.linalg.norm(r)
        if not err < 1e-3:
            raise AssertionError(f"lowrank_residual {name}: relative error {err:.2e} vs reference")


def run_step(inputs, saved, plan, threshold, config, pattern=None, measure=True):
    """One training step (4 applications forward, then backward) under one saved policy (and a
    block pattern of the latent neurons, if any).

    ``measure``: record the peak memory (``lowbit.profile``: on CPU ``tracemalloc``, which slows
    every allocation, so the timed steps run without it and the checks measure).

    Returns a dict: grads (dcurrent, dencoder, dencoder_v, ddecoder), saved and dense bytes,
    peak bytes (None unless ``measure``), seconds.
    """
    current, encoder, encoder_v, decoder, dnext = inputs
    xp = _harness.xp(config)
    # Gradient buffers are parameter-sized training state, allocated once like the weights
    # (not per step); the step zeroes them and accumulates into them.
    grads = tuple(xp.empty(w.shape, np.float32) for w in (encoder, encoder_v, decoder))
    with _backend(config), (lowbit.profile() if measure else contextlib.nullcontext()) as prof:
        start = time.perf_counter()
        x, ctxs = current, []
        # Quantized once a step, as BDH does: the applications share the weights.
        packed = lowbit.quantize_layer_weights(encoder, encoder_v, decoder, plan)
        for _ in range(APPLICATIONS):
            x, ctx = lowbit.lowrank_residual_forward(x, encoder, encoder_v, decoder, plan=plan,
                                                     saved=saved, relu_threshold=threshold,
                                                     latent_pattern=pattern, packed=packed)
            ctxs.append(ctx)
        # The byte accounting walks every ctx (0.7 ms a step): bench bookkeeping, off the clock
        # (on a GPU after a sync, so that no queued kernel runs while the clock is paused).
        if config.gpu:
            xp.cuda.Device().synchronize()
        paused = time.perf_counter()
        nbytes = sum(c.nbytes for c in ctxs)
        dense = sum(c.dense_nbytes for c in ctxs)
        start += time.perf_counter() - paused
        del x, ctx
        for buffer in grads:
            buffer.fill(0)
        g = dnext
        while ctxs:
            g, *_ = lowbit.lowrank_residual_backward(g, ctxs.pop(), accumulate=grads)
        if config.gpu:
            xp.cuda.Device().synchronize()
        seconds = time.perf_counter() - start
    return dict(grads=(g, *grads), nbytes=nbytes, dense=dense,
                peak=prof.peak_bytes if measure else None,
                seconds=seconds)


def _warm_up(plan, config):
    """One small step per policy, so that no measured step pays for JIT compilation (whose
    Python objects tracemalloc would count) or kernel loading. Big enough (B*H*T*N above 2**18)
    that the kernels take the same multi-threaded paths as the measured step."""
    rng = np.random.default_rng(2)
    B, T, D, H, N = 1, 256, 32, 2, 1024
    xp = _harness.xp(config)
    inputs = tuple(xp.asarray(rng.standard_normal(s).astype(np.float32))
                   for s in ((B, T, D), (H, D, N), (H, D, N), (H * N, D), (B, T, D)))
    for policy in POLICIES:
        run_step(inputs, policy, plan, 0.5, config)


def cases(config: Config):
    """One timed case per policy: a full step (4 applications forward, then backward).

    Nothing runs until the harness checks the first case (``pytest bench`` only collects them).
    Each case's check runs one measured step and fills its row with the policy-table columns;
    the first check also compares the layer with the float64 reference on a small shape.
    """
    state = {}

    def setup():
        if not state:
            dims = shape(config)
            B, T, D, H, N = (dims[k] for k in "BTDHN")
            xp = _harness.xp(config)
            rng = np.random.default_rng(0)
            state["inputs"] = tuple(xp.asarray(a) for a in (
                rng.standard_normal((B, T, D)).astype(np.float32),
                (rng.standard_normal((H, D, N)) / np.sqrt(D)).astype(np.float32),
                (rng.standard_normal((H, D, N)) / np.sqrt(D)).astype(np.float32),
                (rng.standard_normal((H * N, D)) / np.sqrt(H * N)).astype(np.float32),
                rng.standard_normal((B, T, D)).astype(np.float32)))
            state["plan"] = _plan()
            with _backend(config):
                state["threshold"] = calibrate_threshold(state["inputs"][0], state["inputs"][1],
                                                         state["plan"])
            _warm_up(state["plan"], config)
            state["fp32"] = run_step(state["inputs"], "fp32", state["plan"], state["threshold"],
                                     config)
        return state

    for policy in POLICIES:
        info = {"policy": policy}

        def check(policy=policy, info=info):
            st = setup()
            if policy == POLICIES[0]:
                _check_small(config)
            r = run_step(st["inputs"], policy, st["plan"], st["threshold"], config)
            fp = st["fp32"]
            info.update({
                "saved MiB": r["nbytes"] / 2**20,
                "bytes vs fp32": r["nbytes"] / fp["nbytes"],
                "peak MiB": r["peak"] / 2**20,
                "min weight-grad cos": min(_cosine(a, b)
                                           for a, b in zip(fp["grads"][1:], r["grads"][1:])),
            })

        def step(policy=policy):
            st = setup()
            run_step(st["inputs"], policy, st["plan"], st["threshold"], config, measure=False)

        yield Case("lowrank_residual", f"step {policy}", fn=step, check=check,
                   baseline=None if policy == "fp32" else "step fp32", info=info)
    yield from _pattern_cases(config, setup)


#: Active fractions of the block-pattern rows, blocks of PATTERN_BLOCK neurons spread
#: evenly over the latent axis; targets: the step time and saved bytes against dense.
PATTERN_FRACTIONS = (1.0, 0.5, 0.25)
PATTERN_BLOCK = 64
PATTERN_TARGETS = {0.5: (1.6, None), 0.25: (2.5, 0.30)}


def block_pattern(N, fraction):
    """Every ``1 / fraction``-th block of PATTERN_BLOCK neurons active (None: all)."""
    if fraction == 1.0:
        return None
    blocks = -(-N // PATTERN_BLOCK)
    return lowbit.BlockPattern(PATTERN_BLOCK, np.arange(blocks) % round(1 / fraction) == 0)


def _pattern_cases(config, setup):
    """One timed step per active fraction, exact saved tensors (the latent ones are what a
    pattern removes), against the dense step; the check records saved bytes and the result."""
    N = shape(config)["N"]
    dense_name = "pattern 100% active"
    dense = {}

    for fraction in PATTERN_FRACTIONS:
        name = f"pattern {round(fraction * 100)}% active"
        info = {"policy": "exact", "active": fraction}

        def check(fraction=fraction, info=info):
            st = setup()
            r = run_step(st["inputs"], None, st["plan"], st["threshold"], config,
                         block_pattern(N, fraction))
            if fraction == 1.0:
                dense.update(r)
            info.update({"saved MiB": r["nbytes"] / 2**20,
                         "bytes vs dense": r["nbytes"] / dense["nbytes"],
                         "peak MiB": r["peak"] / 2**20})
            bound = PATTERN_TARGETS.get(fraction, (None, None))[1]
            if bound is not None:
                info.update({"bytes target": bound,
                             "bytes met": r["nbytes"] / dense["nbytes"] <= bound})
            if fraction < 1.0:  # the pattern's layer against the reference, small shape
                _check_small(config, lowbit.BlockPattern(8, np.arange(4) % round(1 / fraction)
                                                         == 0))

        def step(fraction=fraction):
            st = setup()
            run_step(st["inputs"], None, st["plan"], st["threshold"], config,
                     block_pattern(N, fraction), measure=False)

        yield Case("lowrank_residual", name, fn=step, check=check,
                   baseline=None if fraction == 1.0 else dense_name, paired=fraction < 1.0,
                   target=PATTERN_TARGETS.get(fraction, (None, None))[0], info=info)
