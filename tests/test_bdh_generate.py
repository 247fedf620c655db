"""Recurrent generation of the BDH model (``lowbit/models/bdh/_recurrent.py``): the recurrent
logits against the full forward (``bdh.logits``) on every backend, past one block of the
attention's chunks, and against the float64 reference; greedy and sampled generation against
the full-context rerun; ``top_p``, stop bytes, several prompts, the stream; bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, to_numpy

import lowbit
from lowbit.models import bdh
from lowbit.models.bdh import _recurrent
from lowbit.reference.bdh import bdh_ref
from lowbit.reference.lowrank_residual import block_mask_ref

#: N = 128 per head; T = 140 crosses the chunks of every backend's full forward (numpy 64,
#: numba 128, the CUDA kernel's 32-key tiles).
SMALL = dict(n_layer=2, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, vocab_size=256,
             dropout=0.0)
T = 140
PATTERN = lowbit.BlockPattern(16, np.array([[1, 0, 0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0, 1, 1]],
                                           bool))
CASES = {
    "fp32": (lowbit.LowBitPlan(), None),
    "ternary": (lowbit.LowBitPlan.uniform("ternary", None), None),
    "fp32-pattern": (lowbit.LowBitPlan(), PATTERN),
    "ternary-int8-pattern": (lowbit.LowBitPlan.uniform("ternary", "int8"), PATTERN),
}


def _params(config, seed=3):
    # Larger than the init (std 0.02): ReLUs and attention far from degenerate on a tiny model.
    return {k: (v / bdh.INIT_STD * 0.5).astype(np.float32)
            for k, v in bdh.init_params(config, seed).items()}


def _compare(name, ref, out, act_quantized):
    ref, out = to_numpy(ref), to_numpy(out)
    if not act_quantized:
        assert_close(name, ref, out, 2e-5)
        return
    # Per-token int8 activation codes: the state sums the products in another order than the
    # full forward's chunks, so a code that lies on a rounding boundary may round the other way
    # (one step of 1/127 of its row's absmax), which moves that position and, through the later
    # levels' states, the next ones slightly. Most positions still agree to float32 rounding.
    assert_close(name, ref, out, 2e-2)
    per_pos = np.abs(out - ref).max(axis=-1) / np.abs(ref).max()
    assert np.mean(per_pos <= 2e-5) >= 0.75, np.sort(per_pos)[-10:]


#: (backend, case) pairs: cudasim only with the cases that add a pattern (its weight-only
#: ternary products are the slowest thing it emulates, ~20 s a forward here).
PAIRS = ([pytest.param(b, c, marks=[pytest.mark.gpu] if b == "cuda" else [])
          for b in ("numpy", "numba", "cuda") for c in CASES]
         + [("cudasim", "fp32-pattern"), ("cudasim", "ternary-int8-pattern")])


@pytest.mark.parametrize("backend,case", PAIRS, indirect=["backend"])
def test_recurrent_logits_equal_the_full_forward(backend, rng, case):
    plan, pattern = CASES[case]
    config = bdh.BDHConfig(**SMALL, plan=plan, latent_pattern=pattern)
    params = {k: backend.to(v) for k, v in _params(config).items()}
    # cudasim runs every kernel launch slowly: one row of 34 positions (past the CUDA kernel's
    # 32-key tiles), read by the prefill pass but for the last two, which are recurrent steps.
    B, length, prefill = (1, 34, 32) if backend.name == "cudasim" else (2, T, 0)
    ids = backend.to(rng.integers(0, 256, size=(B, length)))
    full = bdh.logits(config, params, ids)
    rec = bdh.recurrent_logits(config, params, ids, prefill=prefill)
    assert rec.shape == full.shape and rec.dtype == np.float32
    _compare(case, full, rec, plan.y[1] is not None)


def test_prefill_then_steps_equal_the_full_forward(rng):
    plan, pattern = CASES["ternary-int8-pattern"]
    config = bdh.BDHConfig(**SMALL, plan=plan, latent_pattern=pattern)
    params = _params(config)
    ids = rng.integers(0, 256, size=(2, T))
    full = bdh.logits(config, params, ids)
    _compare("prefill 100", full, bdh.recurrent_logits(config, params, ids, prefill=100), True)
    assert_close("prefill T", full, bdh.recurrent_logits(config, params, ids, prefill=T), 1e-6)


@pytest.mark.parametrize("case", ["fp32", "fp32-pattern"])
def test_recurrent_logits_match_the_float64_reference(rng, case):
    plan, pattern = CASES[case]
    config = bdh.BDHConfig(**SMALL, plan=plan, latent_pattern=pattern)
    params = _params(config)
    ids = rng.integers(0, 256, size=(1, 20))
    mask = (None if pattern is None else
            block_mask_ref(16, pattern.active, config.n_head, config.n_latent))
    _, cache = bdh_ref(params, ids, ids, level_seeds=[0] * config.n_layer, plan=plan,
                       latent_mask=mask, return_cache=True)
    rec = bdh.recurrent_logits(config, params, ids)
    assert_close("logits", cache["logits"].reshape(1, 20, -1), rec, 1e-4)


def test_weights_are_quantized_once_per_call(monkeypatch):
    config = bdh.BDHConfig(**SMALL, plan=CASES["ternary-int8-pattern"][0])
    params = _params(config)
    calls = []
    real = _recurrent.quantize_layer_weights
    monkeypatch.setattr(_recurrent, "quantize_layer_weights",
                        lambda *a: calls.append(1) or real(*a))
    out = bdh.generate(config, params, [b"ab", b"cde"], 10, temperature=0)
    assert len(calls) == 1 and [len(o) for o in out] == [10, 10]


@pytest.mark.parametrize("case", ["fp32", "ternary-int8-pattern"])
def test_greedy_generation_is_the_full_context_generation(case):
    plan, pattern = CASES[case]
    config = bdh.BDHConfig(**SMALL, plan=plan, latent_pattern=pattern)
    params = _params(config)
    prompts = [b"The quick brown fox", b"x"]
    rec = bdh.generate(config, params, prompts, 30, temperature=0)
    full = bdh.generate(config, params, prompts, 30, temperature=0, recurrent=False)
    assert rec == full and [len(r) for r in rec] == [30, 30]
    # Several prompts decode together as each alone (greedy draws no random numbers).
    assert rec == [bdh.generate(config, params, p, 30, temperature=0) for p in prompts]


def test_sampling_is_seeded_and_agrees_with_the_full_context():
    config = bdh.BDHConfig(**SMALL)
    params = _params(config)
    kw = dict(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    a = bdh.generate(config, params, [b"Hello", b"abc"], 25, **kw)
    assert a == bdh.generate(config, params, [b"Hello", b"abc"], 25, **kw)
    assert a == bdh.generate(config, params, [b"Hello", b"abc"], 25, recurrent=False, **kw)
    assert a != bdh.generate(config, params, [b"Hello", b"abc"], 25, **dict(kw, seed=8))


def test_top_p_keeps_the_smallest_likely_set():
    config = bdh.BDHConfig(**SMALL)
    params = _params(config)
    greedy = bdh.generate(config, params, b"Hello", 20, temperature=0)
    # A tiny top_p keeps only the most likely byte: greedy whatever the seed.
    assert bdh.generate(config, params, b"Hello", 20, top_p=1e-9, seed=5) == greedy
    full = bdh.generate(config, params, b"Hello", 20, seed=5)
    assert bdh.generate(config, params, b"Hello", 20, top_p=1.0, seed=5) == full
    assert bdh.generate(config, params, b"Hello", 20, top_p=0.3, seed=5) != full


def test_stop_bytes_end_a_sequence_and_the_stream_yields_bytes():
    config = bdh.BDHConfig(**SMALL)
    params = _params(config)
    greedy = bdh.generate(config, params, b"Hello", 30, temperature=0)
    k = 7
    stop = greedy[k:k + 1]
    cut = greedy.index(stop)
    assert bdh.generate(config, params, b"Hello", 30, temperature=0, stop=stop) == greedy[:cut]
    two = [greedy[k], greedy[3]]  # an iterable of ints: the first of either ends it
    cut_two = min(greedy.index(bytes((b,))) for b in two)
    assert bdh.generate(config, params, b"Hello", 30, temperature=0, stop=two) == greedy[:cut_two]
    steps = list(bdh.generate_stream(config, params, b"Hello", 30, temperature=0))
    assert all(isinstance(s, bytes) and len(s) == 1 for s in steps) and b"".join(steps) == greedy
    # Several prompts: a stopped sequence yields b"" while the other goes on; the continuing
    # row (the state compacted past the stopped one) still gives its own greedy bytes.
    other = bdh.generate(config, params, b"zz", 30, temperature=0, stop=stop)
    both = list(bdh.generate_stream(config, params, [b"Hello", b"zz"], 30, temperature=0,
                                    stop=stop))
    assert all(isinstance(s, tuple) and len(s) == 2 for s in both)
    assert b"".join(s[0] for s in both) == greedy[:cut]
    assert b"".join(s[1] for s in both) == other
    assert len(both) == min(30, max(cut, len(other)) + 1)
    assert list(bdh.generate_stream(config, params, b"Hello", 0)) == []


@pytest.mark.parametrize("kwargs,error,word", [
    (dict(prompt="text"), TypeError, "prompt"),
    (dict(prompt=b""), TypeError, "prompt"),
    (dict(prompt=[]), TypeError, "prompt"),
    (dict(prompt=[b"a", 3]), TypeError, r"prompt\[1\]"),
    (dict(n=-1), ValueError, "n"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(stop=[256]), ValueError, "stop"),
    (dict(stop="a"), TypeError, "stop"),
    (dict(stop=object()), TypeError, "stop"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(recurrent="yes"), TypeError, "recurrent"),
    (dict(context=0, recurrent=False), ValueError, "context"),
    (dict(context=8), ValueError, "context"),
])
def test_bad_generate_arguments_name_the_argument(never_runs, kwargs, error, word):
    config = bdh.BDHConfig(**SMALL)
    params = _params(config)
    args = dict(dict(prompt=b"ab", n=3), **kwargs)
    with pytest.raises(error, match=word):
        bdh.generate_stream(config, params, args.pop("prompt"), args.pop("n"), **args)
    with pytest.raises(error, match=word):
        bdh.generate(config, params, dict(dict(prompt=b"ab"), **kwargs)["prompt"],
                     dict(dict(n=3), **kwargs)["n"],
                     **{k: v for k, v in kwargs.items() if k not in ("prompt", "n")})


def test_bad_recurrent_logits_arguments(never_runs, rng):
    config = bdh.BDHConfig(**SMALL)
    params = _params(config)
    ids = rng.integers(0, 256, size=(1, 5))
    with pytest.raises(ValueError, match="prefill"):
        bdh.recurrent_logits(config, params, ids, prefill=6)
    with pytest.raises(ValueError, match="prefill"):
        bdh.recurrent_logits(config, params, ids, prefill=-1)
    with pytest.raises(ValueError, match="ids"):
        bdh.recurrent_logits(config, params, ids[0])
    with pytest.raises(ValueError, match="vocab_size"):
        bdh.generate(bdh.BDHConfig(**dict(SMALL, vocab_size=16)),
                     _params(bdh.BDHConfig(**dict(SMALL, vocab_size=16))), b"\xff", 2)
