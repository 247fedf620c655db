"""Launchers for ``cuda/rotary.cu`` (backends cuda and cudasim).

One block per token (grid-stride over tokens past ``MAX_BLOCKS``), its ``THREADS`` threads over
the token's H * D/2 pairs; float32 and float64, both styles; the backward is the same kernel
with the sine negated. Siblings: ``__init__.py``, ``_numpy.py``, ``_numba.py`` (same
signatures); reference ``reference/rotary.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "rotary.cu"
NAME_EXPRESSIONS = tuple(f"rotary_rotate<{ctype}, {style}>" for ctype in ("float", "double")
                         for style in ("false", "true"))
#: Threads per block.
THREADS = 128
#: Blocks at most: the kernel loops over the rest of the tokens.
MAX_BLOCKS = 8192
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kThreads": THREADS}


def _rotate(x, cos, sin, interleaved, sign):
    xp = _backend.array_module(x)
    T, H, D = x.shape
    y = _backend.empty(x.shape, x.dtype, xp)
    if y.size:
        expression = (f"rotary_rotate<{_kernels.CTYPE[x.dtype]}, "
                      f"{'true' if interleaved else 'false'}>")
        kernel = _kernels.module(SOURCE, NAME_EXPRESSIONS, x).get_function(expression)
        kernel((min(T, MAX_BLOCKS),), (THREADS,),
               (xp.ascontiguousarray(x), xp.ascontiguousarray(cos), xp.ascontiguousarray(sin),
                y, np.int64(T), np.int64(H), np.int64(D), x.dtype.type(sign)))
    return y


def forward(x, cos, sin, interleaved):
    """See ``_numpy.forward``: y [T, H, D] of x's dtype."""
    return _rotate(x, cos, sin, interleaved, 1.0)


def backward(dy, cos, sin, interleaved):
    """See ``_numpy.backward``: dx [T, H, D] of dy's dtype."""
    return _rotate(dy, cos, sin, interleaved, -1.0)
