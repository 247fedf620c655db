"""Float64 reference of the AdamW optimizer step, in explicit loops (standalone: no lowbit imports).

The op: ``lowbit/ops/adamw``; kernels: ``cuda/adamw.cu``; tests: ``tests/test_adamw.py``.
Semantics of ``torch.optim.AdamW`` (decoupled weight decay, bias correction) with optional
global-norm clipping as ``torch.nn.utils.clip_grad_norm_`` does it.
"""

from __future__ import annotations

import math

import numpy as np

#: Added to the total norm before dividing (as ``clip_grad_norm_`` does).
CLIP_EPS = 1e-6


def adamw_ref(params, grads, state=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
              weight_decay=0.01, max_grad_norm=None, no_decay=()):
    """One AdamW step in float64; nothing passed in is modified.

    Args:
        params: dict name -> array (any float dtype), the parameters before the step.
        grads: dict with the same keys, arrays of the same shapes.
        state: ``{"step": int, "exp_avg": {name: array}, "exp_avg_sq": {name: array}}`` from an
            earlier call, or None before the first step (moments start at zero).
        lr, betas, eps, weight_decay: the AdamW hyperparameters.
        max_grad_norm: clip the global gradient 2-norm to this value first, or None.
        no_decay: names of the parameters whose weight decay is 0 (the others use
            ``weight_decay``); every name must be a key of ``params``.

    Returns:
        ``(new_params, new_state, grad_norm)``: float64 arrays shaped like the params, the state
        after the step (float64 moments), and the global norm of the unclipped gradients (None
        when clipping is off).
    """
    beta1, beta2 = betas
    names = sorted(params)
    for k in no_decay:
        if k not in params:
            raise ValueError(f"no_decay names {k!r}, not a parameter")
    step = (0 if state is None else state["step"]) + 1
    flat_grads = {k: np.asarray(grads[k], dtype=np.float64).reshape(-1) for k in names}

    scale = 1.0
    grad_norm = None
    if max_grad_norm is not None:
        total = 0.0
        for k in names:
            for g in flat_grads[k]:
                total += g * g
        grad_norm = math.sqrt(total)
        coef = max_grad_norm / (grad_norm + CLIP_EPS)
        scale = min(coef, 1.0)

    bias1 = 1.0 - beta1 ** step
    bias2 = 1.0 - beta2 ** step
    new_params, new_m, new_v = {}, {}, {}
    for k in names:
        p = np.asarray(params[k], dtype=np.float64).reshape(-1).copy()
        if state is None:
            m = np.zeros_like(p)
            v = np.zeros_like(p)
        else:
            m = np.asarray(state["exp_avg"][k], dtype=np.float64).reshape(-1).copy()
            v = np.asarray(state["exp_avg_sq"][k], dtype=np.float64).reshape(-1).copy()
        decay = 0.0 if k in no_decay else weight_decay
        for i in range(p.size):
            g = flat_grads[k][i] * scale
            p[i] = p[i] * (1.0 - lr * decay)
            m[i] = beta1 * m[i] + (1.0 - beta1) * g
            v[i] = beta2 * v[i] + (1.0 - beta2) * g * g
            m_hat = m[i] / bias1
            v_hat = v[i] / bias2
            p[i] = p[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
        shape = np.shape(params[k])
        new_params[k] = p.reshape(shape)
        new_m[k] = m.reshape(shape)
        new_v[k] = v.reshape(shape)
    return new_params, {"step": step, "exp_avg": new_m, "exp_avg_sq": new_v}, grad_norm
