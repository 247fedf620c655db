"""No argument of a public op is accepted and ignored.

Every option (a parameter with a default) of every public function of ``lowbit.ops`` and of the
option classes ``AdamW``, ``SavedConfig`` and ``LowBitPlan`` has a case below: the call with the
option at a non-default value either gives another result than the call without it, or raises
``ValueError`` naming the option (where the option has no effect). A coverage test fails when an
option is added without a case.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from helpers import lowrank_inputs

import lowbit
from lowbit.ops.saved_activation import save

RNG_SEED = 28


def _rng():
    return np.random.default_rng(RNG_SEED)


def _f(*shape, scale=1.0, seed=0):
    return (scale * np.random.default_rng(RNG_SEED + seed).standard_normal(shape)).astype(
        np.float32)


def _flat(obj):
    """What a call gave, as a list of comparable values (ctxs by their saved tensors)."""
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [v for item in obj for v in _flat(item)]
    if isinstance(obj, dict):
        return [v for key in sorted(obj) for v in _flat(obj[key])]
    if obj is None or isinstance(obj, (int, float, str)):
        return [obj]
    if isinstance(obj, lowbit.PackedWeight):
        return [obj.format, obj.data, obj.scale]
    if isinstance(obj, lowbit.QuantizedActivation):
        return [obj.codes, obj.scale]
    if isinstance(obj, lowbit.PackedActivation):
        return [obj.format, obj.kind, obj.unpack(), *obj.arrays.values()]
    if dataclasses.is_dataclass(obj):  # a ctx: its saved tensors and what they hold
        return [str(lowbit.memory_report(obj))] + [
            v for f in dataclasses.fields(obj)
            for v in _flat(getattr(obj, f.name).unpack() if hasattr(getattr(obj, f.name), "unpack")
                           else None)]
    raise TypeError(f"cannot compare {type(obj).__name__}")


def _differs(a, b):
    a, b = _flat(a), _flat(b)
    if len(a) != len(b):
        return True
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
                    and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)):
                return True
        elif x != y:
            return True
    return False


# -- the calls ------------------------------------------------------------------------------------

def _adamw(**options):
    params = {"w": np.linspace(-1.0, 1.0, 6).astype(np.float32)}
    opt = lowbit.AdamW(**options)
    for step in range(3):  # betas act from the second step on (bias correction)
        opt.step(params, {"w": _f(6, scale=step + 1.0, seed=step)})
    return params


def _ce(fn, **options):
    return fn(_f(5, 4), np.array([0, 3, 1, 1, 2]), **options)


def _ln(fn, **options):
    return fn(_f(3, 6, scale=0.1), **options)


def _rms(fn, **options):
    return fn(_f(3, 6, scale=0.1), _f(6, seed=1), **options)


def _rot(fn, **options):
    return fn(_f(3, 2, 6), np.array([5, 0, 9]), **options)


def _gdr(fn, **options):
    q, k, v = (_f(1, 5, 2, 3, scale=0.5, seed=i) for i in range(3))
    return fn(q, k, v, -np.abs(_f(1, 5, 2, scale=0.3)), np.abs(_f(1, 5, 2, seed=4)) / 4,
              **options)


def _ssm(fn, **options):
    return fn(_f(1, 5, 2, 3), _f(1, 5, 2, 2, seed=1), _f(1, 5, 2, 2, seed=2), _f(1, 5, 2, seed=3),
              *(_f(2, scale=0.5, seed=4 + i) for i in range(3)), **options)


def _att(fn, **options):
    return fn(*(_f(5, 2, 4, seed=i) for i in range(3)), [2, 3], **options)


def _layer(fn, **options):
    return fn(*lowrank_inputs(_rng(), 1, 5, 4, 2, 6), **options)


def _lr_backward(**options):
    _, ctx = _layer(lowbit.lowrank_residual_forward)
    return lowbit.lowrank_residual_backward(_f(1, 5, 4), ctx, **options)


def _pw():
    return lowbit.quantize_weight(_f(8, 3), "int8")


def _linear(**options):
    return lowbit.linear_forward(_f(4, 8), _f(8, 3, seed=1), "ternary", **options)


def _linear_backward(**options):
    y, ctx = lowbit.linear_forward(_f(4, 8), _f(8, 3, seed=1), "ternary", "int8")
    return lowbit.linear_backward(_f(*y.shape, seed=2), ctx, **options)


def _pack(**options):
    return lowbit.pack_activation(np.abs(_f(3, 40)) + 0.5, "int8", **options)


def _other_packed():
    """Quantized forms of other weights than ``_layer``'s, under ``TERNARY``."""
    weights = lowrank_inputs(np.random.default_rng(1), 1, 5, 4, 2, 6)[1:]
    return lowbit.quantize_layer_weights(*weights, TERNARY)


TERNARY = lowbit.LowBitPlan.uniform("ternary", "int8")
PATTERN = lowbit.BlockPattern(2, np.array([True, False, True]))
LAYER_OPTIONS = {  # option -> (non-default value, the other options it needs, or None)
    "attention": ("segmented", {}), "lengths": ([2, 3], {}), "plan": (TERNARY, {}),
    "relu_threshold": (0.3, {}), "dropout": (0.5, {}), "seed": (3, {"dropout": 0.5}),
    "row_offset": (1, {"dropout": 0.5}), "packed": (None, {"plan": TERNARY}),
    "latent_pattern": (PATTERN, {}),
}


def _layer_cases(fn, saved):
    cases = {}
    for option, (value, needs) in LAYER_OPTIONS.items():
        if option == "packed":  # other weights' packed forms: the product takes them
            cases[option] = (lambda: _layer(fn, plan=TERNARY),
                             lambda: _layer(fn, plan=TERNARY, packed=_other_packed()))
            continue
        cases[option] = (lambda needs=needs: _layer(fn, **needs),
                         lambda o=option, v=value, needs=needs: _layer(fn, **{o: v}, **needs))
        if needs:  # alone (without dropout) it places nothing: it raises
            cases[(option, "alone")] = (lambda: _layer(fn),
                                        lambda o=option, v=value: _layer(fn, **{o: v}))
    if saved:
        cases["saved"] = (lambda: _layer(fn), lambda: _layer(fn, saved="int8"))
    return cases


def _pair(base, option, value, **needs):
    return (lambda: base(**needs), lambda: base(**{option: value}, **needs))


CASES = {  # (function, option[, variant]) -> (default call, call with the option set)
    ("AdamW", "lr"): _pair(_adamw, "lr", 0.1),
    ("AdamW", "betas"): _pair(_adamw, "betas", (0.5, 0.6)),
    ("AdamW", "eps"): _pair(_adamw, "eps", 1.0),
    ("AdamW", "weight_decay"): _pair(_adamw, "weight_decay", 0.5),
    ("AdamW", "max_grad_norm"): _pair(_adamw, "max_grad_norm", 0.01),
    ("AdamW", "no_decay"): _pair(_adamw, "no_decay", ("w",), weight_decay=0.5),
    ("SavedConfig", "format"): (lambda: save(_f(3, 40), lowbit.SavedConfig()),
                                lambda: save(_f(3, 40), lowbit.SavedConfig("int2"))),
    ("SavedConfig", "group_size"): (lambda: save(_f(3, 40), lowbit.SavedConfig()),
                                    lambda: save(_f(3, 40), lowbit.SavedConfig(group_size=8))),
    ("SavedConfig", "rounding"): (
        lambda: save(_f(3, 40), lowbit.SavedConfig("int2")),
        lambda: save(_f(3, 40), lowbit.SavedConfig("int2", rounding="stochastic"))),
    ("SavedConfig", "seed"): (
        lambda: save(_f(3, 40), lowbit.SavedConfig("int2", rounding="stochastic")),
        lambda: save(_f(3, 40), lowbit.SavedConfig("int2", rounding="stochastic", seed=4))),
    ("SavedConfig", "seed", "alone"): (lambda: save(_f(3, 40), lowbit.SavedConfig()),
                                       lambda: lowbit.SavedConfig(seed=4)),
    ("SavedConfig", "group_size", "fp32"): (lambda: lowbit.SavedConfig("fp32"),
                                            lambda: lowbit.SavedConfig("fp32", group_size=8)),
    **{("LowBitPlan", side): (lambda: _layer(lowbit.lowrank_residual, plan=lowbit.LowBitPlan()),
                              lambda s=side: _layer(lowbit.lowrank_residual,
                                                    plan=lowbit.LowBitPlan(**{s: ("sign", None)})))
       for side in ("x", "y", "residual")},
    ("cross_entropy", "ignore_index"): _pair(lambda **o: _ce(lowbit.cross_entropy, **o),
                                             "ignore_index", 3),
    ("cross_entropy_forward", "ignore_index"): _pair(
        lambda **o: _ce(lowbit.cross_entropy_forward, **o), "ignore_index", 3),
    ("cross_entropy_forward", "saved"): _pair(
        lambda **o: _ce(lowbit.cross_entropy_forward, **o), "saved", "int4"),
    ("fake_quantize_activation", "act_format"): _pair(
        lambda **o: lowbit.fake_quantize_activation(_f(3, 8), **o), "act_format", "int4"),
    ("quantize_activation", "act_format"): _pair(
        lambda **o: lowbit.quantize_activation(_f(3, 8), **o), "act_format", "int4"),
    ("gated_delta_scan", "initial_state"): _pair(
        lambda **o: _gdr(lowbit.gated_delta_scan, **o), "initial_state", _f(1, 2, 3, 3)),
    ("gated_delta_scan_forward", "initial_state"): _pair(
        lambda **o: _gdr(lowbit.gated_delta_scan_forward, **o), "initial_state", _f(1, 2, 3, 3)),
    ("gated_delta_scan_forward", "chunk_size"): _pair(
        lambda **o: _gdr(lowbit.gated_delta_scan_forward, **o), "chunk_size", 2),
    ("gated_delta_scan_forward", "saved"): _pair(
        lambda **o: _gdr(lowbit.gated_delta_scan_forward, **o), "saved", "int8"),
    ("selective_scan", "initial_state"): _pair(
        lambda **o: _ssm(lowbit.selective_scan, **o), "initial_state", _f(1, 2, 3, 2)),
    ("selective_scan", "dt_floor"): _pair(
        lambda **o: _ssm(lowbit.selective_scan, **o), "dt_floor", 3.0),
    ("selective_scan_forward", "initial_state"): _pair(
        lambda **o: _ssm(lowbit.selective_scan_forward, **o), "initial_state", _f(1, 2, 3, 2)),
    ("selective_scan_forward", "dt_floor"): _pair(
        lambda **o: _ssm(lowbit.selective_scan_forward, **o), "dt_floor", 3.0),
    ("selective_scan_forward", "chunk_size"): _pair(
        lambda **o: _ssm(lowbit.selective_scan_forward, **o), "chunk_size", 2),
    ("selective_scan_forward", "saved"): _pair(
        lambda **o: _ssm(lowbit.selective_scan_forward, **o), "saved", "int8"),
    ("layer_norm", "eps"): _pair(lambda **o: _ln(lowbit.layer_norm, **o), "eps", 0.5),
    ("layer_norm_forward", "eps"): _pair(lambda **o: _ln(lowbit.layer_norm_forward, **o),
                                         "eps", 0.5),
    ("layer_norm_forward", "saved"): _pair(lambda **o: _ln(lowbit.layer_norm_forward, **o),
                                           "saved", "int4"),
    ("rms_norm", "eps"): _pair(lambda **o: _rms(lowbit.rms_norm, **o), "eps", 0.5),
    ("rms_norm_forward", "eps"): _pair(lambda **o: _rms(lowbit.rms_norm_forward, **o), "eps",
                                       0.5),
    ("rms_norm_forward", "saved"): _pair(lambda **o: _rms(lowbit.rms_norm_forward, **o),
                                         "saved", "int4"),
    **{("lowrank_residual", *([k] if isinstance(k, str) else k)): v
       for k, v in _layer_cases(lowbit.lowrank_residual, False).items()},
    **{("lowrank_residual_forward", *([k] if isinstance(k, str) else k)): v
       for k, v in _layer_cases(lowbit.lowrank_residual_forward, True).items()},
    ("lowrank_residual_backward", "accumulate"): _pair(
        _lr_backward, "accumulate",
        tuple(np.ones(w.shape, np.float32) for w in lowrank_inputs(_rng(), 1, 5, 4, 2, 6)[1:])),
    ("pack_activation", "kind"): _pair(_pack, "kind", "nonneg"),
    ("pack_activation", "group_size"): _pair(_pack, "group_size", 8),
    ("pack_activation", "rounding"): _pair(_pack, "rounding", "stochastic"),
    ("pack_activation", "seed"): _pair(_pack, "seed", 5, rounding="stochastic"),
    ("pack_activation", "seed", "alone"): _pair(_pack, "seed", 5),
    ("pack_bits", "axis"): _pair(
        lambda **o: lowbit.pack_bits(np.arange(24, dtype=np.uint8).reshape(4, 6) % 4, 2, **o),
        "axis", 0),
    ("unpack_bits", "axis"): _pair(
        lambda **o: lowbit.unpack_bits(np.arange(4, dtype=np.uint8).reshape(2, 2) * 37, 4, 4,
                                       **o), "axis", 0),
    ("packed_matmul", "act_format"): _pair(lambda **o: lowbit.packed_matmul(_f(4, 8), _pw(), **o),
                                           "act_format", None),
    ("linear_forward", "act_format"): _pair(_linear, "act_format", None),
    ("linear_forward", "saved"): _pair(_linear, "saved", "int8", act_format=None),
    ("linear_forward", "saved", "alone"): _pair(_linear, "saved", "int8"),
    ("linear_backward", "grad_format"): _pair(_linear_backward, "grad_format", "int8"),
    ("segmented_attention", "scale"): _pair(lambda **o: _att(lowbit.segmented_attention, **o),
                                            "scale", 0.1),
    ("segmented_attention", "causal"): _pair(lambda **o: _att(lowbit.segmented_attention, **o),
                                             "causal", True),
    ("segmented_attention_forward", "scale"): _pair(
        lambda **o: _att(lowbit.segmented_attention_forward, **o), "scale", 0.1),
    ("segmented_attention_forward", "causal"): _pair(
        lambda **o: _att(lowbit.segmented_attention_forward, **o), "causal", True),
    ("segmented_attention_forward", "saved"): _pair(
        lambda **o: _att(lowbit.segmented_attention_forward, **o), "saved", "int8"),
    ("segmented_attention", "k_lengths"): _pair(
        lambda **o: _att(lowbit.segmented_attention, **o), "k_lengths", [3, 2]),
    ("segmented_attention_forward", "k_lengths"): _pair(
        lambda **o: _att(lowbit.segmented_attention_forward, **o), "k_lengths", [3, 2]),
    **{(fn.__name__, option): _pair(lambda fn=fn, **o: _rot(fn, **o), option, value)
       for fn in (lowbit.rotary, lowbit.rotary_forward)
       for option, value in (("theta", 500000.0), ("style", "interleaved"))},
}

#: Cases where the option has no effect, and must therefore raise: -> the message's start.
RAISES = {
    ("SavedConfig", "seed", "alone"): "seed=4 has no effect",
    ("SavedConfig", "group_size", "fp32"): "group_size=8 has no effect",
    ("lowrank_residual", "seed", "alone"): "seed=3 has no effect",
    ("lowrank_residual", "row_offset", "alone"): "row_offset=1 has no effect",
    ("lowrank_residual_forward", "seed", "alone"): "seed=3 has no effect",
    ("lowrank_residual_forward", "row_offset", "alone"): "row_offset=1 has no effect",
    ("pack_activation", "seed", "alone"): "seed=5 has no effect",
    ("linear_forward", "saved", "alone"): "saved must be None with act_format='int8'",
}


def _options():
    """(owner, option) of every public option: functions of lowbit.ops and the option
    classes."""
    owners = {name: f for name, f in vars(lowbit).items()
              if inspect.isfunction(f) and f.__module__.startswith("lowbit.ops")}
    owners.update(AdamW=lowbit.AdamW, SavedConfig=lowbit.SavedConfig,
                  LowBitPlan=lowbit.LowBitPlan)
    return {(name, p.name) for name, f in owners.items()
            for p in inspect.signature(f).parameters.values() if p.default is not p.empty}


def test_every_option_has_a_case():
    covered = {key[:2] for key in CASES}
    missing = sorted(_options() - covered)
    assert not missing, f"options without a case in CASES: {missing}"
    assert set(RAISES) <= set(CASES)


@pytest.mark.parametrize("key", sorted(CASES, key=str), ids=lambda k: "-".join(k))
def test_an_option_changes_the_result_or_raises(key):
    default, changed = CASES[key]
    with lowbit.use_backend("numpy"):
        base = default()
        if key in RAISES:
            with pytest.raises(ValueError, match=f"^{RAISES[key]}"):
                changed()
            return
        result = changed()
    assert _differs(base, result), f"{key[0]}({key[1]}=...) gave the default call's result"
