"""The BDH ("Dragon Hatchling") byte-level language model, composed only of public lowbit ops.

The model of pathwaycom/bdh's ``bdh.py`` (arXiv 2509.26507), written from its equations: a byte
embedding, layer norm, ``n_layer`` applications of one low-rank residual step with shared weights
(``lowbit.lowrank_residual_forward``: ReLU encoder, rotary linear attention with Q = K and
strictly causal scores, values = the step's input, LN, ReLU encoder_v, product, dropout, decoder,
``x = LN(x + LN(mlp))``), a full-precision ``lm_head`` and the mean cross-entropy. Every LN has
no affine parameters (eps 1e-5). The low-bit plan and the saved-activation policy apply to the
three projections of the step; ``embed`` and ``lm_head`` stay full precision, as in BitNet.

Parameters are a dict of arrays under the reference's names (``embed``, ``encoder``,
``encoder_v``, ``decoder``, ``lm_head``), numpy or cupy alike. Siblings: ``train.py`` (batches,
schedules, checkpoints, the training loop); the float64 reference of the whole model is
``reference/bdh.py``; tests ``tests/test_bdh.py``; the main job ``bench/train.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ContextManager

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ...ops.lowrank_residual._pattern import latent_pattern
from ...ops.cross_entropy import (CrossEntropyCtx, cross_entropy, cross_entropy_backward,
                                 cross_entropy_forward)
from ...ops.embedding import EmbeddingCtx, embedding, embedding_backward, embedding_forward
from ...ops.layer_norm import LayerNormCtx, layer_norm, layer_norm_backward, layer_norm_forward
from ...ops.lowrank_residual import (BlockPattern, LowBitPlan, LowrankResidualCtx,
                                    lowrank_residual, lowrank_residual_backward,
                                    lowrank_residual_forward, quantize_layer_weights)
from ...ops.packed_matmul import LinearCtx, linear_backward, linear_forward
from ...ops.saved_activation import SavedConfig

PARAMS = ("embed", "encoder", "encoder_v", "decoder", "lm_head")
#: Standard deviation of every initial parameter (the reference's normal_(std=0.02)).
INIT_STD = 0.02
#: Spreads (step seed, level) over the dropout hash's 32-bit seed, so levels drop differently.
LEVEL_SEED_MUL = 0x9E3779B1


@dataclasses.dataclass(frozen=True)
class BDHConfig:
    """The model's shape (pathwaycom/bdh's field names and defaults: 6 levels, D = 256, H = 4,
    multiplier 128, so N = 8192 per head) and lowbit's own fields.

    Attributes:
        n_layer: applications of the shared low-rank residual step.
        n_embd: D, the width of the residual stream.
        dropout: inverted-dropout probability on the step's product (0 turns it off).
        n_head: H.
        mlp_internal_dim_multiplier: N = multiplier * D // H latent neurons per head.
        vocab_size: 256 for bytes.
        plan: ``lowbit.LowBitPlan`` of the three projections (default: full precision).
        saved: saved-activation policy of every op (None: exact; a format or ``SavedConfig``).
        latent_pattern: a ``lowbit.BlockPattern`` over each head's N latent neurons (None:
            all): the step computes, saves and trains only the active blocks.
    """

    n_layer: int = 6
    n_embd: int = 256
    dropout: float = 0.1
    n_head: int = 4
    mlp_internal_dim_multiplier: int = 128
    vocab_size: int = 256
    plan: LowBitPlan = LowBitPlan()
    saved: str | SavedConfig | None = None
    latent_pattern: BlockPattern | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "mlp_internal_dim_multiplier", "vocab_size"):
            _validate.integer(getattr(self, name), name, minimum=1)
        if self.n_embd * self.mlp_internal_dim_multiplier % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide n_embd * "
                             f"mlp_internal_dim_multiplier ({self.n_embd} * "
                             f"{self.mlp_internal_dim_multiplier})")
        dropout = _validate.finite_scalar(self.dropout, "dropout")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        if not isinstance(self.plan, LowBitPlan):
            raise TypeError(f"plan must be a lowbit.LowBitPlan, got {type(self.plan).__name__}")
        from ...ops.saved_activation import saved_policy

        saved_policy(self.saved)
        latent_pattern(self.latent_pattern, self.n_head, self.n_latent, "causal_linear")

    @property
    def n_latent(self) -> int:
        """N, latent neurons per head."""
        return self.mlp_internal_dim_multiplier * self.n_embd // self.n_head

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameter shapes by name."""
        D, H, N, V = self.n_embd, self.n_head, self.n_latent, self.vocab_size
        return {"embed": (V, D), "encoder": (H, D, N), "encoder_v": (H, D, N),
                "decoder": (H * N, D), "lm_head": (D, V)}


def init_params(config: BDHConfig, seed: int = 0, xp: Any = np) -> dict[str, Array]:
    """Parameters drawn as the reference draws them: normal, std 0.02, float32.

    Args:
        config: the model's ``BDHConfig``.
        seed: seed of the numpy generator (the draw is made on the host, so numpy and cupy
            parameters from one seed are equal).
        xp: ``numpy`` or ``cupy``, the array module of the returned arrays.
    """
    rng = np.random.default_rng(_validate.integer(seed, "seed", minimum=0))
    return {name: xp.asarray((rng.standard_normal(shape) * INIT_STD).astype(np.float32))
            for name, shape in config.shapes().items()}


@dataclasses.dataclass(frozen=True)
class BDHCtx(_ctx.Ctx):
    """What ``backward`` needs: the ctx of every op of the forward, in order (``nbytes``,
    ``dense_nbytes`` and ``lowbit.memory_report`` walk them)."""

    config: BDHConfig
    shapes: dict[str, tuple[int, ...]]
    embed: EmbeddingCtx
    norm: LayerNormCtx
    levels: list[LowrankResidualCtx]
    head: LinearCtx
    loss: CrossEntropyCtx


def _check_params(config: BDHConfig, params: object) -> None:
    if not isinstance(params, dict) or set(params) != set(PARAMS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params must be a dict with keys {list(PARAMS)}, got {got}")
    for name, shape in config.shapes().items():
        p = _validate.as_array(params[name], f"params[{name!r}]")
        _validate.shape(p, shape, f"params[{name!r}]", "the config's")
        if p.dtype != np.float32:
            raise TypeError(f"params[{name!r}] must be float32, got {p.dtype}")
    _backend.array_kind(*params.values())


def _ids(ids: Array, name: str, config: BDHConfig, like: Array) -> Array:
    ids = _validate.as_array(ids, name)
    if ids.ndim != 2 or 0 in ids.shape:
        raise ValueError(f"{name} must have shape [B, T] with B, T >= 1, got {tuple(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
    _backend.array_kind(ids, like)
    return ids


def _level_seed(seed: int, level: int) -> int:
    return (seed * LEVEL_SEED_MUL + level) % 2**32


def forward(config: BDHConfig, params: dict[str, Array], ids: Array, targets: Array, *,
            seed: int = 0, row_offset: int = 0) -> tuple[Array, BDHCtx]:
    """Mean next-byte cross-entropy of the model on ``ids``, keeping what ``backward`` needs.

    Args:
        config: the ``BDHConfig``.
        params: dict of float32 arrays (``PARAMS``), shapes ``config.shapes()``.
        ids: [B, T] integer array of bytes (values in ``[0, vocab_size)``).
        targets: [B, T] integer array, the byte after each position (``-100`` is ignored, as in
            ``lowbit.cross_entropy``).
        seed: keys the dropout masks of this call (vary it per step); unused without dropout.
        row_offset: global index of row 0 of ``ids`` in a larger batch: its dropout masks are
            those of that batch's rows (data-parallel ranks reproduce the one-process run).

    Returns:
        ``(loss, ctx)``: loss a 0-d float32 array (nats per byte), ctx a ``BDHCtx``.
    """
    _check_params(config, params)
    ids = _ids(ids, "ids", config, params["embed"])
    targets = _ids(targets, "targets", config, params["embed"])
    _validate.shape(targets, ids.shape, "targets", "ids'")
    seed = _validate.integer(seed, "seed", minimum=0)
    row_offset = _validate.integer(row_offset, "row_offset", minimum=0)
    with _numba_blas(params["embed"]):
        return _forward(config, params, ids, targets, seed, row_offset)


def _numba_blas(like: Array) -> ContextManager[None]:
    """One BLAS thread while the numba backend runs (``lowbit._backend.single_threaded_blas``)."""
    return _backend.single_threaded_blas(_dispatch.select_backend(like) == "numba")


def _forward(config: BDHConfig, params: dict[str, Array], ids: Array, targets: Array, seed: int,
             row_offset: int) -> tuple[Array, BDHCtx]:
    B, T = ids.shape
    emb, emb_ctx = embedding_forward(params["embed"], ids)
    x, norm_ctx = layer_norm_forward(emb, saved=config.saved)
    levels: list[LowrankResidualCtx] = []
    weights = params["encoder"], params["encoder_v"], params["decoder"]
    packed = quantize_layer_weights(*weights, config.plan)  # once: the levels share them
    for level in range(config.n_layer):
        # The layer takes a seed and a row offset only with dropout (they place its masks).
        masks: dict[str, Any] = (dict(seed=_level_seed(seed, level), row_offset=row_offset)
                                 if config.dropout else {})
        x, ctx = lowrank_residual_forward(
            x, *weights, plan=config.plan, saved=config.saved, dropout=config.dropout,
            packed=packed, latent_pattern=config.latent_pattern, **masks)
        levels.append(ctx)
    logits, head_ctx = linear_forward(x.reshape(B * T, config.n_embd), params["lm_head"], None,
                                      None, saved=config.saved)
    loss, loss_ctx = cross_entropy_forward(logits, targets.reshape(-1))
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    return loss, BDHCtx(config, shapes, emb_ctx, norm_ctx, levels, head_ctx, loss_ctx)


def backward(ctx: BDHCtx) -> dict[str, Array]:
    """Gradients of the forward's loss: a dict with the parameters' names, float32.

    The quantized projections pass gradients straight through (``lowbit.linear_backward``'s
    rule); the shared weights' gradients are summed over the levels.
    """
    if not isinstance(ctx, BDHCtx):
        raise TypeError(f"ctx must be the BDHCtx of lowbit.models.bdh.forward, got "
                        f"{type(ctx).__name__}")
    with _numba_blas(ctx.head.weight):
        return _backward(ctx)


def _backward(ctx: BDHCtx) -> dict[str, Array]:
    dlogits = cross_entropy_backward(1.0, ctx.loss)
    dx, dlm_head = linear_backward(dlogits, ctx.head)
    xp = _backend.array_module(dx)
    shapes = ctx.shapes
    grads = tuple(xp.zeros(shapes[n], np.float32) for n in ("encoder", "encoder_v", "decoder"))
    dx = dx.reshape(ctx.levels[0].shape[:3]) if ctx.levels else dx
    for level_ctx in reversed(ctx.levels):
        dx, *_ = lowrank_residual_backward(dx, level_ctx, accumulate=grads)
    demb = layer_norm_backward(dx, ctx.norm)
    dembed = embedding_backward(demb, ctx.embed)
    return {"embed": dembed, "encoder": grads[0], "encoder_v": grads[1], "decoder": grads[2],
            "lm_head": dlm_head}


def logits(config: BDHConfig, params: dict[str, Array], ids: Array) -> Array:
    """Inference: next-byte logits [B, T, vocab_size] float32 (no dropout, nothing saved)."""
    _check_params(config, params)
    ids = _ids(ids, "ids", config, params["embed"])
    B, T = ids.shape
    with _numba_blas(params["embed"]):
        x = layer_norm(embedding(params["embed"], ids))
        weights = params["encoder"], params["encoder_v"], params["decoder"]
        packed = quantize_layer_weights(*weights, config.plan)
        for _ in range(config.n_layer):
            x = lowrank_residual(x, *weights, plan=config.plan, packed=packed,
                                 latent_pattern=config.latent_pattern)
        return (x.reshape(B * T, -1) @ params["lm_head"]).reshape(B, T, -1)


def loss(config: BDHConfig, params: dict[str, Array], ids: Array, targets: Array) -> float:
    """Inference loss (no dropout, nothing saved): a Python float, nats per byte."""
    out = logits(config, params, ids)
    targets = _ids(targets, "targets", config, params["embed"])
    return float(cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1)))


def recurrent_logits(config: BDHConfig, params: dict[str, Array], ids: Array, *,
                     prefill: int = 0) -> Array:
    """The next-byte logits of ``logits`` computed by the recurrent form (``_recurrent.py``).

    The first ``prefill`` positions are read by one parallel pass (the full forward's layers,
    which also build the running states of the attention); every later position by one
    recurrent step, whose cost does not depend on the position. Equal to ``logits`` to float32
    rounding (the states sum the same products in another order).

    Args:
        config: the ``BDHConfig``; params: its float32 parameters.
        ids: [B, T] integer array of bytes, the array kind of ``params``.
        prefill: positions read by the parallel pass, in ``[0, T]``.

    Returns:
        [B, T, vocab_size] float32.

    Raises:
        TypeError, ValueError: bad params, ids or prefill (the message names the argument).
    """
    _check_params(config, params)
    ids = _ids(ids, "ids", config, params["embed"])
    prefill = _validate.integer(prefill, "prefill", minimum=0)
    if prefill > ids.shape[1]:
        raise ValueError(f"prefill must be at most T = {ids.shape[1]}, got {prefill}")
    from . import _recurrent

    return _recurrent.logits_all(config, params, ids, prefill)


def _prompts(config: BDHConfig, prompt: object) -> tuple[list[bytes], bool]:
    """``(prompts, single)``: one prompt (bytes) or a list/tuple of them, each non-empty and
    of bytes below ``vocab_size``."""
    single = isinstance(prompt, (bytes, bytearray))
    items = [prompt] if single else prompt
    if not isinstance(items, (list, tuple)) or not items:
        raise TypeError(f"prompt must be non-empty bytes or a non-empty list of them, got "
                        f"{type(prompt).__name__}")
    out = []
    for i, p in enumerate(items):
        name = "prompt" if single else f"prompt[{i}]"
        if not isinstance(p, (bytes, bytearray)) or not p:
            raise TypeError(f"{name} must be non-empty bytes, got {type(p).__name__}")
        if max(p) >= config.vocab_size:
            raise ValueError(f"{name} holds byte {max(p)}, not below vocab_size = "
                             f"{config.vocab_size}")
        out.append(bytes(p))
    return out, single


def _stop(config: BDHConfig, stop: Any) -> frozenset:
    if stop is None:
        return frozenset()
    if isinstance(stop, (str, float)):
        raise TypeError(f"stop must be None, bytes or an iterable of byte values, got "
                        f"{type(stop).__name__} {stop!r:.60}")
    try:
        values = [int(v) for v in (stop if not isinstance(stop, int) else [stop])]
    except (TypeError, ValueError):
        raise TypeError(f"stop must be None, bytes or an iterable of byte values, got "
                        f"{stop!r:.60}") from None
    if any(not 0 <= v < config.vocab_size for v in values):
        raise ValueError(f"stop must hold byte values in [0, {config.vocab_size}), got "
                         f"{stop!r:.60}")
    return frozenset(values)


def generate_stream(config: BDHConfig, params: dict[str, Array],
                    prompt: bytes | Sequence[bytes], n: int, *, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None,
                    stop: bytes | Iterable[int] | None = None, seed: int = 0,
                    recurrent: bool = True, context: int | None = None) -> Iterator:
    """Stream up to ``n`` bytes sampled after one prompt, or after several at once.

    ``recurrent=True`` (the default) reads each prompt in one parallel pass and then advances
    the attention's running state by one byte per step (``_recurrent.py``: the weights
    quantized once per call, constant work per byte whatever the context); ``recurrent=False``
    reruns ``logits`` over the whole context (or its last ``context`` bytes) for every byte, as
    before. Both sample from the same logits to float32 rounding.

    Args:
        config: the ``BDHConfig``; params: its float32 parameters (numpy or cupy).
        prompt: non-empty bytes, or a list of them (decoded together, one row each).
        n: the most bytes generated per prompt (>= 0).
        temperature: 0 is greedy (the first maximal logit); else the logits are divided by it.
        top_k: sample among the ``top_k`` most likely bytes only.
        top_p: then among the smallest set of most likely bytes whose probability reaches it.
        stop: byte values (bytes, or an iterable of ints) that end a sequence; the stop byte is
            not yielded. None: never stop early.
        seed: the sampler's seed (``numpy.random.default_rng``); one draw per running sequence
            per step, in sequence order.
        recurrent: the recurrent form (True) or the full-context rerun (False).
        context: with ``recurrent=False``, the model reads only the last ``context`` bytes
            (default: all). The recurrent state holds the whole sequence, so it takes no
            window: ``context`` with ``recurrent=True`` raises.

    Yields:
        one prompt: each new byte as ``bytes`` of length 1. Several: per step a tuple of B
        ``bytes`` (length 1, or ``b""`` for sequences that have stopped); it ends when all
        have stopped or after ``n`` steps.

    Raises:
        TypeError, ValueError: bad params, prompt, ``n``, sampling options, ``stop`` or
            ``context`` (raised by this call, before any byte is computed).
    """
    _check_params(config, params)
    if config.vocab_size > 256:
        raise ValueError(f"generation yields bytes: config.vocab_size must be at most 256, got "
                         f"{config.vocab_size}")
    from ..bitnet._generate import check_sampling  # the house rules of the samplers

    prompts, single = _prompts(config, prompt)
    n = _validate.integer(n, "n", minimum=0)
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p, config.vocab_size)
    seed = _validate.integer(seed, "seed", minimum=0)
    stops = _stop(config, stop)
    if not isinstance(recurrent, (bool, np.bool_)):
        raise TypeError(f"recurrent must be a bool, got {type(recurrent).__name__}")
    if context is not None:
        context = _validate.integer(context, "context", minimum=1)
        if recurrent:
            raise ValueError("context (a window of the last bytes) needs recurrent=False: the "
                             "recurrent state holds the whole sequence")
    from . import _recurrent

    return _recurrent.stream(config, params, prompts, n, temperature, top_k, top_p, seed,
                             stops, single, bool(recurrent), context)


def generate(config: BDHConfig, params: dict[str, Array], prompt: bytes | Sequence[bytes],
             n: int, *, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, stop: bytes | Iterable[int] | None = None,
             seed: int = 0, recurrent: bool = True,
             context: int | None = None) -> bytes | list[bytes]:
    """Sample up to ``n`` bytes after ``prompt``: ``generate_stream`` collected.

    Args:
        config, params, prompt, n, temperature, top_k, top_p, stop, seed, recurrent, context:
            as in ``generate_stream``.

    Returns:
        one prompt: the sampled bytes (without the prompt, without the stop byte). Several:
        a list of them, one per prompt.

    Raises:
        TypeError, ValueError: as ``generate_stream``.
    """
    steps = generate_stream(config, params, prompt, n, temperature=temperature, top_k=top_k,
                            top_p=top_p, stop=stop, seed=seed, recurrent=recurrent,
                            context=context)
    if isinstance(prompt, (bytes, bytearray)):
        return b"".join(steps)
    out = [b""] * len(prompt)
    for new in steps:
        out = [a + b for a, b in zip(out, new)]
    return out


# pathwaycom/bdh's torch state dict, converted without torch (``_torch.py``).
from ._torch import (from_torch_state_dict, infer_torch_config,  # noqa: E402,F401
                     to_torch_state_dict)
