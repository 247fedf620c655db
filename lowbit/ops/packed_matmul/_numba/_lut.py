"""Table-lookup products of float32 activations with packed ternary and sign weights: the dx of
the exact straight-through backward and the float-activation forward, four multiply-adds a float
add.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (``matmul_dx`` and
``matmul_float``, which run these for ternary and sign weights), ``_lut_gemv.py`` (few rows of
the forward), ``_llvm.py`` (the IR helpers), ``_backward.py`` (the BLAS blocks they replace
there). Reference ``reference/packed_matmul.py``;
tests ``tests/test_packed_matmul_float.py``; benchmark ``bench/matmul.py``.

``out[m, c] = sum_r a[m, r] * code(c, r)`` with the reduction ``r`` cut into groups of four.
Four ternary codes take 81 joint values (four sign codes 16): for each group ``j`` and each tile
of ``LANES`` rows of ``a``, a table holds every joint value's signed sum
``(c_0 a_0 + c_1 a_1) + (c_2 a_2 + c_3 a_3)`` (``a_i = a[m, 4 j + i]``, ``c_i`` the codes) as
one 16-lane float32 vector. An output column then needs one
table index a group (``slot``: the four codes as a base-3 or base-2 number) and one vector add
of the entry it names, where a multiply-add GEMM needs four (the lookup-table idea of T-MAC and
of bitnet.cpp's TL kernels; written here for float activations). Building a ternary group's
table takes 95 vector adds, about 3% of the adds that read it at 4096 output columns.

- ``offsets_rows`` (weight rows are the output columns: the forward) and ``offsets_cols``
  (weight columns are the output columns: dx, four weight rows' codes to one slot) lay the
  slots out ``[group, column]`` (columns padded to whole tiles), each slot already offset
  to its group's place in a block of ``BLOCK`` tables; either reports a ternary field of 3 (no
  code: the caller then takes its other path).
- ``_lut_gemv.py`` runs the forward of few rows one row at a time, with no slots (lookups
  indexed by the packed bits themselves), in the same order of adds: the same bits as ``gemm``.
- ``gemm`` runs tasks of ``LANES`` rows (and a share of the output columns) in parallel: it
  transposes its rows of ``a`` into [reduction, LANES], builds ``BLOCK`` groups' tables at a
  time (20 KiB for ternary: L1) and runs the register tile ``_tile`` (``COLS`` outputs of
  ``LANES`` float32 lanes, 12 ymm or 6 zmm accumulators) over every column tile of its share
  for those groups, then scales and transposes the sums into ``out``.

Every output is the sum over groups in order of ``j`` of a table entry built by the same float32
adds in the same order (each pair of codes, then the two pairs), whatever the vector width,
thread count or share of columns a task has: deterministic, and equal bit for bit on every CPU.
The error is that of a float32 dot product (no multiply rounds: codes are -1, 0, 1). A code 0
adds nothing, so an infinite activation meets no ``inf * 0``: the output is still non-finite,
but not always the NaN of a multiply-add.

Measured on a 2-core AMD EPYC Zen 4 (in alternation, M = 256, K = N = 4096 ternary): dx 26-32 ms
(the slots 1 ms of it) against 46-49 for the BLAS blocks, 48 for the AVX-512 tiles of ``_fma.py``
and 47-55 for NumPy's ``dy @ w.T`` (OpenBLAS SkylakeX); compiled for Haswell 25-35 against 51-54
for the blocks, 43 for the 256-bit tiles and 43-57 for NumPy on OpenBLAS's Haswell kernels. Sign
weights (16-entry tables): 24-27 ms. The forward (``matmul_float``): 27-36 ms against 56-62 for
the decoded BLAS tiles and 45-46 for NumPy. At the main job's shapes (M = 512, a reduction of 512,
128 outputs) dx takes 0.37-0.39 ms against 0.75 for the blocks and 0.40-0.47 for NumPy.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._llvm import counted_loop, is_array, ptr

#: Rows of ``a`` per task: the float32 lanes of one table entry (one zmm, or two ymm).
LANES = 16
#: Output columns a register tile accumulates (COLS x LANES float32 in registers).
COLS = 6
#: Groups of four codes whose tables are built at once: the column tiles of a task then load and
#: store their sums once per BLOCK groups. 4, 6 and 8 ran alike on the Zen 4 (dx 25-35 ms, in
#: the noise); 4 keeps the ternary tables (4 x 81 entries of 64 B) inside a 32 KiB L1 with room
#: for the rest, as on Haswell and Zen 3. 12 (62 KiB, L2) ran 37-40 ms.
BLOCK = 4

_VEC = ir.VectorType(ir.FloatType(), LANES)


@intrinsic
def _tile(typingctx, lut, off, o0, stride, count, acc, a0):
    """``acc[a0 + c, :] += sum_{q < count} lut[off[o0 + q * stride + c], :]`` for the COLS
    columns c of one tile, in order of q (``lut``, ``acc``: C-contiguous float32 [*, LANES];
    ``off``: C-contiguous uint16). The sums stay in registers over the ``count`` groups."""
    if not (is_array(lut, 2, (types.float32,)) and is_array(acc, 2, (types.float32,))
            and is_array(off, 1, (types.uint16,))):
        return None
    sig = types.void(lut, off, types.intp, types.intp, types.intp, acc, types.intp)

    def codegen(context, builder, signature, args):
        arr_l = context.make_array(signature.args[0])(context, builder, args[0])
        arr_o = context.make_array(signature.args[1])(context, builder, args[1])
        arr_a = context.make_array(signature.args[5])(context, builder, args[5])
        intp = context.get_value_type(types.intp)

        def const(value):
            return ir.Constant(intp, value)

        rows = [ptr(builder, arr_a.data, builder.mul(builder.add(args[6], const(c)),
                                                      const(4 * LANES)), _VEC)
                for c in range(COLS)]
        initial = [builder.load(p, align=4) for p in rows]

        def step(it, sums):
            first = builder.add(args[2], builder.mul(it, args[3]))
            new = []
            for c in range(COLS):
                slot = builder.load(ptr(builder, arr_o.data,
                                        builder.mul(builder.add(first, const(c)), const(2)),
                                        ir.IntType(16)), align=2)
                where = builder.mul(builder.zext(slot, intp), const(4 * LANES))
                entry = builder.load(ptr(builder, arr_l.data, where, _VEC), align=4)
                new.append(builder.fadd(sums[c], entry))
            return new

        sums = counted_loop(builder, intp, args[4], initial, step, "lut")
        for p, s in zip(rows, sums):
            builder.store(s, p, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _table(bits):
    """Intrinsic ``table(xt, r0, lut, e0)``: one group's table into rows ``e0 ..`` of ``lut``
    from rows ``r0 .. r0 + 3`` of the transposed activations ``xt`` (C-contiguous float32
    [*, LANES] both): entry ``s`` holds ``(c_0 a_0 + c_1 a_1) + (c_2 a_2 + c_3 a_3)``, the codes
    ``c_i`` of ``s`` and ``a_i = xt[r0 + i]`` (ternary: s = sum_i 3^i (c_i + 1), 81 entries;
    sign: s = sum_i 2^i (c_i + 1) / 2, 16): each pair's sum (a code 0 keeps the first code's
    value as it is), then the two pairs' sums added: the order in which ``_lut_gemv.py`` looks
    up a pair's joint values in a register. Each entry is a 16-lane vector value, stored as soon
    as it is made. Numba's loop over the lanes of such a table did not vectorize (its stores may
    alias its loads): the tables took 1.2 of 1.6 ms at the main job's M = 512, reduction 512,
    128 outputs; 0.2-0.4 ms here."""
    base = 3 if bits == 2 else 2

    @intrinsic
    def table(typingctx, xt, r0, lut, e0):
        if not (is_array(xt, 2, (types.float32,)) and is_array(lut, 2, (types.float32,))):
            return None
        sig = types.void(xt, types.intp, lut, types.intp)

        def codegen(context, builder, signature, args):
            arr_x = context.make_array(signature.args[0])(context, builder, args[0])
            arr_l = context.make_array(signature.args[2])(context, builder, args[2])
            intp = context.get_value_type(types.intp)

            def row(arr, index):
                return ptr(builder, arr.data, builder.mul(index, ir.Constant(intp, 4 * LANES)),
                           _VEC)

            x = [builder.load(row(arr_x, builder.add(args[1], ir.Constant(intp, i))), align=4)
                 for i in range(4)]
            zero = ir.Constant(_VEC, [0.0] * LANES)

            def pair(x0, x1):  # the entries of two codes, in order of their base-3 or 2 slot
                first = [builder.fsub(ir.Constant(_VEC, [-0.0] * LANES), x0)]  # -x0, exactly
                first += [zero, x0] if base == 3 else [x0]
                return ([builder.fsub(v, x1) for v in first] + (first if base == 3 else [])
                        + [builder.fadd(v, x1) for v in first])

            low, high = pair(x[0], x[1]), pair(x[2], x[3])
            entries = [builder.fadd(a, b) for b in high for a in low]
            for s, value in enumerate(entries):
                builder.store(value, row(arr_l, builder.add(args[3], ir.Constant(intp, s))),
                              align=4)
            return context.get_dummy_value()

        return sig, codegen

    return table


_TERNARY_TABLE, _SIGN_TABLE = _table(2), _table(1)


@numba.njit(cache=True)
def _build(xt, j0, count, bits, lut):
    """The tables of groups ``j0 .. j0 + count`` into ``lut`` (group ``j0 + q`` at rows
    ``q * E ..``), from the transposed activations ``xt`` [reduction, LANES]."""
    for q in range(count):
        if bits == 2:
            _TERNARY_TABLE(xt, 4 * (j0 + q), lut, q * 81)
        else:
            _SIGN_TABLE(xt, 4 * (j0 + q), lut, q * 16)


@numba.njit(cache=True)
def _place(j, bits):
    """Where group ``j``'s table starts in a block of BLOCK tables (entries)."""
    return (j % BLOCK) * (81 if bits == 2 else 16)


@numba.njit(cache=True, inline="always")
def _byte_slots(data, n0, rows, b, bits, off):
    """The slots of byte ``b`` of weight rows ``n0 .. n0 + rows`` into ``off``'s columns; returns
    the ternary fields' flag (nonzero: a field of 3)."""
    flag = np.uint32(0)
    if bits == 2:
        place = np.uint32(_place(b, bits))
        for i in range(rows):
            v = np.uint32(data[n0 + i, b])
            f = ((v & np.uint32(3)) | ((v & np.uint32(12)) << np.uint32(6))
                 | ((v & np.uint32(48)) << np.uint32(12)) | ((v & np.uint32(192)) << np.uint32(18)))
            flag |= f & (f >> np.uint32(1))
            off[b, n0 + i] = np.uint16(
                place + (((f * np.uint32(0x0103091B)) >> np.uint32(24)) & np.uint32(255)))
    else:
        p0 = np.uint32(_place(2 * b, bits))
        p1 = np.uint32(_place(2 * b + 1, bits))
        for i in range(rows):
            v = np.uint32(data[n0 + i, b])
            off[2 * b, n0 + i] = np.uint16(p0 + (v & np.uint32(15)))
            off[2 * b + 1, n0 + i] = np.uint16(p1 + (v >> np.uint32(4)))
    return flag


@numba.njit(parallel=True, cache=True)
def offsets_rows(data, bits):
    """Slots when the output columns are the packed weight's rows (``data`` [N, bytes]: the
    forward, reduction over the packed codes): ``(off [groups, tiles * COLS] uint16, ok)``, a
    ternary byte one group, a sign byte two (its low, then its high nibble), padding columns
    copying the last row's. ``ok`` is False where a ternary field is 3 (no code). Each task
    transposes a strip of ``LANES`` rows (a fixed count the loop unrolls); a ternary byte's fields
    are spread one a byte and joined by the product of ``offsets_cols``."""
    N, nbytes = data.shape
    per_byte = 1 if bits == 2 else 2
    width = -(-N // COLS) * COLS
    off = np.empty((per_byte * nbytes, width), np.uint16)
    strips = -(-N // LANES)
    bad = np.zeros(strips, np.bool_)
    for s in numba.prange(strips):
        n0 = s * LANES
        flag = np.uint32(0)
        if n0 + LANES <= N:
            for b in range(nbytes):
                flag |= _byte_slots(data, n0, LANES, b, bits, off)
        else:
            for b in range(nbytes):
                flag |= _byte_slots(data, n0, N - n0, b, bits, off)
        bad[s] = (flag & np.uint32(0x01010101)) != 0
    for n in range(N, width):
        off[:, n] = off[:, N - 1]
    return off, not bad.any()


@numba.njit(parallel=True, cache=True)
def offsets_cols(data, bits, ncols):
    """Slots when the output columns are the packed weight's columns (``data`` [N, bytes],
    ``ncols`` = K codes a row: dx, reduction over the N rows): group j joins the codes of rows
    ``4 j .. 4 j + 3`` at one column (rows past N read a valid byte: their activations are zero).
    The columns are field-major: column ``f * bytes + b`` holds code ``per * b + f``
    (``gemm``'s ``per`` puts them back), so each field is one pass over contiguous words. With
    the four rows' fields one a byte in ``v``, the product ``v * 0x0103091B`` (sign
    ``0x01020408``) holds the slot in its top byte: no partial sum carries out of its byte.
    Returns ``(off [ceil(N / 4), tiles * COLS] uint16, ok)`` as ``offsets_rows``."""
    N, nbytes = data.shape
    per = 8 // bits
    groups = -(-N // 4)
    width = -(-(per * nbytes) // COLS) * COLS
    off = np.empty((groups, width), np.uint16)
    bad = np.zeros(groups, np.bool_)
    fields = np.uint32(0x03030303 if bits == 2 else 0x01010101)
    join = np.uint32(0x0103091B if bits == 2 else 0x01020408)
    pad = np.full(nbytes, 0x55 if bits == 2 else 0, np.uint8)
    for j in numba.prange(groups):
        place = np.uint32(_place(j, bits))
        r1 = data[4 * j + 1] if 4 * j + 1 < N else pad
        r2 = data[4 * j + 2] if 4 * j + 2 < N else pad
        r3 = data[4 * j + 3] if 4 * j + 3 < N else pad
        words = np.empty(nbytes, np.uint32)
        for b in range(nbytes):
            words[b] = (np.uint32(data[4 * j, b]) | (np.uint32(r1[b]) << np.uint32(8))
                        | (np.uint32(r2[b]) << np.uint32(16)) | (np.uint32(r3[b]) << np.uint32(24)))
        dst = off[j]
        flag = np.uint32(0)
        for f in range(per):
            shift = np.uint32(bits * f)
            seg = dst[f * nbytes:(f + 1) * nbytes]
            for b in range(nbytes):
                v = (words[b] >> shift) & fields
                flag |= v & (v >> np.uint32(1))
                seg[b] = np.uint16(place + (((v * join) >> np.uint32(24)) & np.uint32(255)))
        for c in range(per * nbytes, width):
            dst[c] = place
        bad[j] = bits == 2 and (flag & fields) != 0
    return off, not bad.any()


@numba.njit(parallel=True, cache=True)
def gemm(a, off, bits, per, scale, col_scale, threads, out):
    """out [M, ncols] float32 = ``(sum_r a[m, r] code(c, r)) * scale * col_scale[c]`` (an empty
    ``col_scale``: none) from the slots ``off`` of ``offsets_rows`` (``per`` 1) or
    ``offsets_cols`` (``per`` its codes a byte: the field-major column ``f * bytes + b`` is
    output column ``per * b + f``), and float32 ``a`` [M, R] (R <= 4 * groups; codes past R
    meet zeros)."""
    M, R = a.shape
    ncols = out.shape[1]
    tiles = off.shape[1] // COLS
    width = off.shape[1]
    nbytes = -(-ncols // per)
    groups = -(-R // 4)
    E = 81 if bits == 2 else 16
    flat = off.reshape(-1)
    mtiles = -(-M // LANES)
    # Enough tasks for every thread; shares of columns only where row tiles are few (each share
    # builds its rows' tables again). The split cannot change a sum: deterministic.
    shares = max(1, min(tiles, -(-2 * threads // mtiles)))
    for task in numba.prange(mtiles * shares):
        m0 = (task // shares) * LANES
        rows = min(LANES, M - m0)
        t0 = (task % shares) * tiles // shares
        t1 = (task % shares + 1) * tiles // shares
        xt = np.zeros((4 * groups, LANES), np.float32)
        for i in range(rows):
            for r in range(R):
                xt[r, i] = a[m0 + i, r]
        acc = np.zeros(((t1 - t0) * COLS, LANES), np.float32)
        lut = np.empty((BLOCK * E, LANES), np.float32)
        for j0 in range(0, groups, BLOCK):
            count = min(BLOCK, groups - j0)
            _build(xt, j0, count, bits, lut)
            for t in range(t0, t1):
                _tile(lut, flat, j0 * width + t * COLS, width, count, acc, (t - t0) * COLS)
        for c in range(t0 * COLS, min(per * nbytes, t1 * COLS)):
            k = per * (c % nbytes) + c // nbytes
            if k < ncols:
                s = scale * (col_scale[k] if col_scale.size else np.float32(1))
                src = acc[c - t0 * COLS]
                for i in range(rows):
                    out[m0 + i, k] = src[i] * s
