"""Reference BDH language model: float64, composed of the reference layers, written plainly.

Checked against: ``lowbit/models/bdh/`` in ``tests/test_bdh.py``; this file's backward is
checked there against central finite differences of its own loss (full precision), and with a
low-bit plan it applies the same straight-through rule as ``reference/lowrank_residual.py``.

    x0 = embed[ids];  x = LN(x0);  x = layer(x) n_layer times (shared weights);
    logits = x @ lm_head;  loss = mean over positions of logsumexp(logits) - logits[target]
"""

from __future__ import annotations

import numpy as np

from .lowrank_residual import layer_norm_bwd_ref, layer_norm_ref, lowrank_residual_bwd_ref
from .lowrank_residual import lowrank_residual_ref


def _layer_kwargs(plan, dropout, seed, latent_mask):
    return dict(plan=plan, dropout=dropout, seed=seed, latent_mask=latent_mask)


def bdh_ref(params, ids, targets, *, level_seeds, plan=None, dropout=0.0, latent_mask=None,
            return_cache=False):
    """Float64 mean cross-entropy of the model.

    Args:
        params: dict of ``embed [V, D]``, ``encoder [H, D, N]``, ``encoder_v``, ``decoder
            [H * N, D]``, ``lm_head [D, V]``.
        ids, targets: [B, T] integer arrays.
        level_seeds: the dropout seed of each level (its length is ``n_layer``).
        latent_mask: [H, N] bool active latent neurons of every level (None: all).
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    ids = np.asarray(ids)
    B, T = ids.shape
    x0 = np.zeros((B, T, p["embed"].shape[1]))
    for b in range(B):
        for t in range(T):
            x0[b, t] = p["embed"][ids[b, t]]
    x = layer_norm_ref(x0)
    inputs = []
    for seed in level_seeds:
        inputs.append(x)
        x = lowrank_residual_ref(x, p["encoder"], p["encoder_v"], p["decoder"],
                                 **_layer_kwargs(plan, dropout, seed, latent_mask))
    rows = x.reshape(B * T, -1)
    logits = rows @ p["lm_head"]
    t = np.asarray(targets).reshape(-1)
    total = 0.0
    for m in range(B * T):
        z = logits[m]
        top = z.max()
        total += top + np.log(np.exp(z - top).sum()) - z[t[m]]
    loss = total / (B * T)
    if not return_cache:
        return loss
    return loss, dict(p=p, x0=x0, inputs=inputs, rows=rows, logits=logits, targets=t)


def bdh_bwd_ref(params, ids, targets, *, level_seeds, plan=None, dropout=0.0, latent_mask=None):
    """Float64 gradients of ``bdh_ref`` as a dict with the parameters' names."""
    _, c = bdh_ref(params, ids, targets, level_seeds=level_seeds, plan=plan, dropout=dropout,
                   latent_mask=latent_mask, return_cache=True)
    p = c["p"]
    ids = np.asarray(ids)
    B, T = ids.shape
    M = B * T
    z = c["logits"] - c["logits"].max(axis=1, keepdims=True)
    soft = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    dlogits = soft.copy()
    for m in range(M):
        dlogits[m, c["targets"][m]] -= 1.0
    dlogits /= M
    grads = {"lm_head": c["rows"].T @ dlogits}
    dx = (dlogits @ p["lm_head"].T).reshape(B, T, -1)
    denc = np.zeros(p["encoder"].shape)
    dencv = np.zeros(p["encoder_v"].shape)
    ddec = np.zeros(p["decoder"].shape)
    for x, seed in zip(reversed(c["inputs"]), reversed(list(level_seeds))):
        dx, de, dev, dd = lowrank_residual_bwd_ref(dx, x, p["encoder"], p["encoder_v"],
                                                   p["decoder"],
                                                   **_layer_kwargs(plan, dropout, seed,
                                                                   latent_mask))
        denc += de
        dencv += dev
        ddec += dd
    dx0 = layer_norm_bwd_ref(dx, c["x0"])
    dembed = np.zeros(p["embed"].shape)
    for b in range(B):
        for t in range(T):
            dembed[ids[b, t]] += dx0[b, t]
    grads.update(embed=dembed, encoder=denc, encoder_v=dencv, decoder=ddec)
    return grads
