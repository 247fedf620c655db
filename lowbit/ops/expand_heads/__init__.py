"""Head expansion for grouped attention: ``expand_heads`` (a repeat) and its backward (a sum).

Array-generic NumPy/CuPy code with no backend dispatch and no kernels: a repeat and a strided sum
are single library calls on both array modules, so there is nothing a hand-written kernel would
add. Reference: ``reference/segmented_attention.py`` (``expand_heads_ref``,
``expand_heads_bwd_ref``); tests: ``tests/test_expand_heads.py``. Used in the grouped order of
``lowbit.segmented_attention`` (query head ``h`` reads key/value head ``h // group``).
"""

from __future__ import annotations

from ... import _backend, _validate
from ..._typing import Array


def _split_shape(shape, axis, source_heads, repeat):
    return shape[:axis] + (source_heads, repeat) + shape[axis + 1:]


def expand_heads(x: Array, axis: int, target_heads: int) -> Array:
    """Repeat each head of ``x`` contiguously along ``axis`` up to ``target_heads`` heads.

    Args:
        x: array (numpy or cupy) with ``S = x.shape[axis]`` source heads, any dtype.
        axis: the head axis.
        target_heads: a positive multiple of ``S``; head ``h`` of the result is source head
            ``h // (target_heads // S)``.

    Returns:
        Array of ``x``'s dtype and array module, shaped like ``x`` with ``target_heads`` along
        ``axis``.

    Raises:
        TypeError: ``x`` is not an array, ``axis``/``target_heads`` are not integers.
        ValueError: ``axis`` out of range, no source heads, ``target_heads`` not a positive
            multiple of the source head count.
    """
    x = _validate.as_array(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got a 0-d array")
    ax = _validate.axis(axis, x.ndim)
    source_heads = x.shape[ax]
    if source_heads < 1:
        raise ValueError(f"x must have a positive head count along axis {ax}, got {source_heads}")
    target_heads = _validate.integer(target_heads, "target_heads", minimum=1)
    if target_heads % source_heads:
        raise ValueError(
            f"target_heads must be a multiple of the source head count {source_heads}, "
            f"got {target_heads}")
    repeat = target_heads // source_heads
    xp = _backend.array_module(x)
    shape = x.shape[:ax] + (target_heads,) + x.shape[ax + 1:]
    out = _backend.empty(shape, x.dtype, xp)
    split = out.reshape(_split_shape(x.shape, ax, source_heads, repeat))
    split[...] = xp.expand_dims(x, ax + 1)
    return out


def expand_heads_backward(dy: Array, axis: int, source_heads: int) -> Array:
    """Gradient of ``expand_heads``: sum the copies of each source head.

    No ctx: the forward saves nothing, its gradient needs only the axis and the head count.

    Args:
        dy: array with ``target_heads`` heads along ``axis``, float dtype.
        axis: the head axis.
        source_heads: the head count before expansion; a positive divisor of ``target_heads``.

    Returns:
        Array of ``dy``'s dtype with ``source_heads`` along ``axis``; the copies are summed in head
        order (deterministic).

    Raises:
        TypeError: ``dy`` is not an array, ``axis``/``source_heads`` are not integers.
        ValueError: ``axis`` out of range, ``source_heads`` not a positive divisor of the head
            count of ``dy``.
    """
    dy = _validate.as_array(dy, "dy")
    if dy.ndim == 0:
        raise ValueError("dy must have at least one dimension, got a 0-d array")
    ax = _validate.axis(axis, dy.ndim)
    source_heads = _validate.integer(source_heads, "source_heads", minimum=1)
    target_heads = dy.shape[ax]
    if target_heads % source_heads:
        raise ValueError(
            f"source_heads must divide the head count {target_heads} of dy along axis {ax}, "
            f"got {source_heads}")
    repeat = target_heads // source_heads
    xp = _backend.array_module(dy)
    out = _backend.empty(dy.shape[:ax] + (source_heads,) + dy.shape[ax + 1:], dy.dtype, xp)
    xp.sum(dy.reshape(_split_shape(dy.shape, ax, source_heads, repeat)), axis=ax + 1, out=out)
    return out
