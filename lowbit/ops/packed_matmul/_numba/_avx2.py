"""The SIMD GEMV of the numba packed matmul on every x86-64 CPU with AVX2 (256-bit AVX2 and
AVX-VNNI, 512-bit AVX-512 VNNI), and the 256-bit IR helpers of ``_avx2_gemm.py``.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the choice of kernel),
``_vnni.py`` (the AVX-512 VNNI kernels these follow, and ``_planes``, the activation layout both
use), ``_gemv.py`` / ``_gemm_f64.py`` (portable), ``_llvm.py`` (the IR helpers). The intrinsics
and the kernels that call them share this file for Numba's cache (see ``_vnni.py``). Every
variant is chosen when the module is imported, from the features of the CPU Numba compiles for
(``AVAILABLE``: AVX2; ``AVX_VNNI``: the 256-bit ``vpdpbusd``, LLVM feature ``+avxvnni`` or
AVX-512 VNNI with VL; ``WIDE``: AVX-512 VNNI, the GEMV on 512-bit vectors); that feature list is
part of the key of every cached kernel, so a cache never mixes them.

Products (exact int32; ``u``: the unsigned weight operand, ``x``: int8 activation codes):

- AVX2, 2- and 1-bit fields: ``vpmaddubsw`` (u8 x s8, adjacent pairs summed into int16 with
  saturation) then ``vpmaddwd`` with ones into int32. A field is at most 3 (1), a code at least
  -128 in magnitude, so a pair is at most 2 * 3 * 128 = 768 (256): no saturation, and sums of up
  to ``floor(32767 / 768) = 42`` (127) such int16 lanes stay exact before they are widened;
- AVX2, int8 weights: ``vpmaddubsw`` cannot take them (with the sign bit flipped a pair reaches
  2 * 255 * 128 > 32767, and ``|w|`` with the sign moved onto ``x`` fails at -128), so both
  operands are sign-extended to int16 (``vpmovsxbw``) and multiplied by ``vpmaddwd``: a pair is
  at most 2 * 128 * 128 = 32768 in magnitude, which int32 holds (``vpmaddwd`` saturates only
  when all four inputs are -32768);
- AVX-VNNI: ``vpdpbusd`` (four u8 x s8 products added to an int32 lane, no saturation), the
  intrinsic ``llvm.x86.avx512.vpdpbusd.256``, which LLVM encodes with VEX (``{vex} vpdpbusd``
  on ymm registers) when the target has ``+avxvnni``, and with EVEX when it has AVX-512 VNNI and
  VL instead: the same operation, which a CPU with AVX-512 VNNI and no AVX-VNNI (Cascade Lake and
  Ice Lake servers, Zen 4) executes, so these kernels run and are checked there too (in
  production such a CPU runs the 512-bit kernels of ``_vnni.py``); int8 weights as in
  ``_vnni.py``, with the sign bit flipped (raw sum offset by ``128 * sum(x)``);
- AVX-512 VNNI (GEMV only): the same on zmm registers, ``llvm.x86.avx512.vpdpbusd.512``.

GEMV (``gemv``, few rows): per block of packed bytes each field is masked out (shift + and) and
multiplied with its activation plane ``plane[j][g] = codes_x[per * g + j]``; the AVX2 products of
one block are summed in int16 (at most 8 pairs: exact by the bounds above) and widened once.
``dot_group(bits, rows)`` reads a weight block once for ``rows`` activation rows, over all the
weight rows of a task in one loop nest. On AVX-512 VNNI this replaced a kernel of one call per
weight row and activation row, with 128-byte blocks (BitNet 2B's 210 decode projections from
DRAM, one row, 2-core Intel Xeon: 69 against 37 ms; 16 rows 581 against 169 ms). On AVX2
without VNNI, one activation row against 2-bit fields (BitNet's decode) runs ``_ternary_row``:
fields masked in place (one shift a block, not three), int16 sums over five blocks, and a
software prefetch ``PREFETCH_BYTES`` ahead of the weight row (together 1.11-1.13x BitNet 2B's
decode projections from DRAM, compiled for Haswell on a 2-core EPYC Zen 4). On AVX-512 VNNI
neither the masks in place nor the prefetch moved that GEMV beyond the run-to-run noise
(0.98-1.07x, int8 weights 0.92x with the prefetch), so they are not used there; the 256-bit
``vpdpbusd`` GEMV (AVX-VNNI) prefetches for one row of 2- and 1-bit fields (``PREFETCH_DPBUSD``).

The GEMM (more rows) is in ``_avx2_gemm.py``; it builds on the IR helpers here.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import counted_loop, host_features, is_array, prefetch, ptr
from ._vnni import _planes

_FEATURES = host_features()
#: True when the target CPU has AVX2 (256-bit integer vectors, ``vpmaddubsw``).
AVAILABLE = "+avx2" in _FEATURES
#: True when it also has the 256-bit ``vpdpbusd``: AVX-VNNI (VEX-encoded), or AVX-512 VNNI with
#: VL (EVEX-encoded, the same operation).
AVX_VNNI = AVAILABLE and ("+avxvnni" in _FEATURES or {"+avx512vnni", "+avx512vl"} <= _FEATURES)
#: True when it has AVX-512 VNNI: the GEMV then runs on 512-bit vectors (``vpdpbusd`` on zmm).
WIDE = {"+avx512vnni", "+avx512bw"} <= _FEATURES
#: Whether the GEMV multiplies with ``vpdpbusd`` (else ``vpmaddubsw``).
GEMV_DPBUSD = WIDE or AVX_VNNI

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V8 = ir.VectorType(_I32, 8)
_B32 = ir.VectorType(_I8, 32)
_W16 = ir.VectorType(_I16, 16)
_BYTES = 32
#: The GEMV's vectors: int32 lanes, bytes and vector registers of the target.
GEMV_LANES = 16 if WIDE else 8
GEMV_VECTOR_BYTES = 4 * GEMV_LANES
GEMV_REGISTERS = 32 if WIDE else 16

#: Weight bytes of one GEMV loop iteration, by field bits: one vector of 2- and 1-bit fields
#: (the AVX-512 GEMV this replaced read 128 bytes an iteration, and BitNet 2B's down
#: projection, 1728 bytes a row, then summed 64 of them a row in scalar code), two of int8
#: codes. A row that ends inside a block reads that block whole (``_gemv_kernel``): summed in
#: scalar code, such a tail made the GEMV several times slower (2-core EPYC Zen 4, one row: sign
#: 6912 x 2560, 864 bytes a row, 0.44 against 0.08-0.11 ms; ternary 2688 x 2560 0.34 against
#: 0.044 ms).
BLOCK_BYTES = {2: GEMV_VECTOR_BYTES, 1: GEMV_VECTOR_BYTES,
               8: 2 * GEMV_VECTOR_BYTES if GEMV_DPBUSD else GEMV_VECTOR_BYTES}
#: What ``gemm`` subtracts per activation code from an int8-weight raw sum (the sign flip of
#: ``vpdpbusd``; the AVX2 int16 products need none); ``GEMV_INT8_OFFSET``: the same for ``gemv``.
INT8_OFFSET = 128 if AVX_VNNI else 0
GEMV_INT8_OFFSET = 128 if GEMV_DPBUSD else 0
#: Longest run of ``vpmaddubsw`` results an int16 lane sums exactly, by field bits (the GEMM's).
INT16_STEPS = {2: 32767 // (2 * 3 * 128), 1: 32767 // (2 * 1 * 128)}


def _splat(ty, value):
    return ir.Constant(ty, [value] * ty.count)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _maddubs(builder, u, s):
    """int16 pairs of u8 x s8 products (32 bytes each)."""
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16,
                 [builder.bitcast(u, _B32), builder.bitcast(s, _B32)])


def _madd(builder, a, b):
    """int32 pairs of int16 products."""
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8, [a, b])


def _widen(builder, w16):
    """int32 sums of adjacent int16 lanes."""
    return _madd(builder, w16, _splat(_W16, 1))


def _dpbusd(builder, acc, u, s):
    """acc + the sums of four u8 x s8 products per int32 lane (AVX-VNNI on 8 lanes, AVX-512
    VNNI on 16)."""
    return _call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * acc.type.count}", acc.type,
                 [acc, u, s])


def _sext16(builder, base, offset):
    """16 int8 at byte ``offset`` from ``base``, sign-extended to int16."""
    v = builder.load(ptr(builder, base, offset, ir.VectorType(_I8, 16)), align=1)
    return builder.sext(v, _W16)


def _field(builder, w, bits, j):
    """Field j of a vector of packed bytes masked to the low bits of each byte (int8 codes: the
    bytes with their sign bit flipped)."""
    if bits == 8:
        return builder.xor(w, _splat(w.type, 0x80808080 - (1 << 32)))
    mask = {2: 0x03030303, 1: 0x01010101}[bits]
    return builder.and_(builder.lshr(w, _splat(w.type, bits * j)) if j else w,
                        _splat(w.type, mask))


def _tree_sum(builder, values):
    while len(values) > 1:
        values = [builder.add(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _reduce(builder, v):
    return _call(builder, f"llvm.vector.reduce.add.v{v.type.count}i32", _I32, [v])


#: Blocks of 2-bit fields whose products ``_ternary_row`` adds in int16 before it widens them.
TERNARY_SPAN = 5
#: How far ahead of its reads the one-row GEMV prefetches a weight row's bytes (into L1):
#: BitNet 2B's 120 decode projections from DRAM, compiled for Haswell on the 2-core EPYC Zen 4,
#: with ``_ternary_row``'s sums, in one process: 1536 bytes 1.10x, 2048 1.13x, 3072 1.13x
#: the kernel before either change (its sums alone: 0.96-1.03x; 4096 bytes 1.08x, 8192 1.06x).
PREFETCH_BYTES = 2048
#: Whether the 256-bit ``vpdpbusd`` GEMV (AVX-VNNI) prefetches as far ahead for one activation
#: row against 2- and 1-bit fields: the same EPYC compiling for Alder Lake with the EVEX
#: ``vpdpbusd`` (see above), the 120 projections from DRAM in one process, ternary 1.07-1.18x,
#: sign (the same shapes) 1.14-1.17x, in cache 1.00-1.03x; not for int8 weights (0.94x), not on
#: 512-bit vectors (noise-level), nor in AVX2's ``vpmaddubsw`` GEMV of sign weights (1.03x).
PREFETCH_DPBUSD = AVX_VNNI and not WIDE


def _ternary_products(builder, row, at, offset):
    """The int16 pair sums ``(P0 + P2, 4 (P1 + P3))`` of the 32 packed bytes at byte ``offset`` of
    ``row``, ``Pf`` the ``vpmaddubsw`` products of field f with its plane ``at[f]``. One shift:
    fields 0 and 2 are masked by 0x03 from the bytes and from the bytes shifted right by 4,
    fields 1 and 3 by 0x0C, in place (four times their values)."""
    prefetch(builder, ptr(builder, row, builder.add(offset, ir.Constant(offset.type,
                                                                       PREFETCH_BYTES))))
    w = builder.load(ptr(builder, row, offset, _V8), align=1)
    low, high = _splat(_V8, 0x03030303), _splat(_V8, 0x0C0C0C0C)
    s = builder.lshr(w, _splat(_V8, 4))
    fields = [builder.and_(w, low), builder.and_(w, high), builder.and_(s, low),
              builder.and_(s, high)]
    p = [_maddubs(builder, fields[f], builder.load(ptr(builder, at[f], offset, _V8), align=1))
         for f in range(4)]
    return builder.add(p[0], p[2]), builder.add(p[1], p[3])


def _ternary_row(builder, intp, row, at, start, niter):
    """The raw int32 sum of one activation row (``at[f]``: its plane of field f) with the 2-bit
    fields of ``niter`` 32-byte blocks of ``row`` from byte ``start``, on AVX2 (``dot_group``'s
    kernel for one activation row).

    Each block's ``_ternary_products`` are added in int16 over ``TERNARY_SPAN`` blocks (a lane
    of P1 + P3 is at most 2 * (2 * 3 * 128) = 1536, times four 6144, over five blocks 30720 <
    32767), then widened by ``vpmaddwd`` with 4 and with 1 into int32 lanes that hold four times
    the sum, divided by 4 after the lanes are added (exact while four times the sum fits in
    int32: ``gemv``'s chunks of K keep it far below). Per block 5 mask and shift operations, 4
    products and about 4.4 adds, where a shift and a mask per field and a widening per block
    took 16. Four activation rows keep ``dot_group``'s loop (their int16 sums spill: 2048 x 2560,
    in cache, 135 against 110 us), and so does each weight row, one after the next: two side by
    side, each activation vector loaded once for both, streamed from DRAM at 0.75x.
    """
    def const(value):
        return ir.Constant(intp, value)

    four = _splat(_W16, 4)

    def widen(acc, sums):
        return builder.add(acc, builder.add(_madd(builder, sums[0], four),
                                            _widen(builder, sums[1])))

    def products(block):
        return _ternary_products(builder, row, at,
                                 builder.add(start, builder.mul(block, const(_BYTES))))

    spans = builder.udiv(niter, const(TERNARY_SPAN))

    def span(it, accs):
        first = builder.mul(it, const(TERNARY_SPAN))
        even, odd = products(first)
        for b in range(1, TERNARY_SPAN):
            e, o = products(builder.add(first, const(b)))
            even, odd = builder.add(even, e), builder.add(odd, o)
        return [widen(accs[0], (even, odd))]

    accs = counted_loop(builder, intp, spans, [_splat(_V8, 0)], span, "spans")
    done = builder.mul(spans, const(TERNARY_SPAN))

    def single(it, accs):
        return [widen(accs[0], products(builder.add(done, it)))]

    acc = counted_loop(builder, intp, builder.sub(niter, done), accs, single, "blocks")[0]
    return builder.ashr(_reduce(builder, acc), ir.Constant(_I32, 2))


def dot_group(bits, rows):
    """Intrinsic ``dot(planes, m0, data, n0, width, start, niter, acc)``: adds to ``acc[m0 + r,
    j]`` the raw sums of activation rows ``m0 .. m0 + rows`` with packed weight rows ``n0 + j``,
    ``j < width``, one weight row after the other in one loop nest (a call per row spent about as
    long on its entry, pointers and horizontal sum as on the ten blocks of a row at K = 2560).

    ``planes``: C-contiguous int8 ``[M, fields, >= nbytes]`` (``_vnni._planes``); ``data``:
    C-contiguous uint8 ``[N, nbytes]``; ``acc``: C-contiguous int32 ``[M, >= width]``; the sums
    run over ``niter * BLOCK_BYTES[bits]`` bytes from byte ``start``: ``sum_g sum_j
    field_j(row[g]) * planes[m, j, g]``, for int8 weights ``sum_g (row[g] + GEMV_INT8_OFFSET) *
    planes[m, 0, g]`` (row as int8); int32 wrap-around.
    """
    fields = 8 // bits if bits < 8 else 1
    block = BLOCK_BYTES[bits]
    vec = ir.VectorType(_I32, GEMV_LANES)
    vectors = block // GEMV_VECTOR_BYTES
    # Independent vpdpbusd chains a row (its latency is several cycles): one per product of an
    # iteration, at most half the vector registers over all rows (the rest hold the weight
    # fields and activation loads; more accumulators than that spill).
    chains = (min(fields * vectors, max(1, GEMV_REGISTERS // 2 // rows)) if GEMV_DPBUSD
              else (2 if bits == 8 else 1))

    @intrinsic
    def dot(typingctx, planes, m0, data, n0, width, start, niter, acc):
        if not (is_array(planes, 3, (types.int8,))
                and is_array(data, 2, (types.uint8, types.int8))
                and is_array(acc, 2, (types.int32,))):
            return None
        sig = types.void(planes, types.intp, data, types.intp, types.intp, types.intp,
                         types.intp, acc)

        def codegen(context, builder, signature, args):
            pl = context.make_array(signature.args[0])(context, builder, args[0])
            dt = context.make_array(signature.args[2])(context, builder, args[2])
            ac = context.make_array(signature.args[7])(context, builder, args[7])
            intp = context.get_value_type(types.intp)
            s0, s1, _ = cgutils.unpack_tuple(builder, pl.strides, 3)
            w0 = cgutils.unpack_tuple(builder, dt.strides, 2)[0]
            a0 = cgutils.unpack_tuple(builder, ac.strides, 2)[0]

            def const(value):
                return ir.Constant(intp, value)

            at = [[ptr(builder, pl.data, builder.add(
                builder.mul(s0, builder.add(args[1], const(r))), builder.mul(s1, const(j))))
                for j in range(fields)] for r in range(rows)]
            out = [ptr(builder, ac.data, builder.mul(a0, builder.add(args[1], const(r))), _I32)
                   for r in range(rows)]

            def one_row(j, _):
                row = ptr(builder, dt.data, builder.mul(w0, builder.add(args[3], j)))

                if bits == 2 and rows == 1 and not GEMV_DPBUSD:
                    at_j = builder.gep(out[0], [j])
                    total = _ternary_row(builder, intp, row, at[0], args[5], args[6])
                    builder.store(builder.add(builder.load(at_j, align=4), total), at_j, align=4)
                    return []

                def step(it, accs):
                    start = builder.add(args[5], builder.mul(it, const(block)))
                    if PREFETCH_DPBUSD and rows == 1 and bits < 8:
                        prefetch(builder, ptr(builder, row,
                                              builder.add(start, const(PREFETCH_BYTES))))
                    offs = [builder.add(start, const(v * GEMV_VECTOR_BYTES))
                            for v in range(vectors)]
                    new = list(accs)
                    if bits == 8 and not GEMV_DPBUSD:
                        halves = [builder.add(o, const(h)) for o in offs for h in (0, 16)]
                        ws = [_sext16(builder, row, o) for o in halves]
                        for r in range(rows):
                            for i, o in enumerate(halves):
                                c = r * chains + i % chains
                                new[c] = builder.add(new[c], _madd(
                                    builder, ws[i], _sext16(builder, at[r][0], o)))
                        return new
                    us = [[_field(builder, builder.load(ptr(builder, row, o, vec), align=1),
                                  bits, f) for f in range(fields)] for o in offs]
                    for r in range(rows):
                        prods = []
                        for v, o in enumerate(offs):
                            for f in range(fields):
                                x = builder.load(ptr(builder, at[r][f], o, vec), align=1)
                                if GEMV_DPBUSD:
                                    c = r * chains + (v * fields + f) % chains
                                    new[c] = _dpbusd(builder, new[c], us[v][f], x)
                                else:
                                    prods.append(_maddubs(builder, us[v][f], x))
                        if prods:  # at most 8 pairs of <= 768: exact in int16
                            new[r] = builder.add(new[r],
                                                 _widen(builder, _tree_sum(builder, prods)))
                    return new

                accs = counted_loop(builder, intp, args[6], [_splat(vec, 0)] * (rows * chains),
                                    step, "dot")
                for r in range(rows):
                    total = _reduce(builder, _tree_sum(builder, accs[r * chains:(r + 1) * chains]))
                    at_j = builder.gep(out[r], [j])
                    builder.store(builder.add(builder.load(at_j, align=4), total), at_j, align=4)
                return []

            counted_loop(builder, intp, args[4], [], one_row, "rows")
            return context.get_dummy_value()

        return sig, codegen

    return dot


# ---------------------------------------------------------------------------------------------
# GEMV
_D21, _D24, _D11, _D14, _D81, _D84 = (dot_group(b, r) for b in (2, 1, 8) for r in (1, 4))


@numba.njit(cache=True)
def _tail(raw, pl, row, start, bits, offset, xs, sx, sw):
    """float32(acc) * sx * sw from the raw block sum plus the tail bytes from ``start``."""
    fields = pl.shape[0]
    mask = (1 << bits) - 1
    for g in range(start, row.shape[0]):
        if bits == 8:
            raw += (np.int32(np.int8(row[g])) + offset) * np.int32(pl[0, g])
        else:
            b = np.int32(row[g])
            for j in range(fields):
                raw += ((b >> (bits * j)) & mask) * np.int32(pl[j, g])
    # int32 wrap-around throughout: exact whenever the true sum fits in int32
    acc = np.int32(np.int64(raw) * (2 if bits == 1 else 1) - xs)
    return (np.float32(acc) * sx) * sw


#: Output columns of one GEMV task (measured on a 2-core Intel Xeon with AVX-512 VNNI, BitNet 2B's
#: 210 decode projections from DRAM, one row: 16 columns 37 ms, 8 to 64 42-45 ms, 256 40 ms; 16
#: rows 169 against 232 ms; the 256-bit kernels there, forced, 49 against 52 and 248 against
#: 348 ms), and the bytes of activation planes one pass over a chunk of K keeps (in L2) while it
#: runs down those columns (16 KB chunks, for L1, measured slower: 16 rows x 4096 x 4096
#: ternary 6.1 against 4.3 ms on one core, the per-call overhead of the short runs).
GEMV_COLUMNS = 16
GEMV_PLANE_BYTES = 1 << 18


@numba.njit(cache=True, inline="always")
def _dot_rows(planes, data, bits, n0, width, c0, niter, acc):
    """``dot_group``'s sums for every activation row, four at a time, over weight rows ``n0 ..
    n0 + width``, ``niter`` blocks from byte ``c0``."""
    M = planes.shape[0]
    m = 0
    while m + 4 <= M:
        if bits == 2:
            _D24(planes, m, data, n0, width, c0, niter, acc)
        elif bits == 1:
            _D14(planes, m, data, n0, width, c0, niter, acc)
        else:
            _D84(planes, m, data, n0, width, c0, niter, acc)
        m += 4
    for r in range(m, M):
        if bits == 2:
            _D21(planes, r, data, n0, width, c0, niter, acc)
        elif bits == 1:
            _D11(planes, r, data, n0, width, c0, niter, acc)
        else:
            _D81(planes, r, data, n0, width, c0, niter, acc)


@numba.njit(parallel=True, cache=True)
def _gemv_kernel(planes, data, bits, block, chunk, offset, xsum, scale_x, scale_w, out):
    """out[m, n] = float32(acc) * scale_x[m] * scale_w[n] (the contract of ``gemv``).

    Parallel over groups of GEMV_COLUMNS weight rows; K runs in chunks of ``chunk`` packed bytes
    (a multiple of ``block``) so that the rows' planes of one chunk stay in cache while each
    weight row of the group meets up to four activation rows at a time.

    A row's last bytes short of a block (``planes``: zero from K to a whole block past them) are
    read as one more block: it runs on into the next rows of ``data`` (C-contiguous), whose
    bytes meet zero planes and add nothing. The last rows, whose block would end past ``data``,
    stop at their whole blocks and add their last bytes in scalar code (``_tail``).
    """
    M = planes.shape[0]
    N, nbytes = data.shape
    whole = nbytes // block * block
    span = planes.shape[2]  # whole, or a block more where rows end inside one
    # rows whose reads up to ``span`` stay inside data (all when no row ends inside a block)
    inside = N if span == whole else max(0, N - (span - 1) // nbytes)
    stride = 1 if scale_w.shape[0] > 1 else 0
    C = GEMV_COLUMNS
    for p in numba.prange((N + C - 1) // C):
        n0 = p * C
        width = min(C, N - n0)
        full = min(width, max(0, inside - n0))  # rows read to span; the rest to whole + _tail
        acc = np.zeros((M, C), np.int32)
        rest = np.zeros((M, C), np.int32) if full < width else acc  # the rows from ``full``
        for c0 in range(0, span, chunk):
            if full > 0:
                _dot_rows(planes, data, bits, n0, full, c0, min(chunk, span - c0) // block, acc)
            if full < width and c0 < whole:
                _dot_rows(planes, data, bits, n0 + full, width - full, c0,
                          min(chunk, whole - c0) // block, rest)
        mult = 2 if bits == 1 else 1
        for j in range(width):
            n = n0 + j
            sw = scale_w[n * stride]
            if j < full:  # every byte summed (no views, no call)
                for m in range(M):
                    v = np.int32(np.int64(acc[m, j]) * mult - xsum[m])
                    out[m, n] = (np.float32(v) * scale_x[m]) * sw
                continue
            row = data[n]
            for m in range(M):
                out[m, n] = _tail(rest[m, j - full], planes[m], row, whole, bits, offset,
                                  xsum[m], scale_x[m], sw)


def gemv(codes_x, scale_x, data, scale_w, bits, out):
    """out = float32(codes_x @ codes_w) * scale_x[:, None] * scale_w for few rows.

    codes_x: [M, K] int8; data: packed [N, bytes] of ``bits``-bit codes; scale_w: [1] or [N]
    float32; out: [M, N] float32, overwritten.
    """
    per = 8 // bits if bits < 8 else 1
    offset = GEMV_INT8_OFFSET if bits == 8 else 1
    block = BLOCK_BYTES[bits]
    # planes to a whole block past a row's last bytes, zero past K (see _gemv_kernel)
    planes = np.empty((codes_x.shape[0], per, -(-data.shape[1] // block) * block), np.int8)
    xsum = np.empty(codes_x.shape[0], dtype=np.int32)
    _planes(codes_x, per, offset, planes, xsum)
    chunk = max(block, GEMV_PLANE_BYTES // (codes_x.shape[0] * per) // block * block)
    _gemv_kernel(planes, data, bits, block, chunk, offset if bits == 8 else 0, xsum, scale_x,
                 scale_w, out)
