"""x86 AVX-512 VNNI byte dot products for Numba kernels, as LLVM intrinsics.

LLVM does not form ``vpdpbusd`` (64 unsigned-by-signed byte products summed into sixteen int32
lanes, one instruction) from a plain Numba loop, so the packed-weight GEMV emits it directly.
``dot_fields(bits)`` returns a Numba intrinsic ``dot(planes, row, niter) -> int32``:

- ``row``: a contiguous uint8 row of packed weight bytes; ``planes``: a C-contiguous int8
  ``[fields, >= len(row)]`` array of activation codes with ``planes[j, g]`` the code that meets
  field ``j`` of byte ``g``;
- ``bits`` 2 or 1: byte ``g`` holds ``8 // bits`` fields LSB-first; the result is
  ``sum_g sum_j field_j(row[g]) * planes[j, g]`` over the first ``niter * BLOCK_BYTES[bits]``
  bytes (the caller sums the tail);
- ``bits`` 8: the row holds int8 codes and ``planes`` has one field; the result is
  ``sum_g (row[g] + 128) * planes[0, g]`` (the sign bit flipped makes the weight the unsigned
  operand; the caller subtracts ``128 * sum(planes[0])``).

Each field keeps its own accumulator chains (``vpdpbusd`` has a latency of several cycles), and
the sixteen lanes are reduced once at the end. ``AVAILABLE`` says whether the CPU Numba compiles
for has the instruction; the kernels fall back to portable loops when it does not.
"""

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _host_has_vnni():
    if numba.config.DISABLE_JIT:  # intrinsics exist only in compiled code
        return False
    features = numba.config.CPU_FEATURES
    if features is None:
        try:
            features = llvm.get_host_cpu_features().flatten()
        except RuntimeError:  # llvmlite cannot read this host's features: assume none
            return False
    return "+avx512vnni" in features.split(",") and "+avx512bw" in features.split(",")


#: True when the target CPU has AVX-512 VNNI (``vpdpbusd`` on 512-bit registers).
AVAILABLE = _host_has_vnni()

#: Bytes of the packed row one iteration of each kernel's loop consumes.
BLOCK_BYTES = {2: 128, 1: 64, 8: 256}

_VEC = ir.VectorType(ir.IntType(32), 16)
_BYTES = 64


def _ptr(builder, base, offset, to=ir.IntType(8)):
    """Pointer to a value of type ``to`` at byte ``offset`` from ``base``."""
    byte = builder.gep(builder.bitcast(base, ir.IntType(8).as_pointer()), [offset])
    return builder.bitcast(byte, to.as_pointer())


def _splat(value):
    return ir.Constant(_VEC, [value] * 16)


def dot_fields(bits):
    """The intrinsic for fields of ``bits`` bits (see the module docstring)."""
    fields = 8 // bits if bits < 8 else 1
    blocks = BLOCK_BYTES[bits] // _BYTES
    mask = {2: 0x03030303, 1: 0x01010101}.get(bits)

    @intrinsic
    def dot(typingctx, planes, row, niter):
        if not (isinstance(planes, types.Array) and planes.ndim == 2 and planes.layout == "C"
                and planes.dtype == types.int8):
            return None
        if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
                and row.dtype in (types.uint8, types.int8)):
            return None
        sig = types.int32(planes, row, types.intp)

        def codegen(context, builder, signature, args):
            planes_ty, row_ty, _ = signature.args
            pl = context.make_array(planes_ty)(context, builder, args[0])
            rw = context.make_array(row_ty)(context, builder, args[1])
            count = args[2]
            byte = ir.IntType(8)
            intp = context.get_value_type(types.intp)
            plane_stride = cgutils.unpack_tuple(builder, pl.strides, 2)[0]
            module = builder.module
            dpbusd = cgutils.get_or_insert_function(
                module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]), "llvm.x86.avx512.vpdpbusd.512")
            reduce_add = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.IntType(32), [_VEC]), "llvm.vector.reduce.add.v16i32")

            def load(base, offset):
                return builder.load(_ptr(builder, base, offset, _VEC), align=1)

            entry = builder.block
            head = builder.append_basic_block("vnni.head")
            body = builder.append_basic_block("vnni.body")
            done = builder.append_basic_block("vnni.done")
            zero_acc = _splat(0)
            builder.branch(head)

            builder.position_at_end(head)
            it = builder.phi(intp)
            it.add_incoming(ir.Constant(intp, 0), entry)
            accs = []
            for _ in range(fields * blocks):
                phi = builder.phi(_VEC)
                phi.add_incoming(zero_acc, entry)
                accs.append(phi)
            builder.cbranch(builder.icmp_signed("<", it, count), body, done)

            builder.position_at_end(body)
            start = builder.mul(it, ir.Constant(intp, BLOCK_BYTES[bits]))
            new = []
            for blk in range(blocks):
                offset = builder.add(start, ir.Constant(intp, blk * _BYTES))
                w = load(rw.data, offset)
                for j in range(fields):
                    plane = _ptr(builder, pl.data, builder.mul(plane_stride, ir.Constant(intp, j)))
                    x = load(plane, offset)
                    if bits == 8:
                        a = builder.xor(w, _splat(0x80808080 - (1 << 32)))
                    else:
                        shifted = builder.lshr(w, _splat(bits * j)) if j else w
                        a = builder.and_(shifted, _splat(mask))
                    acc = accs[blk * fields + j]
                    new.append(builder.call(dpbusd, [acc, a, x]))
            nxt = builder.add(it, ir.Constant(intp, 1))
            it.add_incoming(nxt, body)
            for phi, value in zip(accs, new):
                phi.add_incoming(value, body)
            builder.branch(head)

            builder.position_at_end(done)
            total = accs[0]
            for acc in accs[1:]:
                total = builder.add(total, acc)
            return builder.call(reduce_add, [total])

        return sig, codegen

    return dot


#: Columns of a GEMM panel (four vectors of sixteen int32 lanes) and most rows of one tile.
PANEL = 64
TILE_ROWS = 6


def gemm_tile(rows):
    """Intrinsic ``tile(a, m0, panel, count, c)``: int32 ``c[:rows, :64]`` = products of ``rows``
    rows of int8 codes with one panel of byte weights, over ``count`` groups of four K.

    ``a``: C-contiguous int8 ``[M, >= 4 count]``, rows ``m0 .. m0 + rows``; ``panel``:
    C-contiguous uint32 ``[>= count, 64]``, ``panel[q, n]`` holding the four unsigned weight bytes
    of column ``n`` for K ``4q .. 4q + 3`` (lowest byte first); ``c``: C-contiguous int32
    ``[>= rows, 64]``, overwritten. ``rows * 4`` accumulators stay in registers for the whole of K;
    each step loads four weight vectors and broadcasts one 4-byte group per row into
    ``vpdpbusd`` (the broadcast folds into the instruction's memory operand).
    """
    vectors = PANEL // 16

    @intrinsic
    def tile(typingctx, a, m0, panel, count, c):
        ok = (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C"
              and a.dtype == types.int8
              and isinstance(panel, types.Array) and panel.ndim == 2 and panel.layout == "C"
              and panel.dtype == types.uint32
              and isinstance(c, types.Array) and c.ndim == 2 and c.layout == "C"
              and c.dtype == types.int32)
        if not ok:
            return None
        sig = types.void(a, types.intp, panel, types.intp, c)

        def codegen(context, builder, signature, args):
            a_ty, _, panel_ty, _, c_ty = signature.args
            arr_a = context.make_array(a_ty)(context, builder, args[0])
            arr_p = context.make_array(panel_ty)(context, builder, args[2])
            arr_c = context.make_array(c_ty)(context, builder, args[4])
            m0, count = args[1], args[3]
            byte, i32 = ir.IntType(8), ir.IntType(32)
            intp = context.get_value_type(types.intp)
            a_stride = cgutils.unpack_tuple(builder, arr_a.strides, 2)[0]
            c_stride = cgutils.unpack_tuple(builder, arr_c.strides, 2)[0]
            dpbusd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]),
                "llvm.x86.avx512.vpdpbusd.512")

            def at(base, offset):
                return _ptr(builder, base, offset)

            def const(value):
                return ir.Constant(intp, value)

            a_rows = [at(arr_a.data, builder.mul(builder.add(m0, const(r)), a_stride))
                      for r in range(rows)]
            entry = builder.block
            head = builder.append_basic_block("tile.head")
            body = builder.append_basic_block("tile.body")
            done = builder.append_basic_block("tile.done")
            builder.branch(head)

            builder.position_at_end(head)
            it = builder.phi(intp)
            it.add_incoming(const(0), entry)
            accs = []
            for _ in range(rows * vectors):
                phi = builder.phi(_VEC)
                phi.add_incoming(_splat(0), entry)
                accs.append(phi)
            builder.cbranch(builder.icmp_signed("<", it, count), body, done)

            builder.position_at_end(body)
            w_base = builder.mul(it, const(PANEL * 4))
            weights = [builder.load(_ptr(builder, arr_p.data, builder.add(w_base, const(64 * v)),
                                         _VEC), align=4) for v in range(vectors)]
            zero_mask = ir.Constant(ir.VectorType(i32, 16), [0] * 16)
            new = []
            for r in range(rows):
                x = builder.load(_ptr(builder, a_rows[r], builder.mul(it, const(4)), i32), align=1)
                one = builder.insert_element(ir.Constant(_VEC, None), x, ir.Constant(i32, 0))
                xb = builder.shuffle_vector(one, ir.Constant(_VEC, None), zero_mask)
                for v in range(vectors):
                    new.append(builder.call(dpbusd, [accs[r * vectors + v], weights[v], xb]))
            it.add_incoming(builder.add(it, const(1)), body)
            for phi, value in zip(accs, new):
                phi.add_incoming(value, body)
            builder.branch(head)

            builder.position_at_end(done)
            for r in range(rows):
                row = at(arr_c.data, builder.mul(const(r), c_stride))
                for v in range(vectors):
                    builder.store(accs[r * vectors + v], _ptr(builder, row, const(64 * v), _VEC),
                                  align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile
