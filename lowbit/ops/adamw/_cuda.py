"""Launchers for ``cuda/adamw.cu`` (backends cuda and cudasim).

Siblings: ``__init__.py`` (the optimizer), ``_numpy.py`` (``coefficients``, shared by every
backend), ``_numba.py``; reference ``reference/adamw.py``.

``step`` updates its ``param``, ``exp_avg`` and ``exp_avg_sq`` arguments in place: the one
documented exception to the backend contract's "inputs are never modified".
"""

from __future__ import annotations

import numpy as np

from ... import _backend, _kernels
from ._numpy import coefficients

SOURCE = "adamw.cu"
NAME_EXPRESSIONS = ("adamw_step<float>", "adamw_step<double>", "adamw_sum<float, true>",
                    "adamw_sum<double, true>", "adamw_sum<double, false>")
#: Threads per block; adamw_sum's block reduction is sized for exactly this many (kThreads).
THREADS = 256
#: Blocks of the step kernel; grid-stride loops cover the rest.
MAX_BLOCKS = 4096
#: Partials of the first sum pass: one block sums them in the second. The grid depends on the
#: gradient's size only (never on the device), so the summation order, and the result, is fixed.
MAX_SUM_BLOCKS = 1024
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kThreads": THREADS}


def _module(like):
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like)


def step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias1, bias2,
         grad_scale):
    """``_numpy.step``'s contract (IN PLACE on ``param``, ``exp_avg`` and ``exp_avg_sq``), in
    one grid-stride kernel."""
    n = param.shape[0]
    if not n:
        return
    c = coefficients(param.dtype, lr, beta1, beta2, eps, weight_decay, bias1, bias2, grad_scale)
    kernel = _module(param).get_function(f"adamw_step<{_kernels.CTYPE[param.dtype]}>")
    grid = (max(1, min(MAX_BLOCKS, -(-n // THREADS))),)
    kernel(grid, (THREADS,), (param, grad, exp_avg, exp_avg_sq, np.int64(n), *c))


def sum_squares(grad):
    """grad: [n] float32/float64 -> [1] float64, the sum of squares in float64 (fixed order)."""
    xp = _backend.array_module(grad)
    n = grad.shape[0]
    out = _backend.empty((1,), np.float64, xp)
    mod = _module(grad)
    blocks = max(1, min(MAX_SUM_BLOCKS, -(-n // THREADS)))
    squares = mod.get_function(f"adamw_sum<{_kernels.CTYPE[grad.dtype]}, true>")
    if blocks == 1:
        squares((1,), (THREADS,), (grad, out, np.int64(n)))
        return out
    partials = _backend.empty((blocks,), np.float64, xp)
    squares((blocks,), (THREADS,), (grad, partials, np.int64(n)))
    mod.get_function("adamw_sum<double, false>")((1,), (THREADS,),
                                                  (partials, out, np.int64(blocks)))
    return out
