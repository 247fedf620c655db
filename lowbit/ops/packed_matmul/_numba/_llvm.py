"""LLVM code generation helpers shared by the intrinsics of ``_vnni.py`` and ``_fma.py``.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``_vnni.py`` (integer VNNI kernels), ``_fma.py``
(float32 FMA tiles), ``__init__.py``. Plain Python that emits IR, no kernels: the intrinsics and
the kernels that call them stay together in their own files, and ``numba_cache_guard`` in
``__init__.py`` restamps the package, so an edit here recompiles every cached kernel built with it.
"""

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types


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
