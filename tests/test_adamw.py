"""lowbit.AdamW on every backend against reference/adamw.py (and torch.optim.AdamW if installed).

Op: lowbit/ops/adamw; kernels: cuda/adamw.cu. The step updates the parameters in place (the
optimizer's documented exception); everything else passed in stays unchanged.
"""

import math

import numpy as np
import pytest

import lowbit
from helpers import assert_close, assert_equal, to_numpy
from lowbit.ops.adamw import _cuda as adamw_cuda
from lowbit.reference.adamw import adamw_ref

SHAPES = {"bias": (1,), "gain": (3,), "proj": (37,), "w": (5, 7)}
#: Relative tolerance of the parameters, by parameter dtype: float32 arithmetic, or float64
#: arithmetic with float32 moments.
PARAM_RTOL = {np.float32: 2e-6, np.float64: 1e-7}
MOMENT_RTOL = 2e-6


def _params(rng, shapes, dtype):
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


def _grad_seq(rng, shapes, dtype, steps, scale=1.0):
    return [{k: (scale * rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()}
            for _ in range(steps)]


def _host_state(state):
    return {"step": state["step"],
            "exp_avg": {k: to_numpy(v) for k, v in state["exp_avg"].items()},
            "exp_avg_sq": {k: to_numpy(v) for k, v in state["exp_avg_sq"].items()}}


def _run_against_reference(backend, params0, grad_seq, lrs, hyper):
    """Step lowbit and the reference side by side, comparing after every step."""
    dtype = next(iter(params0.values())).dtype.type
    opt = lowbit.AdamW(lr=lrs[0], **hyper)
    params = {k: backend.to(v.copy()) for k, v in params0.items()}
    ref_params = {k: v.astype(np.float64) for k, v in params0.items()}
    ref_state = None
    norms = []
    for lr, grads in zip(lrs, grad_seq):
        opt.lr = lr
        keep = {k: g.copy() for k, g in grads.items()}
        before = {k: to_numpy(v).astype(np.float64) for k, v in params.items()}
        opt.step(params, {k: backend.to(g) for k, g in grads.items()})
        ref_before = ref_params
        ref_params, ref_state, ref_norm = adamw_ref(ref_params, grads, ref_state, lr=lr, **hyper)
        for k in params0:
            assert_close(f"params[{k}]", ref_params[k], params[k], PARAM_RTOL[dtype])
            if dtype == np.float64:
                # The update itself, free of the float32 rounding of the parameter values.
                assert_close(f"update[{k}]", ref_params[k] - ref_before[k],
                             to_numpy(params[k]) - before[k], 1e-5)
            state = opt.state_dict()
            assert_close(f"exp_avg[{k}]", ref_state["exp_avg"][k], state["exp_avg"][k],
                         MOMENT_RTOL)
            assert_close(f"exp_avg_sq[{k}]", ref_state["exp_avg_sq"][k],
                         state["exp_avg_sq"][k], MOMENT_RTOL)
            np.testing.assert_array_equal(grads[k], keep[k])
        if hyper.get("max_grad_norm") is None:
            assert opt.last_grad_norm is None
        else:
            assert isinstance(opt.last_grad_norm, float)
            assert opt.last_grad_norm == pytest.approx(ref_norm, rel=1e-12)
            norms.append(ref_norm)
    assert opt.state_dict()["step"] == len(lrs)
    return norms


#: Hyperparameters, and whether clipping must trigger on every step (None: clipping off).
HYPER = {
    "defaults": ({}, None),
    "no_decay": ({"weight_decay": 0.0}, None),
    "decay_clip_triggered": ({"weight_decay": 0.1, "max_grad_norm": 0.5}, True),
    "clip_not_triggered": ({"max_grad_norm": 1e3, "betas": (0.8, 0.99), "eps": 1e-2}, False),
    "no_decay_clip_triggered": ({"weight_decay": 0.0, "max_grad_norm": 2.0}, True),
    # Parameter groups: the named parameters do not decay, the others do.
    "groups": ({"weight_decay": 0.3, "no_decay": ("bias", "w")}, None),
    "groups_clip_triggered": ({"weight_decay": 0.2, "max_grad_norm": 0.5,
                               "no_decay": ["proj"]}, True),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(HYPER))
def test_matches_reference_over_steps(backend, rng, dtype, case):
    hyper, triggers = HYPER[case]
    params0 = _params(rng, SHAPES, dtype)
    grads = _grad_seq(rng, SHAPES, dtype, 4)
    norms = _run_against_reference(backend, params0, grads, [1e-2, 3e-3, 3e-2, 0.0], hyper)
    if triggers is not None:
        assert [n > hyper["max_grad_norm"] for n in norms] == [triggers] * len(norms)


def test_multi_block_sizes(backend, rng):
    # numba: several STEP_CHUNK/SUM_CHUNK chunks; numpy: several SUM_CHUNK partials; CUDA: many
    # blocks and the two-pass sum. cudasim runs one OS thread per CUDA thread: a few blocks.
    n = 1000 if backend.name == "cudasim" else 70001
    shapes = {"big": (n,), "odd": (3, 37)}
    params0 = _params(rng, shapes, np.float32)
    grads = _grad_seq(rng, shapes, np.float32, 3, scale=0.1)
    norms = _run_against_reference(backend, params0, grads, [1e-3, 1e-2, 1e-3],
                                   {"max_grad_norm": 1.0})
    assert all(n > 1.0 for n in norms)


def test_grid_stride_loops(backend, rng, monkeypatch):
    # Fewer blocks than elements need: the grid-stride loops and a multi-partial sum run.
    if backend.name not in ("cudasim", "cuda"):
        pytest.skip("CUDA launchers only")
    monkeypatch.setattr(adamw_cuda, "MAX_BLOCKS", 2)
    monkeypatch.setattr(adamw_cuda, "MAX_SUM_BLOCKS", 3)
    shapes = {"w": (1500,)}
    params0 = _params(rng, shapes, np.float64)
    grads = _grad_seq(rng, shapes, np.float64, 2)
    _run_against_reference(backend, params0, grads, [1e-2, 1e-2], {"max_grad_norm": 3.0})


def _stepped(backend, rng, hyper, steps=2):
    params = {k: backend.to(v) for k, v in _params(rng, SHAPES, np.float32).items()}
    opt = lowbit.AdamW(**hyper)
    for grads in _grad_seq(rng, SHAPES, np.float32, steps):
        opt.step(params, {k: backend.to(g) for k, g in grads.items()})
    return opt, params


def _copy(params):
    return {k: v.copy() for k, v in params.items()}


def _assert_same(a_params, a_opt, b_params, b_opt):
    for k in a_params:
        assert_equal(f"params[{k}]", a_params[k], b_params[k])
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    assert {k: v for k, v in sa.items() if not k.startswith("exp")} == \
        {k: v for k, v in sb.items() if not k.startswith("exp")}
    for field in ("exp_avg", "exp_avg_sq"):
        assert sorted(sa[field]) == sorted(sb[field])
        for k in sa[field]:
            assert_equal(f"{field}[{k}]", sa[field][k], sb[field][k])


def test_state_dict_round_trip_continues_bitwise(backend, rng):
    hyper = {"lr": 3e-3, "weight_decay": 0.05, "max_grad_norm": 1.0}
    a, a_params = _stepped(backend, rng, hyper)
    state = a.state_dict()
    assert state["step"] == 2 and type(state["step"]) is int
    assert state["lr"] == 3e-3 and state["betas"] == (0.9, 0.999) and state["eps"] == 1e-8
    assert state["weight_decay"] == 0.05 and state["max_grad_norm"] == 1.0
    for field in ("exp_avg", "exp_avg_sq"):
        assert sorted(state[field]) == sorted(SHAPES)
        for k, v in state[field].items():
            assert v.dtype == np.float32 and v.shape == SHAPES[k]
    saved = _host_state(state)
    b = lowbit.AdamW(lr=0.5, weight_decay=0.0)  # hyperparameters come from the state
    b.load_state_dict(state)
    b_params = _copy(a_params)
    for grads in _grad_seq(rng, SHAPES, np.float32, 2):
        grads = {k: backend.to(g) for k, g in grads.items()}
        a.step(a_params, grads)
        b.step(b_params, grads)
        assert a.last_grad_norm == b.last_grad_norm
        _assert_same(a_params, a, b_params, b)
    # The state handed out, and the one loaded, are copies: later steps left them alone.
    for field in ("exp_avg", "exp_avg_sq"):
        for k in SHAPES:
            assert_equal(field, saved[field][k], state[field][k])


def test_no_decay_is_weight_decay_zero_for_those_names_only(backend, rng):
    # The group's parameters step as with weight_decay=0, the others as without groups: bitwise,
    # so the option changes the decay of exactly the named parameters and nothing else.
    params0 = _params(rng, SHAPES, np.float32)
    grads = _grad_seq(rng, SHAPES, np.float32, 3)
    runs = {}
    for label, hyper in {"groups": {"weight_decay": 0.5, "no_decay": ("gain", "w")},
                         "all": {"weight_decay": 0.5}, "none": {"weight_decay": 0.0}}.items():
        opt = lowbit.AdamW(lr=1e-2, max_grad_norm=1.0, **hyper)
        params = {k: backend.to(v.copy()) for k, v in params0.items()}
        for g in grads:
            opt.step(params, {k: backend.to(v) for k, v in g.items()})
        runs[label] = params
    assert opt.no_decay == ()
    for k in SHAPES:
        assert_equal(f"params[{k}]", runs["none" if k in ("gain", "w") else "all"][k],
                     runs["groups"][k])
        assert not np.array_equal(to_numpy(runs["all"][k]), to_numpy(runs["none"][k]))


def test_no_decay_round_trips_through_the_state(backend, rng):
    hyper = {"lr": 3e-3, "weight_decay": 0.2, "no_decay": ["w", "bias"]}
    a, a_params = _stepped(backend, rng, hyper)
    assert a.no_decay == ("bias", "w")
    state = a.state_dict()
    assert state["no_decay"] == ("bias", "w")
    b = lowbit.AdamW()  # no_decay comes from the state
    b.load_state_dict(state)
    assert b.no_decay == ("bias", "w")
    b_params = _copy(a_params)
    for grads in _grad_seq(rng, SHAPES, np.float32, 2):
        grads = {k: backend.to(g) for k, g in grads.items()}
        a.step(a_params, grads)
        b.step(b_params, grads)
        _assert_same(a_params, a, b_params, b)


def test_state_without_no_decay_loads_as_decay_on_all(backend, rng):
    # A state written before the option existed (older checkpoints) has no "no_decay" key: it
    # loads, with decay on every parameter, as the optimizer that wrote it had.
    a, a_params = _stepped(backend, rng, {"weight_decay": 0.2})
    old = {k: v for k, v in a.state_dict().items() if k != "no_decay"}
    b = lowbit.AdamW(no_decay=("w",))
    b.load_state_dict(old)
    assert b.no_decay == ()
    b_params = _copy(a_params)
    grads = {k: backend.to(g) for k, g in _grad_seq(rng, SHAPES, np.float32, 1)[0].items()}
    a.step(a_params, grads)
    b.step(b_params, grads)
    _assert_same(a_params, a, b_params, b)


def test_unknown_no_decay_name_raises_at_the_step(rng, never_runs):
    params, grads = _valid(rng)
    keep = _copy(params)
    opt = lowbit.AdamW(no_decay=("a", "embed"))  # a name is checked against the params
    with pytest.raises(ValueError, match=r"no_decay names \['embed'\], which are not keys"):
        opt.step(params, grads)
    assert opt.state_dict()["step"] == 0 and not opt.state_dict()["exp_avg"]
    for k in params:
        np.testing.assert_array_equal(params[k], keep[k])


def test_two_optimizers_from_one_state_agree_bitwise(backend, rng):
    a, params = _stepped(backend, rng, {"max_grad_norm": 2.0, "weight_decay": 0.1}, steps=3)
    state = a.state_dict()
    b, c = lowbit.AdamW(), lowbit.AdamW()
    b.load_state_dict(state)
    c.load_state_dict(state)
    b_params, c_params = _copy(params), _copy(params)
    for lr, grads in zip([1e-3, 1e-4], _grad_seq(rng, SHAPES, np.float32, 2)):
        grads = {k: backend.to(g) for k, g in grads.items()}
        b.lr = c.lr = lr
        b.step(b_params, grads)
        c.step(c_params, grads)
    _assert_same(b_params, b, c_params, c)


def test_non_finite_gradient_updates_nothing(backend, rng):
    opt, params = _stepped(backend, rng, {"max_grad_norm": 1.0}, steps=1)
    before, state = _copy(params), _host_state(opt.state_dict())
    norm = opt.last_grad_norm
    for bad in (np.nan, np.inf, -np.inf):
        grads = {k: backend.to(g) for k, g in _grad_seq(rng, SHAPES, np.float32, 1)[0].items()}
        grads["proj"][5] = bad
        with pytest.raises(ValueError, match=r"grads\['proj'\] must be finite"):
            opt.step(params, grads)
        for k in SHAPES:
            assert_equal(f"params[{k}]", before[k], params[k])
        after = _host_state(opt.state_dict())
        assert after["step"] == state["step"] and opt.last_grad_norm == norm
        for field in ("exp_avg", "exp_avg_sq"):
            for k in SHAPES:
                assert_equal(field, state[field][k], after[field][k])


def test_huge_finite_float64_gradient_is_not_rejected(backend, rng):
    # Its square overflows the float64 sum: the explicit finiteness check tells it apart.
    params = {"w": backend.to(rng.standard_normal(3))}
    grads = {"w": backend.to(np.array([1e200, 0.0, -1.0]))}
    opt = lowbit.AdamW(max_grad_norm=1.0)
    opt.step(params, grads)
    assert opt.last_grad_norm == math.inf


def test_layouts_empty_and_zero_size(backend, rng):
    opt = lowbit.AdamW()
    opt.step({}, {})
    assert opt.state_dict()["step"] == 1
    host = rng.standard_normal((6, 8)).astype(np.float32)
    grad_t = rng.standard_normal((8, 6)).astype(np.float32)
    params = {"w": backend.to(host.copy()), "empty": backend.to(np.zeros((0, 4), np.float32)),
              "scalar": backend.to(np.array(0.5, np.float32))}
    grads = {"w": backend.to(grad_t).T, "empty": backend.to(np.zeros((0, 4), np.float32)),
             "scalar": backend.to(np.array(-2.0, np.float32))}
    keep = to_numpy(grads["w"]).copy()
    fresh = lowbit.AdamW(lr=1e-2)
    fresh.step(params, grads)
    ref, _, _ = adamw_ref({"w": host, "empty": np.zeros((0, 4)), "scalar": np.array(0.5)},
                          {"w": grad_t.T, "empty": np.zeros((0, 4)), "scalar": np.array(-2.0)},
                          lr=1e-2)
    for k in params:
        assert_close(k, ref[k], params[k], PARAM_RTOL[np.float32])
    np.testing.assert_array_equal(to_numpy(grads["w"]), keep)


def test_torch_agrees(backend, rng):
    torch = pytest.importorskip("torch")
    shapes = {"a": (37,), "b": (4, 9)}
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params0 = _params(rng, shapes, np.float32)
    grad_seq = _grad_seq(rng, shapes, np.float32, 5)
    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in params0.items()}
    names = sorted(shapes)
    topt = torch.optim.AdamW([tparams[k] for k in names], foreach=False, **hyper)
    opt = lowbit.AdamW(max_grad_norm=1.0, **hyper)
    params = {k: backend.to(v.copy()) for k, v in params0.items()}
    for grads in grad_seq:
        for k in names:
            tparams[k].grad = torch.tensor(grads[k])
        tnorm = float(torch.nn.utils.clip_grad_norm_([tparams[k] for k in names], 1.0))
        topt.step()
        opt.step(params, {k: backend.to(g) for k, g in grads.items()})
        assert opt.last_grad_norm == pytest.approx(tnorm, rel=1e-5)
        state = opt.state_dict()
        for i, k in enumerate(names):
            tstate = topt.state[tparams[k]]
            assert_close(f"params[{k}]", tparams[k].detach().numpy(), params[k], 2e-6)
            assert_close(f"exp_avg[{k}]", tstate["exp_avg"].numpy(), state["exp_avg"][k], 2e-6)
            assert_close(f"exp_avg_sq[{k}]", tstate["exp_avg_sq"].numpy(),
                         state["exp_avg_sq"][k], 2e-6)


# -- validation: one test per rule, the message names the argument -----------------------------


def _hyper_id(value):
    if isinstance(value, dict):
        return ",".join(f"{k}={v!r}".replace(" ", "") for k, v in value.items())
    return getattr(value, "__name__", str(value))


@pytest.mark.parametrize("kwargs, error, word", [
    ({"lr": -1e-3}, ValueError, "lr"), ({"lr": math.nan}, ValueError, "lr"),
    ({"lr": math.inf}, ValueError, "lr"), ({"lr": "0.1"}, TypeError, "lr"),
    ({"betas": (1.0, 0.9)}, ValueError, r"betas\[0\]"),
    ({"betas": (0.9, -0.1)}, ValueError, r"betas\[1\]"),
    ({"betas": (0.9,)}, TypeError, "betas"), ({"betas": 0.9}, TypeError, "betas"),
    ({"eps": 0.0}, ValueError, "eps"), ({"eps": -1e-8}, ValueError, "eps"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"weight_decay": None}, TypeError, "weight_decay"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ({"max_grad_norm": math.nan}, ValueError, "max_grad_norm"),
    ({"no_decay": "embed"}, TypeError, r"no_decay.*\('embed',\)"),
    ({"no_decay": None}, TypeError, "no_decay"), ({"no_decay": (1,)}, TypeError, "no_decay"),
    ({"no_decay": ("a", "a")}, ValueError, "no_decay names a parameter twice"),
], ids=_hyper_id)
def test_bad_hyperparameter(never_runs, kwargs, error, word):
    with pytest.raises(error, match=word):
        lowbit.AdamW(**kwargs)


@pytest.mark.parametrize("value, error", [(-0.1, ValueError), (math.inf, ValueError),
                                          (None, TypeError)])
def test_bad_lr_assignment(never_runs, value, error):
    opt = lowbit.AdamW(lr=1e-3)
    with pytest.raises(error, match="lr"):
        opt.lr = value
    assert opt.lr == 1e-3


@pytest.mark.parametrize("value, error", [(-0.1, ValueError), (math.nan, ValueError),
                                          ("0", TypeError)])
def test_bad_weight_decay_assignment(never_runs, value, error):
    opt = lowbit.AdamW(weight_decay=0.1)
    with pytest.raises(error, match="weight_decay"):
        opt.weight_decay = value
    assert opt.weight_decay == 0.1
    opt.weight_decay = 0.0
    assert opt.weight_decay == 0.0


def _valid(rng):
    params = _params(rng, {"a": (4,), "b": (2, 3)}, np.float32)
    grads = {k: np.ones_like(v) for k, v in params.items()}
    return params, grads


def _ro(x):
    x = x.copy()
    x.flags.writeable = False
    return x


STEP_CASES = {
    "params_not_dict": (lambda p, g: ([("a", p["a"])], g), TypeError, "params must be a dict"),
    "grads_not_dict": (lambda p, g: (p, None), TypeError, "grads must be a dict"),
    "missing_key": (lambda p, g: (p, {"a": g["a"]}), ValueError, r"grads.*missing \['b'\]"),
    "extra_key": (lambda p, g: (p, {**g, "c": g["a"]}), ValueError, r"grads.*extra \['c'\]"),
    "non_str_key": (lambda p, g: ({**p, 1: p["a"]}, {**g, 1: g["a"]}), TypeError, "keys"),
    "param_not_array": (lambda p, g: ({**p, "a": [1.0] * 4}, g), TypeError, r"params\['a'\]"),
    "grad_not_array": (lambda p, g: (p, {**g, "a": [1.0] * 4}), TypeError, r"grads\['a'\]"),
    "integer_param": (lambda p, g: ({**p, "a": np.ones(4, np.int32)}, g), TypeError,
                      r"params\['a'\]"),
    "grad_dtype": (lambda p, g: (p, {**g, "a": g["a"].astype(np.float64)}), TypeError,
                   r"grads\['a'\].*dtype"),
    "grad_shape": (lambda p, g: (p, {**g, "b": g["b"].T.copy()}), ValueError,
                   r"grads\['b'\].*shape"),
    "param_not_contiguous": (lambda p, g: ({**p, "b": np.asfortranarray(p["b"])}, g),
                             ValueError, r"params\['b'\].*C-contiguous"),
    "param_strided": (lambda p, g: ({**p, "a": np.ones(8, np.float32)[::2]}, g), ValueError,
                      r"params\['a'\].*C-contiguous"),
    "param_read_only": (lambda p, g: ({**p, "a": _ro(p["a"])}, g), ValueError,
                        r"params\['a'\].*writeable"),
    "params_share_memory": (lambda p, g: ({**p, "b": p["a"][:].reshape(2, 2)},
                                          {**g, "b": np.ones((2, 2), np.float32)}),
                            ValueError, r"params\['.'\] shares memory"),
    "grad_aliases_param": (lambda p, g: (p, {**g, "b": p["b"]}), ValueError,
                           r"params\['b'\] shares memory with grads\['b'\]"),
    "grad_aliases_other_param": (lambda p, g: (p, {**g, "a": p["b"].reshape(-1)[:4]}),
                                 ValueError, "shares memory"),
}


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_bad_step_arguments(rng, never_runs, case):
    change, error, match = STEP_CASES[case]
    params, grads = _valid(rng)
    params, grads = change(params, grads)
    keep = {k: np.array(v, copy=True) for k, v in params.items()} if isinstance(params, dict) \
        else None
    opt = lowbit.AdamW()
    with pytest.raises(error, match=match):
        opt.step(params, grads)
    assert opt.state_dict()["step"] == 0
    if keep is not None:
        for k, v in keep.items():
            np.testing.assert_array_equal(params[k], v)


@pytest.fixture
def stepped(rng, never_runs):
    """An optimizer after one step on ``_valid`` params (backends run for that step only)."""
    params, grads = _valid(rng)
    opt = lowbit.AdamW()
    with never_runs.paused():
        opt.step(params, grads)
    return opt, params, grads


def test_step_with_other_keys_than_the_state(stepped):
    opt, params, grads = stepped
    with pytest.raises(ValueError, match=r"params.*optimizer's state.*missing \['b'\]"):
        opt.step({"a": params["a"]}, {"a": grads["a"]})
    assert opt.state_dict()["step"] == 1


def test_step_with_other_shapes_than_the_state(stepped, rng):
    opt, params, grads = stepped
    with pytest.raises(ValueError, match=r"params\['b'\].*shape"):
        opt.step({**params, "b": np.ones((3, 2), np.float32)},
                 {**grads, "b": np.ones((3, 2), np.float32)})
    assert opt.state_dict()["step"] == 1


def _state_cases():
    def with_(**changes):
        return lambda s: {**s, **changes}

    def moments(field, **changes):
        return lambda s: {**s, field: {**s[field], **changes}}

    return {
        "not_dict": (lambda s: [s], TypeError, "state must be a dict"),
        "missing_key": (lambda s: {k: v for k, v in s.items() if k != "eps"}, ValueError,
                        r"state.*missing \['eps'\]"),
        "extra_key": (with_(momentum=0.9), ValueError, r"state.*extra \['momentum'\]"),
        "negative_step": (with_(step=-1), ValueError, r"state\['step'\]"),
        "float_step": (with_(step=1.0), TypeError, r"state\['step'\]"),
        "zero_step_with_moments": (with_(step=0), ValueError, r"state\['step'\]"),
        "bad_lr": (with_(lr=-1.0), ValueError, r"state\['lr'\]"),
        "bad_betas": (with_(betas=(0.9, 1.5)), ValueError, r"state\['betas'\]\[1\]"),
        "bad_eps": (with_(eps=0.0), ValueError, r"state\['eps'\]"),
        "bad_weight_decay": (with_(weight_decay=-1.0), ValueError, r"state\['weight_decay'\]"),
        "bad_max_grad_norm": (with_(max_grad_norm=0.0), ValueError,
                              r"state\['max_grad_norm'\]"),
        "bad_no_decay": (with_(no_decay="a"), TypeError, r"state\['no_decay'\]"),
        "no_decay_without_moments": (with_(no_decay=("a", "z")), ValueError,
                                     r"state\['no_decay'\] names \['z'\]"),
        "moment_names_differ": (moments("exp_avg_sq", c=np.zeros(4, np.float32)), ValueError,
                                r"state\['exp_avg_sq'\].*extra \['c'\]"),
        "names_other_than_mine": (
            lambda s: {**s, "exp_avg": {"a": s["exp_avg"]["a"]},
                       "exp_avg_sq": {"a": s["exp_avg_sq"]["a"]}},
            ValueError, r"state\['exp_avg'\].*this optimizer's.*missing \['b'\]"),
        "shapes_other_than_mine": (
            lambda s: {**s, "exp_avg": {**s["exp_avg"], "a": np.zeros(5, np.float32)},
                       "exp_avg_sq": {**s["exp_avg_sq"], "a": np.zeros(5, np.float32)}},
            ValueError, r"state\['exp_avg'\]\['a'\].*shape"),
        "moment_shapes_differ": (moments("exp_avg_sq", a=np.zeros(5, np.float32)), ValueError,
                                 r"state\['exp_avg_sq'\]\['a'\].*shape"),
        "moment_dtype": (moments("exp_avg", a=np.zeros(4, np.float64)), TypeError,
                         r"state\['exp_avg'\]\['a'\].*float32"),
        "moment_not_array": (moments("exp_avg", a=[0.0] * 4), TypeError,
                             r"state\['exp_avg'\]\['a'\]"),
    }


STATE_CASES = _state_cases()


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_bad_state(stepped, case):
    opt, _, _ = stepped
    change, error, match = STATE_CASES[case]
    before = opt.state_dict()
    with pytest.raises(error, match=match):
        opt.load_state_dict(change(opt.state_dict()))
    after = opt.state_dict()
    assert {k: v for k, v in before.items() if not k.startswith("exp")} == \
        {k: v for k, v in after.items() if not k.startswith("exp")}
    for field in ("exp_avg", "exp_avg_sq"):
        for k in before[field]:
            assert_equal(field, before[field][k], after[field][k])
