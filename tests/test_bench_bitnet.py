"""``python -m bench bitnet --quick`` end to end (``bench/bitnet.py``, ``bench/_bitnet_peer.py``)
with one call per timed block: the rows it writes, the bytes a decode step reads against a count
made here from the shapes, the bandwidth bound they imply, peak memory from a fresh process,
and, where ``llama_cpp`` imports, that llama.cpp and lowbit agree on the same GGUF file (the
layout check of ``save_gguf``). Also the llama.cpp-less path and the ``--gpu`` row rehearsed on
numpy arrays. No timed assertion: speeds are only checked to be positive."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench import __main__ as cli  # noqa: E402
from bench import _bitnet_peer, _harness, bitnet  # noqa: E402
from bench._harness import Config  # noqa: E402


@pytest.fixture
def fast(monkeypatch):
    """One call per timed block, no settle pauses, a 64 MiB bandwidth buffer."""
    monkeypatch.setitem(bitnet.TIMING, True, dict(rounds=1, block=1, prefill=1,
                                                  prefill_rounds=1, profile=1))
    monkeypatch.setattr(_bitnet_peer, "SETTLE_S", 0)
    monkeypatch.setattr(_harness, "SETTLE_S", 0)
    real = bitnet.Bandwidth
    monkeypatch.setattr(bitnet, "Bandwidth", lambda nbytes: real(64 * 2**20))


def _decode_bytes(shape, context, head_bytes):
    """Bytes of one decode step, counted from the shapes: 2-bit codes (4 per byte, rows padded
    to whole bytes) and a float32 scale per projection, norms, an embedding row, the head, and
    float32 keys and values of ``context + 1`` positions."""
    H, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    projections = [(H, q), (H, kv), (H, kv), (q, H), (H, inter), (H, inter), (inter, H)]
    packed = L * sum(n * -(-k // 4) + 4 for k, n in projections)
    norms = 4 * (L * (3 * H + inter) + H)
    return packed + norms + 2 * H + head_bytes + 2 * L * (context + 1) * kv * 4


def test_quick_suite_end_to_end(fast, tmp_path, capsys):
    assert cli.main(["bitnet", "--quick", "--results", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bitnet.json").read_text())
    assert set(payload["metadata"]) >= {"lowbit", "cpu", "numba"}
    rows = {r["case"]: r for r in payload["rows"]}
    bw = rows["read bandwidth"]
    assert bw["GB/s"] > 0 and bw["threads"] >= 1
    shape, V, H = bitnet.QUICK, bitnet.QUICK["vocab_size"], bitnet.QUICK["hidden_size"]
    for c in bitnet.CONTEXTS:
        for name, head in ((f"relu2 decode @{c}", 2 * V * H),
                           (f"relu2 int8 head decode @{c}", V * H + 4 * V)):
            row = rows[name]
            want = _decode_bytes(shape, c, head)
            assert row["MB/token"] * 1e6 == pytest.approx(want, rel=1e-12), name
            # the bound: the best bandwidth measured so far (again before each context)
            assert row["GB/s"] >= bw["GB/s"]
            assert row["bound tok/s"] == pytest.approx(row["GB/s"] * 1e9 / want)
            assert row["of bound"] == pytest.approx(row["tokens/s"] / row["bound tok/s"])
            assert row["met"] == (row["of bound"] >= bitnet.BANDWIDTH_TARGET)
            assert row["tokens/s"] > 0 and row["best tok/s"] >= row["tokens/s"]
        profile = [r for k, r in rows.items() if k.startswith(f"relu2 decode @{c} profile: ")]
        ops = {r["case"].rsplit(": ", 1)[1]: r for r in profile}
        # q/k/v and gate/up share a buffer each (fuse_projections): 4 calls a layer, not 7
        assert ops["packed_matmul"]["calls"] == 4 * shape["num_hidden_layers"]
        assert ops["head_logits"]["calls"] == 1
        assert sum(r["of step"] for k, r in ops.items() if k != "whole step") == pytest.approx(1)
    head = rows["relu2 int8 head logits (16 positions)"]
    assert 0 < head["of max"] < 0.05 and head["top-1"].endswith("/16")
    assert rows[f"relu2 prefill {bitnet.PREFILL}"]["tokens/s"] > 0
    assert rows["relu2 load (GGUF -> lowbit)"]["seconds"] > 0
    memory = rows["peak RSS lowbit (ms: its load)"]
    assert memory["peak MiB"] >= memory["base MiB"] > 0
    if not _bitnet_peer.llama_available()[0]:
        assert "llama_cpp does not import" in rows["llama.cpp rows skipped"]["note"]
        return
    agree = rows[f"silu: llama.cpp vs lowbit logits ({bitnet.CHECK_STEPS + 1} positions)"]
    assert agree["agree met"] and agree["rms diff"] <= bitnet.GROSS, agree
    for name in (f"silu prefill {bitnet.PREFILL}", "silu decode @128", "silu decode @1024"):
        mine, theirs = rows[f"{name}: lowbit"], rows[f"{name}: llama.cpp"]
        assert mine["tokens/s"] > 0 and theirs["tokens/s"] > 0 and mine["x llama.cpp"] > 0
        assert mine["peer met"] == (mine["x llama.cpp"] >= bitnet.PEER_TARGET)
    assert rows["peak RSS llama.cpp (ms: its load)"]["peak MiB"] > 0
    assert "!!!" not in capsys.readouterr().out


def test_without_llama_cpp_its_rows_are_skipped_with_a_note(monkeypatch):
    monkeypatch.setattr(_bitnet_peer, "llama_available", lambda: (False, "llama_cpp: no"))
    class Fake:
        def __init__(self, nbytes):
            self.best = 1.0

        def measure(self):
            return {"seconds": 1.0, "GB/s": 1.0}

        def close(self):
            pass

    monkeypatch.setattr(bitnet, "Bandwidth", Fake)
    monkeypatch.setattr(bitnet, "_relu2_rows", lambda *args: iter(()))
    monkeypatch.setattr(bitnet, "_rss_rows", lambda *args: iter(()))
    rows = [c.name for c in bitnet.cases(Config(quick=True))]
    assert rows == ["read bandwidth", "llama.cpp rows skipped"]


def test_the_gpu_row_rehearsed_on_numpy():
    shape = dict(bitnet.QUICK, num_hidden_layers=1)
    cases = list(bitnet.gpu_cases(Config(), xp=np, shape=shape))
    assert [c.name.split(" (")[0] for c in cases] == [f"gpu decode @{c}"
                                                     for c in bitnet.CONTEXTS]
    for case in cases:
        assert case.info["tokens/s"] > 0 and case.info["rms diff"] == 0


def test_the_rss_child_names_its_usage(capsys):
    assert _bitnet_peer.rss_main(["--rss", "lowbit"]) == 2
    assert "usage: python -m bench.bitnet --rss" in capsys.readouterr().err
