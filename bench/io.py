"""Suite ``io``: converting a ternary weight between lowbit's layout and GGUF's TQ2_0 / TQ1_0 and
Hugging Face's BitNet layout, each direction, against a NumPy copy of the same packed bytes.

Module: ``lowbit/io`` (``gguf.py``, ``hf_bitnet.py``, kernels in ``_numba.py``); tests
``tests/test_io_gguf.py``, ``tests/test_io_hf_bitnet.py``. Targets: at least 25% of the copy's
speed for TQ2_0 and HF; TQ1_0 (base-3 packing) is reported. Host only: no GPU cases.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
import lowbit.io
from lowbit.io import _numpy

from ._harness import Case, Config

#: The target speed of TQ2_0 and HF, as a fraction of the copy's.
TARGET = 0.25


def _weight(rng, K, N):
    codes = rng.integers(-1, 2, (N, K)).astype(np.uint8) + np.uint8(1)
    return lowbit.PackedWeight("ternary", (K, N), lowbit.pack_bits(codes, 2),
                               np.asarray(0.0234375, dtype=np.float32))


def cases(config: Config):
    if config.gpu:
        return
    K = N = 1024 if config.quick else 4096
    rng = np.random.default_rng(0)
    pw = _weight(rng, K, N)
    small = _weight(rng, 512, 5)
    forced = (lambda: lowbit.use_backend(config.backend)) if config.backend else (
        contextlib.nullcontext)
    nbytes = pw.data.nbytes
    dst = np.empty_like(pw.data)
    yield Case("io", "copy", fn=lambda: np.copyto(dst, pw.data), nbytes=nbytes,
               info={"shape": f"{K}x{N}", "packed bytes": nbytes})

    def run(fn):
        def timed():
            with forced():
                fn()
        return timed

    def check_gguf(qtype):
        def check():
            with forced():
                blocks = lowbit.io.to_gguf(small, qtype)
                back = lowbit.io.from_gguf(blocks, small.shape, qtype)
            step = {"TQ2_0": _numpy.to_tq2, "TQ1_0": _numpy.to_tq1}[qtype]
            ref = step(small.data, 2, int(np.float16(small.scale).view(np.uint16)))[0]
            np.testing.assert_array_equal(blocks, ref)
            np.testing.assert_array_equal(back.data, small.data)
        return check

    def check_hf():
        with forced():
            packed, ws = lowbit.io.to_hf_bitnet(small)
            back = lowbit.io.from_hf_bitnet(packed, ws, small.shape)
        np.testing.assert_array_equal(packed, _numpy.to_hf(small.data, small.shape[0])[0])
        np.testing.assert_array_equal(back.data, small.data)

    for qtype in ("TQ2_0", "TQ1_0"):
        blocks = lowbit.io.to_gguf(pw, qtype)
        target = TARGET if qtype == "TQ2_0" else None
        info = {"format bytes": blocks.nbytes}
        yield Case("io", f"lowbit -> {qtype}", fn=run(lambda q=qtype: lowbit.io.to_gguf(pw, q)),
                   check=check_gguf(qtype), baseline="copy", target=target, nbytes=nbytes,
                   info=info)
        yield Case("io", f"{qtype} -> lowbit",
                   fn=run(lambda b=blocks, q=qtype: lowbit.io.from_gguf(b, (K, N), q)),
                   check=check_gguf(qtype), baseline="copy", target=target, nbytes=nbytes,
                   info=info)
    packed, ws = lowbit.io.to_hf_bitnet(pw)
    info = {"format bytes": packed.nbytes}
    yield Case("io", "lowbit -> HF", fn=run(lambda: lowbit.io.to_hf_bitnet(pw)), check=check_hf,
               baseline="copy", target=TARGET, nbytes=nbytes, info=info)
    yield Case("io", "HF -> lowbit", fn=run(lambda: lowbit.io.from_hf_bitnet(packed, ws, (K, N))),
               check=check_hf, baseline="copy", target=TARGET, nbytes=nbytes, info=info)
