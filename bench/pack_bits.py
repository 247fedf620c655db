"""Suite ``pack_bits``: pack/unpack throughput against vectorized NumPy and a plain copy.

Op: ``lowbit/ops/pack_bits``; reference: ``reference/pack_bits.py``.
"""

from __future__ import annotations

import numpy as np

import lowbit
from lowbit.reference.pack_bits import pack_bits_ref

from . import _harness
from ._harness import Case, Config



def cases(config: Config):
    xp = _harness.xp(config)
    n = 1 << (20 if config.quick else 24)
    rng = np.random.default_rng(0)
    backend = config.backend or ("cuda" if config.gpu else None)
    small = rng.integers(0, 4, (3, 1001), dtype=np.uint8)

    def check_small(bits):
        codes = small & ((1 << bits) - 1)
        with _maybe(backend):
            packed = lowbit.pack_bits(xp.asarray(codes), bits)
            back = lowbit.unpack_bits(packed, bits, codes.shape[-1])
        np.testing.assert_array_equal(_host(packed), pack_bits_ref(codes, bits))
        np.testing.assert_array_equal(_host(back), codes)

    src = xp.asarray(rng.integers(0, 256, n, dtype=np.uint8))
    dst = xp.empty_like(src)
    yield Case("pack_bits", "copy", fn=lambda: xp.copyto(dst, src), nbytes=2 * n,
               info={"bits": 8})
    for bits in (1, 2, 4):
        codes = src & np.uint8((1 << bits) - 1)
        nbytes = n + n * bits // 8
        packed = lowbit.pack_bits(codes, bits)
        for direction, run in (
            ("pack", lambda c=codes, b=bits: lowbit.pack_bits(c, b)),
            ("unpack", lambda p=packed, b=bits: lowbit.unpack_bits(p, b, n)),
        ):
            ref_name = f"{direction}{bits} numpy"
            if not config.gpu:
                def numpy_run(run=run):
                    with lowbit.use_backend("numpy"):
                        run()
                yield Case("pack_bits", ref_name, fn=numpy_run, nbytes=nbytes,
                           info={"bits": bits})

            def fast_run(run=run):
                with _maybe(backend):
                    run()
            yield Case("pack_bits", f"{direction}{bits} {backend or 'auto'}", fn=fast_run,
                       check=lambda b=bits: check_small(b), nbytes=nbytes,
                       baseline=None if config.gpu else ref_name, info={"bits": bits})


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    import contextlib

    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()
