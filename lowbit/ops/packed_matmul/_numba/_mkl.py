"""oneMKL's integer GEMM for the packed matmul on CPUs with AMX: ``y = x @ w`` (``gemm``) and the
dx of int8 gradients (``gemm_dx``), exact in int32.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the choice of kernel: this
module where ``USE_MKL``), ``_avx2_gemm.py`` / ``_vnni.py`` (lowbit's own GEMMs, which the GEMV
and every CPU without AMX keep). The optional extra ``lowbit[mkl]`` (the ``mkl`` wheel) brings
``libmkl_rt``; it is found through ctypes, so nothing here needs a compiler.

``cblas_gemm_s8u8s32`` computes ``C = (op(A) + oa) (op(B) + ob)`` with ``A`` unsigned and ``B``
signed 8-bit, in int32: the weight goes in as ``A`` with its stored fields as bytes (ternary:
``code + 1`` in {0, 1, 2}, ``oa = -1``; sign: ``2 * field`` in {0, 2}, ``oa = -1``; int8: the
byte with its sign bit flipped, ``code + 128``, ``oa = -128``), the activation or gradient codes
as ``B``. Every product is then the exact integer one (``|u8 x s8| <= 255 * 128``) and MKL
accumulates in int32, on AMX tiles where the CPU has them (Sapphire Rapids on) and with
``vpdpbusd`` / ``vpmaddubsw`` elsewhere: results equal ``_numpy.matmul_int``'s bit for bit on any
x86-64 CPU, which is how this module is tested on machines without AMX. It is chosen only with
AMX (``USE_MKL``): without it MKL's path ran 11-15x slower than ``_avx2_gemm`` (ternary on a
2-core AMD EPYC Zen 3: 64 x 1024 x 1024 5.6 against 0.51 ms, 256 x 4096 x 4096 230-300 against
20-22 ms), and the GEMV stays on lowbit's own kernel everywhere (MKL is ~9x slower at one row).

MKL runs one thread per call (``MKL_Set_Num_Threads_Local(1)`` in each calling thread, so an
MKL-backed NumPy in the same process keeps its own setting), one call per block of output
features on ``numba.get_num_threads()`` Python threads (ctypes and the ``nogil`` decode release
the GIL): no OpenMP pool of MKL's own spins against Numba's workers. Each block's weight fields are decoded
to bytes (``_fields_u8``) just before its call and dropped after.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import functools
import glob
import os
import sys
import threading

import numba
import numpy as np

from ._llvm import host_features

#: Whether the CPU Numba compiles for has AMX int8 tiles (LLVM feature ``+amx-int8``).
AMX = "+amx-int8" in host_features()
#: Output features per MKL call (a block's decoded weight: 512 x K bytes).
BLOCK_N = 512
_ROW_MAJOR, _NO_TRANS, _TRANS, _FIX_OFFSET = 101, 111, 112, 173  # CBLAS enums
_LOCAL = threading.local()


def _candidates() -> list[str]:
    """libmkl_rt paths to try: the environment's ``lib/`` (where the ``mkl`` wheel puts it),
    then the loader's search."""
    found = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True)
        found += glob.glob(os.path.join(prefix, "Library", "bin", "mkl_rt*.dll"))
    name = ctypes.util.find_library("mkl_rt")
    return found + ([name] if name else [])


@functools.lru_cache(maxsize=None)
def _load():
    """(``cblas_gemm_s8u8s32``, ``MKL_Set_Num_Threads_Local``) of the first libmkl_rt that
    loads; None when there is none."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            gemm, local = lib.cblas_gemm_s8u8s32, lib.MKL_Set_Num_Threads_Local
        except (OSError, AttributeError):
            continue
        i, p = ctypes.c_int, ctypes.c_void_p  # MKL_INT: 32-bit (the LP64 interface)
        gemm.argtypes = (i, i, i, i, i, i, i, ctypes.c_float, p, i, ctypes.c_int8, p, i,
                         ctypes.c_int8, ctypes.c_float, p, i, p)
        gemm.restype = None
        local.argtypes = (i,)
        local.restype = i
        return gemm, local
    return None


def library():
    """``cblas_gemm_s8u8s32``, MKL held at one thread for the calling thread; None when there is
    no libmkl_rt."""
    found = _load()
    if found is None:
        return None
    if not getattr(_LOCAL, "single", False):
        found[1](1)
        _LOCAL.single = True
    return found[0]


def available() -> bool:
    """Whether oneMKL's integer GEMM can be called here."""
    return _load() is not None


#: Whether ``matmul_int`` (more rows than the GEMV's) and ``matmul_dx_int`` run here.
USE_MKL = AMX and available()


@numba.njit(cache=True, nogil=True)
def _fields_u8(data, bits, n0, K, out):
    """out[i, k] = the unsigned byte of weight code (n0 + i, k) (ternary ``code + 1``, sign
    ``2 * field``, int8 ``code + 128``), k < K."""
    per = 8 // bits if bits < 8 else 1
    mask = (1 << bits) - 1 if bits < 8 else 255
    for i in range(out.shape[0]):
        row = data[n0 + i]
        dst = out[i]
        if bits == 8:
            for k in range(K):
                dst[k] = np.uint8(row[k]) ^ np.uint8(128)
            continue
        for g in range(-(-K // per)):
            b = np.int32(row[g])
            for j in range(min(per, K - g * per)):
                f = (b >> (bits * j)) & mask
                dst[g * per + j] = f * 2 if bits == 1 else f


@numba.njit(cache=True, nogil=True)
def _scale_out(acc, scale_x, scale_w, n0, out):
    """out[m, n0 + i] = float32(acc[i, m]) * scale_x[m] * scale_w[n0 + i] (one scale: [1])."""
    stride = 1 if scale_w.shape[0] > 1 else 0
    for i in range(acc.shape[0]):
        sw = scale_w[(n0 + i) * stride]
        for m in range(acc.shape[1]):
            out[m, n0 + i] = (np.float32(acc[i, m]) * scale_x[m]) * sw


@functools.lru_cache(maxsize=None)
def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lowbit-mkl")


def _blocks(n: int, fn) -> None:
    """fn(n0, n1) for the blocks of BLOCK_N output features, on Numba's thread count."""
    spans = [(n0, min(n, n0 + BLOCK_N)) for n0 in range(0, n, BLOCK_N)]
    workers = min(len(spans), numba.get_num_threads())
    if workers <= 1:
        for span in spans:
            fn(*span)
        return
    for done in [_pool(workers).submit(fn, *span) for span in spans]:
        done.result()


def _offset(bits: int) -> int:
    return -128 if bits == 8 else -1


def gemm(codes_x, scale_x, data, scale_w, bits, K, out):
    """out = float32(codes_x @ codes_w) * scale_x[:, None] * scale_w (``_numpy.matmul_int``'s
    contract): codes_x [M, K] int8, data packed [N, bytes], scale_w [1] or [N] float32."""
    M, N = codes_x.shape[0], data.shape[0]
    x = np.ascontiguousarray(codes_x)

    def block(n0, n1):
        call = library()  # in the thread that calls it
        w = np.empty((n1 - n0, K), np.uint8)
        _fields_u8(data, bits, n0, K, w)
        acc = np.empty((n1 - n0, M), np.int32)  # C = W (n1 - n0 x K) . X^T (K x M)
        zero = np.zeros(1, np.int32)
        call(_ROW_MAJOR, _NO_TRANS, _TRANS, _FIX_OFFSET, n1 - n0, M, K, 1.0, w.ctypes.data, K,
             _offset(bits), x.ctypes.data, K, 0, 0.0, acc.ctypes.data, M, zero.ctypes.data)
        _scale_out(acc, scale_x, scale_w, n0, out)

    _blocks(N, block)
    return out


def gemm_dx(dy_codes, dy_scale, data, bits, K, scale, out):
    """out [M, K] = float32(dy_codes @ codes_w.T) * dy_scale[:, None] * scale
    (``_numpy.matmul_dx_int``'s contract): dy_codes [M, N] int8, data packed [N, bytes]."""
    M, N = dy_codes.shape
    g = np.ascontiguousarray(dy_codes)
    w = np.empty((N, K), np.uint8)
    _fields_u8(data, bits, 0, K, w)
    scale_w = np.full(1, scale, np.float32)

    def block(k0, k1):  # C = W[:, k0:k1]^T (k1 - k0 x N) . G^T (N x M)
        call = library()  # in the thread that calls it
        acc = np.empty((k1 - k0, M), np.int32)
        zero = np.zeros(1, np.int32)
        call(_ROW_MAJOR, _TRANS, _TRANS, _FIX_OFFSET, k1 - k0, M, N, 1.0,
             w[:, k0:].ctypes.data, K, _offset(bits), g.ctypes.data, N, 0, 0.0,
             acc.ctypes.data, M, zero.ctypes.data)
        _scale_out(acc, dy_scale, scale_w, k0, out)

    _blocks(K, block)
    return out
