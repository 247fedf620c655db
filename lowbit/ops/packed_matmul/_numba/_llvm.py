"""LLVM code generation helpers shared by the intrinsics of ``_vnni.py``, ``_fma.py``, ``_avx2.py``
and the others built on them (the gated delta rule's prefetch, ``gated_delta_scan/``).

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``_vnni.py`` (integer VNNI kernels), ``_fma.py``
(float32 FMA tiles), ``__init__.py``. Plain Python that emits IR, no kernels: the intrinsics and
the kernels that call them stay together in their own files, and ``numba_cache_guard`` in
``__init__.py`` clears the package's cached kernels, so an edit here recompiles every one built
with it.
"""

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils


def host_features():
    """LLVM feature flags of the CPU Numba compiles for (``"+avx512f"``, ...); none where
    intrinsics cannot run or llvmlite cannot read them."""
    if numba.config.DISABLE_JIT:  # intrinsics exist only in compiled code
        return frozenset()
    features = numba.config.CPU_FEATURES
    if features is None:
        try:
            features = llvm.get_host_cpu_features().flatten()
        except RuntimeError:  # llvmlite cannot read this host's features: assume none
            return frozenset()
    return frozenset(features.split(","))


def ptr(builder, base, offset, to=ir.IntType(8)):
    """Pointer to a value of type ``to`` at byte ``offset`` from ``base``."""
    byte = builder.gep(builder.bitcast(base, ir.IntType(8).as_pointer()), [offset])
    return builder.bitcast(byte, to.as_pointer())


def prefetch(builder, address, write=False, locality=3):
    """Emit ``llvm.prefetch`` of the cache line at ``address`` (any pointer) into the data cache:
    for reading or ``write``, ``locality`` 3 into every level (``prefetcht0``), 2 into L2 and
    outward (``prefetcht1``). A hint: it changes no value and never faults."""
    byte = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    # The typed-pointer name of Numba's older LLVMs; newer ones upgrade it to theirs.
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(address, byte), ir.Constant(i32, int(write)),
                      ir.Constant(i32, locality), ir.Constant(i32, 1)])


def counted_loop(builder, intp, count, initial, step, name):
    """Emit ``for it in range(count)`` carrying vectors from their ``initial`` values through
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
    for value in initial:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
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


def is_array(ty, ndim, dtypes):
    """Whether a Numba type is a C-contiguous array of ``ndim`` dimensions and one of ``dtypes``."""
    return (isinstance(ty, types.Array) and ty.ndim == ndim and ty.layout == "C"
            and ty.dtype in dtypes)
