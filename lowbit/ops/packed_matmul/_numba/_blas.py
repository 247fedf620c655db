"""SciPy's BLAS ``?gemm`` called from Numba kernels: ``gemm(a, ta, b, c, beta, ints, scalars)``.

Users: ``_backward.py`` beside this file (the exact backward's BLAS blocks) and
``lowbit/ops/gated_delta_scan/_numba_chunked_tiles.py`` (the chunked scan's products, whose
kernels guard their own cache against edits of this file). Calling BLAS from inside a Numba
parallel region, one single-threaded call per task (the caller holds OpenBLAS at one thread:
``lowbit._backend.single_threaded_blas``), runs BLAS's kernels on lowbit's threads: no second
thread pool spinning against Numba's, and each task can prepare its operand (decode packed
codes, dequantize) in cache right before its call.
"""

import llvmlite.binding
import numba
from numba import types
from numba.extending import get_cython_function_address

for _name in ("sgemm", "dgemm"):
    llvmlite.binding.add_symbol(f"lowbit_{_name}",
                                get_cython_function_address("scipy.linalg.cython_blas", _name))
# Fortran ?gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): every argument a
# pointer, passed as an address.
_SGEMM = types.ExternalFunction("lowbit_sgemm", types.void(*([types.intp] * 13)))
_DGEMM = types.ExternalFunction("lowbit_dgemm", types.void(*([types.intp] * 13)))
_NO, _YES = ord("N"), ord("T")
_INT = 4  # bytes of a Fortran integer in SciPy's LP64 BLAS


@numba.njit(cache=True)
def gemm(a, ta, b, c, beta, ints, scalars):
    """c = op(a) @ b + beta * c for row-major 2-D arrays (rows may be strided, columns
    contiguous); op transposes when ta. ``ints``: int32 [8], ``scalars``: [2] of c's dtype,
    scratch for the arguments BLAS takes by address. With ``beta`` 0, c is not read."""
    m, n = c.shape
    item = c.itemsize
    # Row-major c is column-major c.T = b.T @ op(a).T: b goes first.
    ints[0] = n
    ints[1] = m
    ints[2] = a.shape[0] if ta else a.shape[1]
    ints[3] = b.strides[0] // item
    ints[4] = a.strides[0] // item
    ints[5] = c.strides[0] // item
    ints[6] = _NO
    ints[7] = _YES if ta else _NO
    scalars[0] = 1
    scalars[1] = beta
    i = ints.ctypes.data
    s = scalars.ctypes.data
    args = (i + 6 * _INT, i + 7 * _INT, i, i + _INT, i + 2 * _INT, s, b.ctypes.data,
            i + 3 * _INT, a.ctypes.data, i + 4 * _INT, s + item, c.ctypes.data, i + 5 * _INT)
    if item == 4:
        _SGEMM(*args)
    else:
        _DGEMM(*args)
