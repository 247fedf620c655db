"""The AdamW optimizer: ``lowbit.AdamW``, with optional global gradient-norm clipping.

Backends: ``_numpy.py``, ``_numba.py``, ``_cuda.py`` (kernels ``cuda/adamw.cu``); reference:
``reference/adamw.py``; tests: ``tests/test_adamw.py``; benchmark: ``bench/adamw.py``.

An optimizer is an op like the others, with one documented exception to "inputs are never
modified": ``AdamW.step`` updates the parameter arrays in place (and the backend ``step``
functions update their ``param``, ``exp_avg`` and ``exp_avg_sq`` arguments). Everything is
validated before anything is modified: a step that raises leaves the parameters, the moments and
the step count as they were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ... import _backend, _dispatch, _validate
from ..._typing import Array

#: Added to the total norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
CLIP_EPS = 1e-6
_STATE_KEYS = frozenset({"step", "lr", "betas", "eps", "weight_decay", "max_grad_norm",
                         "no_decay", "exp_avg", "exp_avg_sq"})
#: Keys a state may lack: states written before they existed load with their old meaning
#: (``no_decay`` missing: weight decay on every parameter).
_OPTIONAL_STATE_KEYS = frozenset({"no_decay"})


def _nonnegative(value, name):
    """A finite float >= 0 (the learning rate, the weight decay), the message naming ``name``."""
    value = _validate.finite_scalar(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _betas(value, name="betas"):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise TypeError(f"{name} must be a pair (beta1, beta2), got {value!r}")
    out = []
    for i, beta in enumerate(value):
        beta = _validate.finite_scalar(beta, f"{name}[{i}]")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}[{i}] must lie in [0, 1), got {beta}")
        out.append(beta)
    return tuple(out)


def _eps(value, name="eps"):
    value = _validate.finite_scalar(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _max_grad_norm(value, name="max_grad_norm"):
    if value is None:
        return None
    value = _validate.finite_scalar(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be None or > 0, got {value}")
    return value


def _no_decay(value, name="no_decay"):
    """A sorted tuple of distinct parameter names (str) that get no weight decay."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, set, frozenset)):
        raise TypeError(f"{name} must be a tuple of parameter names (str), got {value!r}"
                        + (f"; write ({value!r},) for one name" if isinstance(value, str)
                           else ""))
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{name} must hold parameter names (str), got {key!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{name} names a parameter twice: {sorted(value)}")
    return tuple(sorted(value))


def _key_difference(name, got, expected, against):
    """ValueError naming the keys ``got`` lacks and has beyond ``expected``; None if equal."""
    missing, extra = sorted(expected - got, key=repr), sorted(got - expected, key=repr)
    if not missing and not extra:
        return None
    parts = ([f"is missing {missing}"] if missing else []) + ([f"has extra {extra}"] if extra
                                                               else [])
    return ValueError(f"{name} must have the keys of {against}: it " + " and ".join(parts))


def _names(mapping, name):
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{name} must be a dict of arrays, got {type(mapping).__name__}")
    for key in mapping:
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be str, got {key!r}")
    return set(mapping)


def _is_cupy(x):
    return _backend.is_cupy_array(x)


def _span(x):
    """[start, end) byte addresses of a contiguous array's buffer."""
    start = x.data.ptr if _is_cupy(x) else x.__array_interface__["data"][0]
    return start, start + x.nbytes


def _check_disjoint(params, grads, names):
    """Params must not overlap each other or any contiguous grad: the update is in place.

    One sweep over the buffers sorted by start address: a buffer overlaps an earlier one exactly
    when it starts before that one's end, so each keeps the furthest end of the params and of
    the grads seen so far.
    """
    spans = []
    for k in names:
        if params[k].nbytes:
            spans.append((*_span(params[k]), "params", k))
        g = grads[k]
        if g.nbytes and g.flags.c_contiguous:
            spans.append((*_span(g), "grads", k))
    spans.sort()
    furthest: dict[str, tuple[int, str] | None] = {"params": None, "grads": None}  # (end, label)
    for start, end, kind, k in spans:
        label = f"{kind}[{k!r}]"
        for other in ("params", "grads") if kind == "params" else ("params",):
            seen = furthest[other]
            if seen is not None and start < seen[0]:
                raise ValueError(f"{label} shares memory with {seen[1]}; each parameter must "
                                 "own its buffer, and no gradient may alias a parameter")
        mine = furthest[kind]
        if mine is None or end > mine[0]:
            furthest[kind] = (end, label)


class AdamW:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``, on numpy or cupy arrays.

    Each step, for every parameter ``p`` with gradient ``g`` (after optional clipping of the
    global norm to ``max_grad_norm``, as ``torch.nn.utils.clip_grad_norm_``)::

        p -= lr * weight_decay * p          # skipped for the names in no_decay
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p -= lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)

    The moments ``m`` (``exp_avg``) and ``v`` (``exp_avg_sq``) are float32 arrays shaped like
    each parameter, created zero on the first step. Parameters are float32 (arithmetic in
    float32) or float64. One fused pass per parameter reads p, g, m, v once and writes p, m, v.
    The global norm is a fixed-order reduction (a float64 sum of squares per parameter, then a
    sum over the sorted names), so results are bitwise reproducible on one backend.

    Example:
        >>> opt = lowbit.AdamW(lr=1e-3, max_grad_norm=1.0)
        >>> opt.step(params, grads)      # params[k] updated in place
        >>> opt.lr = 3e-4                # schedules set lr between steps
        >>> state = opt.state_dict()     # plain data + array copies, for a checkpoint

    Args (keyword-only):
        lr: learning rate, finite and >= 0 (settable between steps).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: > 0, added to the denominator.
        weight_decay: >= 0, decoupled (multiplies the parameter by ``1 - lr * weight_decay``).
        max_grad_norm: None (no clipping) or > 0.
        no_decay: a tuple of parameter names (str) that get no weight decay (default ``()``).

    Parameter groups: ``no_decay`` names keys of the ``params`` dict, e.g. ``("embed",)``, whose
    weight decay is 0 (as nanoGPT exempts some parameters); the others decay by
    ``weight_decay``, and clipping and the moments are the same for all. The default ``()``
    decays every parameter, as pathwaycom/bdh does. Each name must be a key of the params
    passed to ``step``: an unknown name raises ``ValueError`` naming it there, before anything
    is updated.

    Raises:
        TypeError, ValueError: a bad hyperparameter; the message names it.
    """

    def __init__(self, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01,
                 max_grad_norm: float | None = None, no_decay: tuple[str, ...] = ()) -> None:
        self._lr = _nonnegative(lr, "lr")
        self._betas = _betas(betas)
        self._eps = _eps(eps)
        self._weight_decay = _nonnegative(weight_decay, "weight_decay")
        self._max_grad_norm = _max_grad_norm(max_grad_norm)
        self._no_decay = _no_decay(no_decay)
        self._step = 0
        self._exp_avg: dict[str, Array] = {}
        self._exp_avg_sq: dict[str, Array] = {}
        self._last_grad_norm: float | None = None

    # -- hyperparameters -------------------------------------------------------------------

    @property
    def lr(self) -> float:
        """The learning rate of the next step (finite, >= 0)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = _nonnegative(value, "lr")

    @property
    def betas(self) -> tuple[float, float]:
        return self._betas

    @property
    def eps(self) -> float:
        return self._eps

    @property
    def weight_decay(self) -> float:
        """The decoupled weight decay of the next step (finite, >= 0); settable between steps
        like ``lr`` (BitNet's schedule turns it off in its second stage)."""
        return self._weight_decay

    @weight_decay.setter
    def weight_decay(self, value: float) -> None:
        self._weight_decay = _nonnegative(value, "weight_decay")

    @property
    def max_grad_norm(self) -> float | None:
        return self._max_grad_norm

    @property
    def no_decay(self) -> tuple[str, ...]:
        """The sorted names of the parameters that get no weight decay (``()``: none)."""
        return self._no_decay

    @property
    def last_grad_norm(self) -> float | None:
        """Global 2-norm of the last step's gradients before clipping (float), or None when
        clipping is off or no step has run."""
        return self._last_grad_norm

    # -- the step --------------------------------------------------------------------------

    def _validated(self, params, grads):
        """Check everything ``step`` needs; return the sorted names and contiguous grads."""
        names = _names(params, "params")
        problem = _key_difference("grads", _names(grads, "grads"), names, "params")
        if problem:
            raise problem
        unknown = sorted(set(self._no_decay) - names)
        if unknown:
            raise ValueError(f"no_decay names {unknown}, which are not keys of params "
                             f"({sorted(names)}); nothing was updated")
        names = sorted(names)
        flat_grads = {}
        kind = None
        for k in names:
            p = _validate.as_array(params[k], f"params[{k!r}]")
            g = _validate.as_array(grads[k], f"grads[{k!r}]")
            _validate.floating(p, f"params[{k!r}]")
            if _is_cupy(p) != _is_cupy(g):
                raise TypeError(f"grads[{k!r}] must be the array kind of its parameter "
                                f"({type(p).__module__}), got {type(g).__module__}")
            if kind is None:
                kind = _is_cupy(p)
            elif kind != _is_cupy(p):
                raise TypeError(f"params[{k!r}] mixes numpy and cupy arrays with the other "
                                "parameters; lowbit never moves data between host and device")
            if g.dtype != p.dtype:
                raise TypeError(f"grads[{k!r}] must have its parameter's dtype {p.dtype}, got "
                                f"{g.dtype}")
            if g.shape != p.shape:
                raise _validate.shape_error(f"grads[{k!r}]", p.shape, g.shape,
                                            "its parameter's")
            if not p.flags.c_contiguous:
                raise ValueError(f"params[{k!r}] must be C-contiguous (it is updated in place)")
            if not _is_cupy(p) and not p.flags.writeable:
                raise ValueError(f"params[{k!r}] must be writeable (it is updated in place)")
            flat_grads[k] = g
        if self._step > 0 or self._exp_avg:
            problem = _key_difference("params", set(names), set(self._exp_avg),
                                      "the optimizer's state (its earlier steps or loaded state)")
            if problem:
                raise problem
            for k in names:
                m = self._exp_avg[k]
                if m.shape != params[k].shape:
                    raise _validate.shape_error(f"params[{k!r}]", m.shape, params[k].shape,
                                                "its state's (exp_avg)")
                if _is_cupy(m) != _is_cupy(params[k]):
                    raise TypeError(f"params[{k!r}] must be the array kind of its state "
                                    f"exp_avg ({type(m).__module__}); load a state of that "
                                    "kind (lowbit never moves data between host and device)")
        _check_disjoint(params, grads, names)
        # Grads of any layout are read through a contiguous copy (never written).
        return names, {k: _backend.array_module(g).ascontiguousarray(g).reshape(-1)
                       for k, g in flat_grads.items()}

    def step(self, params: Mapping[str, Array], grads: Mapping[str, Array]) -> None:
        """One AdamW step: updates every ``params[k]`` IN PLACE.

        Args:
            params: dict name (str) -> float32/float64 array (numpy or cupy, one kind for all),
                C-contiguous and writeable.
            grads: dict with the same keys; each the shape, dtype and array kind of its
                parameter (any layout). Read only.

        Raises:
            TypeError: not dicts, non-str keys, non-arrays, a non-float dtype, a grad of another
                dtype or array kind, mixed numpy/cupy.
            ValueError: differing key sets (the missing and extra keys are named), a shape
                mismatch, a non-contiguous or read-only parameter, parameters sharing memory,
                keys or shapes other than those of the optimizer's state, a ``no_decay`` name
                that is not a key of ``params``, or a non-finite gradient (named). Nothing is
                modified when it raises.
        """
        names, flat = self._validated(params, grads)
        _, impl = _dispatch.resolve("adamw", *(params[k] for k in names), *flat.values())

        # Every gradient is read once for its sum of squares before anything is written: it
        # gives the global norm and proves the gradients finite (a NaN or inf makes the sum
        # non-finite). A finite float64 gradient whose square overflows is told apart by an
        # explicit check; with clipping on, its infinite norm zeroes the gradients, as in torch.
        sums = [impl.sum_squares(flat[k]) for k in names]
        host = np.zeros(0)
        if sums:
            xp = _backend.array_module(sums[0])
            host = xp.concatenate(sums)
            host = host.get() if _is_cupy(host) else host
        total = 0.0
        for k, s in zip(names, host.tolist()):
            if not math.isfinite(s):
                g = flat[k]
                if not bool(_backend.array_module(g).isfinite(g).all()):
                    raise ValueError(f"grads[{k!r}] must be finite, got NaN or inf values; "
                                     "nothing was updated")
            total += s

        grad_scale = 1.0
        grad_norm = None
        if self._max_grad_norm is not None:
            grad_norm = math.sqrt(total)
            grad_scale = min(self._max_grad_norm / (grad_norm + CLIP_EPS), 1.0)

        for k in names:
            if k not in self._exp_avg:
                xp = _backend.array_module(params[k])
                self._exp_avg[k] = xp.zeros(params[k].shape, dtype=np.float32)
                self._exp_avg_sq[k] = xp.zeros(params[k].shape, dtype=np.float32)
        self._step += 1
        beta1, beta2 = self._betas
        bias1 = 1.0 - beta1 ** self._step
        bias2 = 1.0 - beta2 ** self._step
        for k in names:
            decay = 0.0 if k in self._no_decay else self._weight_decay
            impl.step(params[k].reshape(-1), flat[k], self._exp_avg[k].reshape(-1),
                      self._exp_avg_sq[k].reshape(-1), self._lr, beta1, beta2, self._eps,
                      decay, bias1, bias2, grad_scale)
        self._last_grad_norm = grad_norm

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The optimizer's state: plain Python data and copies of the moment arrays.

        Returns:
            ``{"step": int, "lr": float, "betas": (float, float), "eps": float,
            "weight_decay": float, "max_grad_norm": float | None, "no_decay": (str, ...),
            "exp_avg": {name: array},
            "exp_avg_sq": {name: array}}``; the moments float32, shaped like the parameters, on
            the parameters' array module. Later steps do not change the returned arrays.
        """
        return {
            "step": self._step, "lr": self._lr, "betas": self._betas, "eps": self._eps,
            "weight_decay": self._weight_decay, "max_grad_norm": self._max_grad_norm,
            "no_decay": self._no_decay, "exp_avg": {k: v.copy() for k, v in self._exp_avg.items()},
            "exp_avg_sq": {k: v.copy() for k, v in self._exp_avg_sq.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a ``state_dict()``: step count, hyperparameters and (copies of) the moments.

        A state without ``no_decay`` (written before the option existed, as in older
        checkpoints) loads as ``no_decay=()``: decay on every parameter, as when it was written.

        Raises:
            TypeError, ValueError: another set of keys, a bad value, moments that are not
                float32 arrays, ``exp_avg`` and ``exp_avg_sq`` with other names or shapes, or
                (when this optimizer already holds moments) names or shapes other than its
                own. The optimizer is unchanged when it raises.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        problem = _key_difference("state", set(state) | _OPTIONAL_STATE_KEYS,
                                  _STATE_KEYS, "a state_dict()")
        if problem:
            raise problem
        step = _validate.integer(state["step"], "state['step']", minimum=0)
        lr = _nonnegative(state["lr"], "state['lr']")
        betas = _betas(state["betas"], "state['betas']")
        eps = _eps(state["eps"], "state['eps']")
        weight_decay = _nonnegative(state["weight_decay"], "state['weight_decay']")
        max_grad_norm = _max_grad_norm(state["max_grad_norm"], "state['max_grad_norm']")
        no_decay = _no_decay(state.get("no_decay", ()), "state['no_decay']")
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        names = _names(exp_avg, "state['exp_avg']")
        problem = _key_difference("state['exp_avg_sq']", _names(exp_avg_sq,
                                  "state['exp_avg_sq']"), names, "state['exp_avg']")
        if problem:
            raise problem
        if step == 0 and names:
            raise ValueError("state['step'] is 0 but the state holds moments; a state before "
                             "the first step has none")
        kinds = set()
        for k in sorted(names):
            for label, arr in ((f"state['exp_avg'][{k!r}]", exp_avg[k]),
                               (f"state['exp_avg_sq'][{k!r}]", exp_avg_sq[k])):
                _validate.as_array(arr, label)
                if arr.dtype != np.float32:
                    raise TypeError(f"{label} must be float32, got {arr.dtype}")
                kinds.add(_is_cupy(arr))
            if exp_avg_sq[k].shape != exp_avg[k].shape:
                raise _validate.shape_error(f"state['exp_avg_sq'][{k!r}]", exp_avg[k].shape,
                                            exp_avg_sq[k].shape, "its exp_avg's")
        if len(kinds) > 1:
            raise TypeError("state['exp_avg'] and state['exp_avg_sq'] mix numpy and cupy arrays")
        unknown = sorted(set(no_decay) - names)
        if names and unknown:
            raise ValueError(f"state['no_decay'] names {unknown}, which have no moments in "
                             f"state['exp_avg'] ({sorted(names)})")
        if self._step > 0 or self._exp_avg:
            problem = _key_difference("state['exp_avg']", names, set(self._exp_avg),
                                      "this optimizer's moments")
            if problem:
                raise problem
            for k in sorted(names):
                if exp_avg[k].shape != self._exp_avg[k].shape:
                    raise _validate.shape_error(f"state['exp_avg'][{k!r}]",
                                                self._exp_avg[k].shape, exp_avg[k].shape,
                                                "this optimizer's moment")
        # Copies in C order: later steps write the optimizer's moments in place and must not
        # change the caller's state.
        new_m = {k: _backend.array_module(exp_avg[k]).array(exp_avg[k], order="C", copy=True)
                 for k in names}
        new_v = {k: _backend.array_module(exp_avg_sq[k]).array(exp_avg_sq[k], order="C",
                                                               copy=True) for k in names}
        self._step, self._lr, self._betas, self._eps = step, lr, betas, eps
        self._weight_decay, self._max_grad_norm = weight_decay, max_grad_norm
        self._no_decay = no_decay
        self._exp_avg, self._exp_avg_sq = new_m, new_v
        self._last_grad_norm = None

