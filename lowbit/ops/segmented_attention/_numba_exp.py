"""The AVX-512 softmax steps of the segmented attention's tile kernels (``_numba.py``'s
``_forward_fma`` and ``_backward_fma``): the masked exp of a transposed score block on explicit
16-lane float32 vectors, as LLVM intrinsics.

LLVM auto-vectorizes the lane loops of ``_numba_softmax.py`` at 256 bits on the AVX-512 CPUs it
prefers narrower vectors for (Skylake-SP to Sapphire Rapids), and the exp was then as costly as
either product: one core of a 2-core Intel Xeon (AVX-512), T = 8192 in 6 segments of 512-2048
tokens, H = 8, D = 64, the forward's exp passes took 90 ms of 267 (scores 95 ms, values 108 ms);
on zmm registers 47 ms, the forward 221 ms. The steps are the same as there: Cephes' polynomial
(``_numba_softmax._EXP_POLY``, the same constants and clamp), causally hidden keys exactly zero;
the multiply-adds are fused and the power of two is ``vscalefps``, so a result may differ from
the lane loops' in its last bit.

Each intrinsic walks all key rows of a block for 64 query lanes (four vectors) from lane ``j0``:
a block's columns are a multiple of 64 (the tiles' padded query lanes), its rows C-contiguous.
Siblings: ``_numba.py`` (the kernels), ``_numba_softmax.py`` (the lane loops the BLAS kernels
and other CPUs run), ``lowbit/ops/packed_matmul/_numba/_llvm.py`` (the IR helpers).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..packed_matmul._numba._llvm import counted_loop, ptr
from . import _numba_softmax as _sm

_F32, _I32 = ir.FloatType(), ir.IntType(32)
_LANES = 16
_FV, _IV = ir.VectorType(_F32, _LANES), ir.VectorType(_I32, _LANES)
#: Vectors of query lanes per intrinsic call (``LANES`` lanes).
VECTORS = 4
LANES = _LANES * VECTORS


def _fconst(value):
    return ir.Constant(_FV, [float(np.float32(value))] * _LANES)


def _call(builder, name, args):
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(_FV, [a.type for a in args]), name)
    return builder.call(fn, args)


def _exp(builder, x):
    """Cephes' float32 exp of 16 lanes (``_numba_softmax._exp``'s steps: the same clamp, range
    reduction and polynomial, with every multiply-add fused and ``vscalefps`` for the power of
    two)."""
    x = _call(builder, "llvm.maxnum.v16f32", [x, _fconst(_sm._EXP_MIN)])  # NaN: the minimum

    def fma(a, b, c):
        return _call(builder, "llvm.fma.v16f32", [a, b, c])

    n = _call(builder, "llvm.floor.v16f32", [fma(x, _fconst(_sm._LOG2E), _fconst(0.5))])
    r = fma(n, _fconst(-_sm._LN2_HI), x)
    r = fma(n, _fconst(-_sm._LN2_LO), r)
    p = _fconst(_sm._EXP_POLY[0])
    for coef in _sm._EXP_POLY[1:]:
        p = fma(p, r, _fconst(coef))
    p = fma(builder.fmul(p, r), r, builder.fadd(r, _fconst(1.0)))
    # p * 2**n: vscalefps (n integral, within float32's normal exponents after the clamp)
    scalef = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_FV, [_FV, _FV, _FV, ir.IntType(16), _I32]),
        "llvm.x86.avx512.mask.scalef.ps.512")
    return builder.call(scalef, [p, n, p, ir.Constant(ir.IntType(16), -1),
                                 ir.Constant(_I32, 4)])


def _codegen(backward):
    """Code of the forward's ``exp_lanes(block, shift, den, diag, causal, j0)``: ``block[c, j] =
    exp(block[c, j] - shift[j])`` where key row ``c`` is visible to query lane ``j``, else 0, and
    ``den[j]`` gains the column sums; or the backward's ``probability_lanes(p, ds, shift, delta,
    diag, causal, j0)``: ``p`` so, and ``ds[c, j] = p[c, j] * (ds[c, j] - delta[j])``. Lanes
    ``j0 .. j0 + 63``; key row ``c`` is visible to lanes ``j >= clip(c - diag, 0, columns)``
    when ``causal`` (``_numba_softmax._first_visible``), to all otherwise."""

    def codegen(context, builder, signature, values):
        arrays = [context.make_array(t)(context, builder, v)
                  for t, v in zip(signature.args[:-3], values[:-3])]
        diag, causal, j0 = values[-3:]
        intp = context.get_value_type(types.intp)

        def const(value):
            return ir.Constant(intp, value)

        keys, columns = cgutils.unpack_tuple(builder, arrays[0].shape, 2)
        row_bytes = cgutils.unpack_tuple(builder, arrays[0].strides, 2)[0]
        base = builder.mul(j0, const(4))

        def vectors(arr):
            return [builder.load(ptr(builder, arr.data, builder.add(base, const(64 * u)),
                                     _FV), align=4) for u in range(VECTORS)]

        # forward: block, shift, den; backward: p, ds, shift, delta
        shifts = vectors(arrays[2 if backward else 1])
        deltas = vectors(arrays[3]) if backward else None
        sums = [] if backward else vectors(arrays[2])
        lane = [ir.Constant(_IV, [_LANES * u + i for i in range(_LANES)])
                for u in range(VECTORS)]
        zero = ir.Constant(_FV, [0.0] * _LANES)

        def step(c, accs):
            lo = builder.select(causal, builder.sub(c, diag), const(0))
            lo = builder.select(builder.icmp_signed("<", lo, const(0)), const(0), lo)
            lo = builder.select(builder.icmp_signed(">", lo, columns), columns, lo)
            first = builder.sub(builder.trunc(lo, _I32), builder.trunc(j0, _I32))
            one = builder.insert_element(ir.Constant(_IV, None), first, ir.Constant(_I32, 0))
            first = builder.shuffle_vector(one, ir.Constant(_IV, None),
                                           ir.Constant(_IV, [0] * _LANES))
            row = builder.add(builder.mul(c, row_bytes), base)
            new = []
            for u in range(VECTORS):
                at = ptr(builder, arrays[0].data, builder.add(row, const(64 * u)), _FV)
                visible = builder.icmp_signed(">=", lane[u], first)
                # hidden lanes may hold anything (an exp of -inf shifts, say): zeroed after
                x = builder.fsub(builder.load(at, align=4), shifts[u])
                e = builder.select(visible, _exp(builder, x), zero)
                builder.store(e, at, align=4)
                if backward:
                    at_ds = ptr(builder, arrays[1].data, builder.add(row, const(64 * u)), _FV)
                    d = builder.fsub(builder.load(at_ds, align=4), deltas[u])
                    builder.store(builder.fmul(e, d), at_ds, align=4)
                else:
                    new.append(builder.fadd(accs[u], e))
            return new

        sums = counted_loop(builder, intp, keys, sums, step, "lanes")
        for u, total in enumerate(sums):
            builder.store(total, ptr(builder, arrays[2].data,
                                     builder.add(base, const(64 * u)), _FV), align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _exp_lanes(typingctx, block, shift, den, diag, causal, j0):
    return types.void(block, shift, den, types.intp, types.boolean, types.intp), _codegen(False)


@intrinsic
def _probability_lanes(typingctx, p, ds, shift, delta, diag, causal, j0):
    return (types.void(p, ds, shift, delta, types.intp, types.boolean, types.intp),
            _codegen(True))


@numba.njit(cache=True)
def exp_columns(block, shift, den, diag, causal):
    """``_numba_softmax._exp_columns`` on zmm registers: a C-contiguous float32 [keys, 64 n] block,
    ``shift`` and ``den`` float32 with at least 64 n lanes."""
    for j0 in range(0, block.shape[1], LANES):
        _exp_lanes(block, shift, den, diag, causal, j0)


@numba.njit(cache=True)
def probabilities_and_dscores(p, ds, shift, delta, diag, causal):
    """``_numba_softmax._probabilities_and_dscores`` on zmm registers (``p``, ``ds``: C-contiguous
    float32 [keys, 64 n]; ``shift``, ``delta``: at least 64 n lanes)."""
    for j0 in range(0, p.shape[1], LANES):
        _probability_lanes(p, ds, shift, delta, diag, causal, j0)
