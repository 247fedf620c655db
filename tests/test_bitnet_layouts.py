"""BitNet models loaded from every published file layout run as the float64 reference says.

The files are written by ``tests/bitnet_files.py`` (independent writers); the reference
(``reference/bitnet.py``) is fed the writer's own codes, scales, norms and embedding, so a
loader that mistook a layout (a scale convention, the packed row order, a GGUF block type)
gives other logits. For master-weight layouts the reference ternarizes the masters itself
(``reference/quantize.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from lowbit import PackedWeight
from lowbit.models import bitnet
from lowbit.reference.bitnet import bitnet_ref
from lowbit.reference.quantize import weight_codes_ref

import bitnet_files as files
from helpers import assert_close
from test_bitnet import RTOL, _greedy_ref, ref_weights

LAYOUTS = {
    "hf-bitlinear": lambda d, m: files.write_hf_offline(d, m, "bitlinear"),
    "hf-autobitlinear": lambda d, m: files.write_hf_offline(d, m, "autobitlinear"),
    "hf-online-bf16": lambda d, m: files.write_hf_online(d, m, "BF16"),
    "hf-sharded": lambda d, m: files.write_hf_offline(d, m, "autobitlinear", shards=3),
    "gguf-tq1": lambda d, m: files.write_gguf(str(d / "m.gguf"), m, "TQ1_0"),
    "gguf-tq2": lambda d, m: files.write_gguf(str(d / "m.gguf"), m, "TQ2_0", embed_type="BF16"),
}


def _reference_weights(written):
    m = written.model
    w = {"model.embed_tokens": m.embed.astype(np.float64), **{k: v.astype(np.float64)
                                                             for k, v in m.norms.items()}}
    if m.head is not None:
        w["lm_head"] = m.head.astype(np.float64)
    for name, codes in m.codes.items():
        if written.scales is None:  # master weights: BitNet's absmean rule, in float64
            c, s = weight_codes_ref(m.masters[name].astype(np.float64), "ternary")
            w[name] = (np.asarray(c, np.float64) * np.float32(s)).T
        else:
            w[name] = (codes.astype(np.float64) * np.float64(written.scales[name])).T
    return w


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = {}
    for i, (name, write) in enumerate(LAYOUTS.items()):
        folder = tmp_path_factory.mktemp(name)
        out[name] = write(folder, files.tiny_model(seed=10 + i))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_logits_and_greedy(layout, written, rng):
    """On the default backend: the layouts differ in loading only (the backends are compared
    with the reference in ``tests/test_bitnet.py``)."""
    wr = written[layout]
    config, params, _ = bitnet.load(wr.path)
    assert config == wr.model.config
    w = _reference_weights(wr)
    ids = rng.integers(0, config.vocab_size, 9)
    ref = bitnet_ref(config, w, ids)
    logits, _ = bitnet.forward(config, params, ids)
    assert_close(f"{layout} logits", ref, logits, RTOL)
    want = _greedy_ref(config, w, ids, 6, RTOL * np.abs(ref).max())
    got = list(bitnet.generate(config, params, ids, 6, temperature=0, stop=()))
    assert got[:len(want)] == want and len(want) >= 2


def test_export_to_gguf_runs_the_same(tmp_path, written, rng):
    """A model loaded from Hugging Face, exported to GGUF and read back: the same codes, the
    scales rounded to fp16 (GGUF's block scale), and the reference's logits of that model."""
    wr = written["hf-bitlinear"]
    config, params, _ = bitnet.load(wr.path)
    ids = rng.integers(0, config.vocab_size, 5)
    for qtype in ("TQ2_0", "TQ1_0"):
        path = tmp_path / f"out-{qtype}.gguf"
        bitnet.save_gguf(path, config, params, qtype)
        config2, params2, _ = bitnet.load(path)
        assert config2 == config
        for name, pw in params.items():
            if isinstance(pw, PackedWeight):
                assert np.array_equal(params2[name].data, pw.data), name
                assert params2[name].scale == np.float32(np.float16(pw.scale)), name
        ref = bitnet_ref(config2, ref_weights(params2), ids)
        assert_close(f"{qtype} logits", ref, bitnet.forward(config2, params2, ids)[0], RTOL)
