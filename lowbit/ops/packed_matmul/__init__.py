"""Packed low-bit matmul and the straight-through (BitNet-style) linear layer.

``packed_matmul(x, pw, act_format)`` multiplies activations by a ``lowbit.PackedWeight``;
``linear_forward`` / ``linear_backward`` train through quantization with a straight-through
estimator. Backends: ``_numpy.py``, ``_numba/`` (a package), ``_cuda.py`` (kernels in
``cuda/packed_matmul.cu``); formats in ``lowbit/ops/quantize``; reference
``reference/packed_matmul.py``; tests ``tests/test_packed_matmul.py``; benchmark
``bench/matmul.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ..quantize import (PackedWeight, _rows, _weight_input, check_act_format, checked_packed,
                        check_weight_format, quantize_rows, quantize_weight)
from ..saved_activation import SavedConfig, save, saved_policy


def _optional_act(act_format):
    return None if act_format is None else check_act_format(act_format)


def _packed(pw):
    if not isinstance(pw, PackedWeight):
        raise TypeError(f"pw must be a lowbit.PackedWeight (from lowbit.quantize_weight), "
                        f"got {type(pw).__name__}")
    return checked_packed(pw, "pw")


def _matching_k(x, K, xname, wname):
    if x.shape[-1] != K:
        raise ValueError(f"{xname} has K = {x.shape[-1]} in its last axis but {wname} has "
                         f"K = {K} rows (shape (K, N)); they must agree")


def _float32_rows(x):
    xp = _backend.array_module(x)
    return xp.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)


def packed_matmul(x: Array, pw: PackedWeight, act_format: str | None = "int8") -> Array:
    """``y = Qa(x) @ W`` with ``W`` the dequantized packed weight: the inference form of
    ``linear_forward`` (quantize the weight once with ``lowbit.quantize_weight``).

    Precision: the kernels compute in float32 whatever the dtype of ``x``; a float64 ``x``
    gives a float64 ``y`` holding those float32 values.

    Args:
        x: [..., K] float32 or float64 (numpy or cupy, the kind of ``pw.data``).
        pw: ``lowbit.PackedWeight`` of shape (K, N) (in x out).
        act_format: "int8"/"int4": the rows of ``x`` are quantized
            (``lowbit.quantize_activation``), ``acc = codes_x @ codes_w`` is exact in int32 and
            ``y = acc * scale_x[..., None] * scale_w`` in float32; None: ``y = (x @ codes_w) *
            scale_w`` with float32 accumulation.

    Returns:
        [..., N] of ``x``'s dtype.

    Raises:
        TypeError: ``x`` not a float array, ``pw`` not a PackedWeight, numpy/cupy mixed.
        ValueError: ``x`` 0-d, K mismatch, unknown ``act_format``, non-finite ``x``.
    """
    x = _rows(x, "x")
    pw = _packed(pw)
    act = _optional_act(act_format)
    _matching_k(x, pw.shape[0], "x", "pw")
    _backend.array_kind(x, pw.data)
    y, _, _ = _forward(x, pw, act)
    return y.reshape(x.shape[:-1] + (pw.shape[1],)).astype(x.dtype, copy=False)


def _forward(x, pw, act):
    """y [M, N] float32 for validated inputs; also the activation codes and scales, if any."""
    K = pw.shape[0]
    if act is not None:
        codes, scale = quantize_rows(x, act)
        codes, scale = codes.reshape(-1, K), scale.reshape(-1)
        return straight_through_codes(codes, scale, None, pw), codes, scale
    _validate.all_finite(x, "x")
    rows = _float32_rows(x)
    _, impl = _dispatch.resolve("packed_matmul", rows, pw.data)
    return impl.matmul_float(rows, pw.data, pw.scale, pw.format, K), None, None


def activation_codes(x, act):
    """Validated per-row activation codes of ``x`` [..., K] as rows: ``(codes [M, K] int8,
    scale [M] float32)``."""
    K = x.shape[-1]
    codes, scale = quantize_rows(x, act)
    return codes.reshape(-1, K), scale.reshape(-1)


def straight_through_forward(x, w32, pw, act):
    """``y = Qa(x) @ Qw(w)``: the forward of every straight-through projection.

    ``linear_forward`` and the BDH layer's projections both run this, so the two cannot drift.

    Args:
        x: [..., K] float32 or float64, validated by the caller (finiteness is checked here).
        w32: [K, N] float32 master weight (used when ``pw`` is None).
        pw: the ``PackedWeight`` of ``w`` (the packed kernels run), or None (no weight
            quantization).
        act: activation format or None.

    Returns:
        ``(y, codes, scale)``: y [M, N] float32 (leading axes of ``x`` flattened); with ``act``
        the activation codes [M, K] int8 and row scales [M] float32 the backward needs, else
        ``(y, None, None)``.
    """
    if pw is not None:
        return _forward(x, pw, act)
    if act is not None:
        codes, scale = activation_codes(x, act)
        return straight_through_codes(codes, scale, w32, None), codes, scale
    _validate.all_finite(x, "x")
    return _float32_rows(x) @ w32, None, None


def straight_through_codes(codes, scale, w32, pw):
    """``y = Qa(x) @ Qw(w)`` from activation codes kept by ``straight_through_forward``: the same
    kernels on the same codes, so the same bits (a backward recomputes a projection with it).

    Args:
        codes: [M, K] int8 activation codes; scale: [M] float32 row scales.
        w32: [K, N] float32 master weight (used when ``pw`` is None); pw: its ``PackedWeight``.

    Returns:
        y [M, N] float32.
    """
    if pw is None:
        return (codes.astype(np.float32) @ w32) * scale[:, None]
    _, impl = _dispatch.resolve("packed_matmul", codes, pw.data)
    return impl.matmul_int(codes, scale, pw.data, pw.scale, pw.format, pw.shape[0])


#: Gradient formats of the straight-through backward besides None (exact float32 products).
GRAD_FORMATS = ("int8",)


def _grad_format(grad_format, quantized):
    """Validated ``grad_format``; ``quantized``: whether weight and activations have codes."""
    if grad_format is None:
        return None
    if not isinstance(grad_format, str) or grad_format not in GRAD_FORMATS:
        raise ValueError(f"grad_format must be None or one of {GRAD_FORMATS}, "
                         f"got {grad_format!r}")
    if not quantized:
        raise ValueError(f"grad_format={grad_format!r} needs a weight_format and an act_format: "
                         f"its integer products take the weight and activation codes")
    return grad_format


def straight_through_backward(dy, w32, pw, a, scale_a, grad_format=None):
    """Straight-through backward of ``straight_through_forward``: ``(dx, dw)`` float32.

    ``dx = dy @ Qw(w).T`` runs on the packed dx kernels when ``pw`` is given (for ternary and
    sign a signed sum of ``dy`` entries times the one scale); ``dw = Qa(x).T @ dy``. The
    quantizers' own derivatives are taken as the identity. With ``grad_format="int8"`` both
    products take int8 codes of ``dy`` instead (``_int8_gradients``).

    Args:
        dy: [M, N] float32 rows.
        w32: [K, N] float32 master weight (used when ``pw`` is None); pw: its ``PackedWeight``
            or None.
        a: [M, K] int8 activation codes with ``scale_a`` [M] float32, or the float32 input rows
            with ``scale_a`` None.
        grad_format: None (exact float32 products) or "int8" (needs ``pw`` and codes ``a``).

    Returns:
        dx [M, K], dw [K, N].
    """
    grad_format = _grad_format(grad_format, pw is not None and scale_a is not None)
    g = _float32_rows(dy)
    if grad_format is not None:
        return _int8_gradients(g, pw, a, scale_a)
    if pw is not None:
        _, impl = _dispatch.resolve("packed_matmul", g, pw.data)
        dx = impl.matmul_dx(g, pw.data, pw.scale, pw.format, pw.shape[0])
    else:
        _, impl = _dispatch.resolve("packed_matmul", g)
        dx = g @ w32.T
    return dx, impl.matmul_dw(g, a, scale_a)


def _int8_gradients(g, pw, a, scale_a):
    """``(dx, dw)`` from int8 codes of the gradient, exact integer products and float32 scales.

    dx: each row of ``g`` (times an int8 weight's column scales, which sit inside the sum over N)
    is quantized like an activation row, so its scale factors out of the row's sums:
    ``dx = float32(codes_g @ codes_w.T) * scale_g[:, None] * scale_w``. dw sums over rows whose
    activation scales differ, so the column ``scale_a[m] * g[m, n]`` over m is quantized instead:
    ``dw = float32(codes_a.T @ codes_c) * scale_c`` (the packed matmul with the column codes as an
    int8 weight).
    """
    xp = _backend.array_module(g)
    K, M = pw.shape[0], g.shape[0]
    per_tensor = pw.scale.ndim == 0
    rows, scale_g = quantize_rows(g if per_tensor else g * pw.scale, "int8", "dy")
    _, impl = _dispatch.resolve("packed_matmul", rows, pw.data)
    dx = impl.matmul_dx_int(rows, scale_g, pw.data, pw.scale if per_tensor else np.float32(1),
                            pw.format, K)
    cols, scale_c = quantize_rows(xp.ascontiguousarray((g * scale_a[:, None]).T), "int8", "dy")
    dw = impl.matmul_int(xp.ascontiguousarray(a.T), xp.ones(K, np.float32), cols, scale_c,
                         "int8", M)
    return dx, dw


@dataclasses.dataclass(frozen=True)
class LinearCtx(_ctx.Ctx):
    """What ``linear_backward`` needs from ``linear_forward``.

    Attributes:
        weight_format, act_format: the formats of the forward (either may be None).
        x_shape: shape of the forward input ``x`` [..., K].
        weight: the float master weight [K, N] in the compute dtype (float32; float64 for an
            unquantized layer with a float64 input; a parameter: not counted).
        packed: its ``PackedWeight`` (None when ``weight_format`` is None; not counted).
        act_codes, act_scale: with an activation format, the int8 codes [M, K] and float32 row
            scales [M] the forward used, saved exactly.
        act: without one, the input [M, K] in the compute dtype, saved through the ``saved``
            policy.
        dtype: the dtype of the forward output ``y`` (``dy`` must have it).
        x_dtype, w_dtype: the dtypes of ``x`` and ``w`` (those of ``dx`` and ``dw``).
    """

    weight_format: str | None
    act_format: str | None
    x_shape: tuple
    weight: Array
    packed: PackedWeight | None
    act_codes: _ctx.Saved | None
    act_scale: _ctx.Saved | None
    act: _ctx.Saved | None
    dtype: np.dtype
    x_dtype: np.dtype
    w_dtype: np.dtype


def linear_forward(x: Array, w: Array, weight_format: str | None,
                   act_format: str | None = "int8", *,
                   saved: str | SavedConfig | None = None) -> tuple[Array, LinearCtx]:
    """Forward of a quantization-aware linear layer: ``y = Qa(x) @ Qw(w)``.

    Q quantizes then dequantizes (``None``: no quantization on that side); the product runs in the
    packed kernels of ``packed_matmul``. The weight layout is ``(K, N)`` = (in features, out
    features), ``y = x @ w``: the transpose of ``torch.nn.Linear.weight``.

    Precision: with a weight or an activation format the products run in float32 (exact int32
    sums of codes with an activation format); with neither, in the dtype ``y`` gets (float64
    when ``x`` or ``w`` is float64). ``y`` has the dtype NumPy's ``x @ w`` would have.

    Args:
        x: [..., K] float32 or float64.
        w: [K, N] float32 or float64 master weight.
        weight_format: "ternary", "sign", "int8" or None.
        act_format: "int8", "int4" or None.
        saved: how the input is saved when ``act_format`` is None (None: exact; a format or
            ``lowbit.SavedConfig``: through the saved-activation packer). With an activation
            format the int8 codes and row scales are what the backward needs and they are saved
            exactly (a quarter of fp32), so ``saved`` must then be None.

    Returns:
        ``(y, ctx)``: y [..., N] of ``result_type(x, w)`` and a ``LinearCtx``.

    Raises:
        TypeError / ValueError: bad arrays, formats or non-finite input, naming the argument;
            ValueError naming ``saved`` when it is given together with an ``act_format``.
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    x = _rows(x, "x")
    w = _weight_input(w, "w")
    wf = None if weight_format is None else check_weight_format(weight_format)
    act = _optional_act(act_format)
    if saved is not None and act is not None:
        raise ValueError(f"saved must be None with act_format={act!r}: the backward takes the "
                         f"int8 activation codes, which are saved exactly; saved= applies to "
                         f"the float input of act_format=None")
    _matching_k(x, w.shape[0], "x", "w")
    xp = _backend.array_module(x, w)
    K, N = w.shape
    dtype = np.result_type(x.dtype, w.dtype)
    exact64 = wf is None and act is None and dtype == np.float64
    w_c = xp.ascontiguousarray(w, dtype=np.float64 if exact64 else np.float32)
    if wf is None:  # quantize_weight checks a weight it packs (its scale carries any NaN/inf)
        _validate.all_finite(w_c, "w")
    pw = quantize_weight(w, wf) if wf is not None else None
    if exact64:
        _validate.all_finite(x, "x")
        rows = xp.ascontiguousarray(x.reshape(-1, K), dtype=np.float64)
        y, codes, scale = rows @ w_c, None, None
    else:
        y, codes, scale = straight_through_forward(x, w_c, pw, act)
        rows = _float32_rows(x) if act is None else None
    ctx = LinearCtx(
        weight_format=wf, act_format=act, x_shape=tuple(x.shape), weight=w_c, packed=pw,
        act_codes=None if codes is None else save(codes, None),
        act_scale=None if scale is None else save(scale, None),
        act=None if rows is None else save(rows, saved, kind="values"),
        dtype=dtype, x_dtype=x.dtype, w_dtype=w.dtype,
    )
    return y.reshape(x.shape[:-1] + (N,)).astype(dtype, copy=False), ctx


def linear_backward(dy: Array, ctx: LinearCtx, *,
                    grad_format: str | None = None) -> tuple[Array, Array]:
    """Straight-through backward of ``linear_forward``.

    ``dx = dy @ Qw(w).T`` from the packed weight: for ternary and sign a signed sum of ``dy``
    entries times the one scale (the CUDA kernel adds and subtracts; on the CPU the codes in
    {-1, 0, 1}, decoded to float32, multiply exactly: numba's AVX-512 tiles decode them on the
    fly, otherwise BLAS takes decoded tiles). ``dw = Qa(x).T @ dy``
    from what the ctx saved, leading axes flattened. The quantizers' own derivatives are taken as
    the identity (straight-through estimator).

    With ``grad_format="int8"`` (opt-in; needs a weight and an activation format) ``dy`` is
    quantized to int8 and both products run as exact integer sums of codes: ``dx`` from the rows
    of ``dy`` quantized per row (an int8 weight's column scales applied first), ``dw`` from the
    columns of ``scale_a[:, None] * dy`` quantized per column, so that each scale factors out of
    its sum (``reference/packed_matmul.py``'s ``linear_bwd_int8_ref`` spells it out). An
    approximation of the exact gradients (``bench/matmul.py`` reports their cosine).

    Precision: that of the forward (float32 products for a quantized layer, the output dtype
    for an unquantized one); ``dx`` and ``dw`` are returned in the dtypes of ``x`` and ``w``.

    Args:
        dy: [..., N], the shape and dtype of the forward output.
        ctx: the ``LinearCtx`` from ``linear_forward``.
        grad_format: None (exact float32 products) or "int8".

    Returns:
        ``(dx, dw)``: dx of ``x``'s shape and dtype, dw [K, N] of ``w``'s dtype.

    Raises:
        TypeError: ``ctx`` not a LinearCtx, ``dy`` not an array of the forward output's dtype.
        ValueError: ``dy`` of the wrong shape, an unknown ``grad_format`` or one the ctx's formats
            cannot take, a non-finite ``dy`` with ``grad_format``.
    """
    if not isinstance(ctx, LinearCtx):
        raise TypeError(f"ctx must be the LinearCtx from lowbit.linear_forward, "
                        f"got {type(ctx).__name__}")
    grad_format = _grad_format(grad_format,
                               ctx.packed is not None and ctx.act_format is not None)
    dy = _validate.as_array(dy, "dy")
    _validate.floating(dy, "dy")
    _validate.grad_dtype(dy, ctx.dtype, "dy")
    K, N = ctx.weight.shape
    expected = ctx.x_shape[:-1] + (N,)
    _validate.shape(dy, expected, "dy", "the forward output's")
    xp = _backend.array_module(dy, ctx.weight)
    if ctx.act_codes is not None and ctx.act_scale is not None:  # an activation format
        a, scale_a = ctx.act_codes.unpack(), ctx.act_scale.unpack()
    elif ctx.act is not None:
        a = xp.ascontiguousarray(ctx.act.unpack().reshape(-1, K), dtype=ctx.weight.dtype)
        scale_a = None
    else:  # pragma: no cover - linear_forward always saves one of them
        raise TypeError("ctx holds neither activation codes nor the input")
    if ctx.weight.dtype == np.float64:  # the unquantized float64 layer: float64 products
        g = xp.ascontiguousarray(dy.reshape(-1, N))
        dx, dw = g @ ctx.weight.T, a.T @ g
    else:
        dx, dw = straight_through_backward(dy, ctx.weight, ctx.packed, a, scale_a, grad_format)
    return (dx.reshape(ctx.x_shape).astype(ctx.x_dtype, copy=False),
            dw.astype(ctx.w_dtype, copy=False))
