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

``gemm_tile(rows)`` is the GEMM's register tile (see there).

Each field keeps its own accumulator chains (``vpdpbusd`` has a latency of several cycles), and
the sixteen lanes are reduced once at the end. ``AVAILABLE`` says whether the CPU Numba compiles
for has the instruction; the kernels fall back to portable loops when it does not.

Numba's on-disk cache keys a kernel on its own source file only: after editing this file, touch
``lowbit/ops/packed_matmul/_numba.py`` (or clear its ``__pycache__``), or the kernels that call
these intrinsics keep their old machine code.
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


def _dpbusd(builder, acc, unsigned, signed):
    """acc + the sums of four u8 x s8 products per int32 lane."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, unsigned, signed])


def _reduce_add(builder, vectors):
    """int32 sum of every lane of the vectors."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_VEC]),
                                        "llvm.vector.reduce.add.v16i32")
    total = vectors[0]
    for v in vectors[1:]:
        total = builder.add(total, v)
    return builder.call(fn, [total])


def _field(builder, w, bits, j):
    """The unsigned operand of field j of 64 packed bytes: the field masked down to the low bits
    of each byte, or for int8 codes the bytes with their sign bit flipped."""
    if bits == 8:
        return builder.xor(w, _splat(0x80808080 - (1 << 32)))
    mask = {2: 0x03030303, 1: 0x01010101}[bits]
    return builder.and_(builder.lshr(w, _splat(bits * j)) if j else w, _splat(mask))


def _counted_loop(builder, intp, count, accumulators, step, name):
    """Emit ``for it in range(count)`` carrying ``accumulators`` vectors (from zero) through
    ``step(it, accs) -> new accs``; returns their values after the loop."""
    entry = builder.block
    head = builder.append_basic_block(f"{name}.head")
    body = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(head)
    builder.position_at_end(head)
    it = builder.phi(intp)
    it.add_incoming(ir.Constant(intp, 0), entry)
    accs = []
    for _ in range(accumulators):
        phi = builder.phi(_VEC)
        phi.add_incoming(_splat(0), entry)
        accs.append(phi)
    builder.cbranch(builder.icmp_signed("<", it, count), body, done)
    builder.position_at_end(body)
    new = step(it, accs)
    it.add_incoming(builder.add(it, ir.Constant(intp, 1)), builder.block)
    for phi, value in zip(accs, new):
        phi.add_incoming(value, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return accs


def _is_array(ty, ndim, dtypes):
    return (isinstance(ty, types.Array) and ty.ndim == ndim and ty.layout == "C"
            and ty.dtype in dtypes)


def dot_fields(bits):
    """The intrinsic for fields of ``bits`` bits (see the module docstring). The plane pointers
    are formed once, outside the loop: formed in it, the same kernel ran 1.3x slower (measured,
    ternary 1 x 4096 x 4096)."""
    fields = 8 // bits if bits < 8 else 1
    blocks = BLOCK_BYTES[bits] // _BYTES

    @intrinsic
    def dot(typingctx, planes, row, niter):
        if not (_is_array(planes, 2, (types.int8,))
                and _is_array(row, 1, (types.uint8, types.int8))):
            return None
        sig = types.int32(planes, row, types.intp)

        def codegen(context, builder, signature, args):
            pl = context.make_array(signature.args[0])(context, builder, args[0])
            rw = context.make_array(signature.args[1])(context, builder, args[1])
            intp = context.get_value_type(types.intp)
            plane_stride = cgutils.unpack_tuple(builder, pl.strides, 2)[0]
            planes_at = [_ptr(builder, pl.data, builder.mul(plane_stride, ir.Constant(intp, j)))
                         for j in range(fields)]

            def step(it, accs):
                start = builder.mul(it, ir.Constant(intp, BLOCK_BYTES[bits]))
                new = []
                for blk in range(blocks):
                    offset = builder.add(start, ir.Constant(intp, blk * _BYTES))
                    w = builder.load(_ptr(builder, rw.data, offset, _VEC), align=1)
                    for j in range(fields):
                        x = builder.load(_ptr(builder, planes_at[j], offset, _VEC), align=1)
                        new.append(_dpbusd(builder, accs[blk * fields + j],
                                           _field(builder, w, bits, j), x))
                return new

            accs = _counted_loop(builder, intp, args[2], fields * blocks, step, "dot")
            return _reduce_add(builder, accs)

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
        if not (_is_array(a, 2, (types.int8,)) and _is_array(panel, 2, (types.uint32,))
                and _is_array(c, 2, (types.int32,))):
            return None
        sig = types.void(a, types.intp, panel, types.intp, c)

        def codegen(context, builder, signature, args):
            arr_a = context.make_array(signature.args[0])(context, builder, args[0])
            arr_p = context.make_array(signature.args[2])(context, builder, args[2])
            arr_c = context.make_array(signature.args[4])(context, builder, args[4])
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            a_stride = cgutils.unpack_tuple(builder, arr_a.strides, 2)[0]
            c_stride = cgutils.unpack_tuple(builder, arr_c.strides, 2)[0]

            def const(value):
                return ir.Constant(intp, value)

            a_rows = [_ptr(builder, arr_a.data, builder.mul(builder.add(args[1], const(r)),
                                                             a_stride)) for r in range(rows)]
            zero_mask = ir.Constant(ir.VectorType(i32, 16), [0] * 16)

            def step(it, accs):
                w_base = builder.mul(it, const(PANEL * 4))
                weights = [builder.load(_ptr(builder, arr_p.data,
                                             builder.add(w_base, const(64 * v)), _VEC), align=4)
                           for v in range(vectors)]
                new = []
                for r in range(rows):
                    x = builder.load(_ptr(builder, a_rows[r], builder.mul(it, const(4)), i32),
                                     align=1)
                    one = builder.insert_element(ir.Constant(_VEC, None), x, ir.Constant(i32, 0))
                    xb = builder.shuffle_vector(one, ir.Constant(_VEC, None), zero_mask)
                    for v in range(vectors):
                        new.append(_dpbusd(builder, accs[r * vectors + v], weights[v], xb))
                return new

            accs = _counted_loop(builder, intp, args[3], rows * vectors, step, "tile")
            for r in range(rows):
                row = _ptr(builder, arr_c.data, builder.mul(const(r), c_stride))
                for v in range(vectors):
                    builder.store(accs[r * vectors + v], _ptr(builder, row, const(64 * v), _VEC),
                                  align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile
