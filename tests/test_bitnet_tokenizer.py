"""Tests of the BitNet tokenizers (``lowbit/models/bitnet/_tokenizer.py``): the pre-tokenizer
against the ``regex`` package, the byte-level BPE against the ``tokenizers`` package, the GGUF
tokenizer against ``tokenizer.json``, round trips and streaming. (Split from
``tests/test_bitnet_load.py``, which tests the model files.)
"""

from __future__ import annotations

import json
import random
import sys
import warnings

import pytest

import bitnet_files as bf
from lowbit.models.bitnet import _gguf, _load, _tokenizer

pytest.importorskip("gguf", reason='the gguf package (pip install "lowbit[io]")')

TEXTS = ["the quick brown fox", "The dog's owner isn't here; THEY'RE out!", "123456789 12 3",
         "ünïcödé 日本語 😀🎉 text", "tabs\tand\n\nnewlines \r\n  x  ", "   leading", "trailing   ",
         "<|begin_of_text|>hi<|eot_id|> there", "a'sb 'll 'LL ''", "", "x" * 40]


@pytest.fixture(scope="module")
def model():
    return bf.tiny_model(1)


# ---- the tokenizer ----------------------------------------------------------------------------

GPT2_PATTERN = ("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|"
                "\\s+")
ALPHABET = "aZé日 1٣Ⅻ½ '  \t\n\r\u00a0\u3000.,!😀_-sStTrReEvVmMlLdD"


def random_texts(n, seed=0, length=24):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(length))) for _ in range(n)]


@pytest.mark.parametrize("kind, pattern", [("llama3", bf.LLAMA3_PATTERN), ("gpt2", GPT2_PATTERN)])
def test_pretokenize_matches_regex(kind, pattern):
    regex = pytest.importorskip("regex")
    compiled = regex.compile(pattern)
    for text in TEXTS + random_texts(1500):
        assert _tokenizer.pretokenize(text, kind) == compiled.findall(text), repr(text)


@pytest.fixture
def hf_tokenizer_folder(tmp_path):
    bf.write_tokenizer_json(tmp_path)
    return tmp_path


def _words(seed, n=200):
    rng = random.Random(seed)
    words = bf.CORPUS.split(" ") + ["日本", "😀", "ünï", "\n", "  ", "'S", "12345", "<|eot_id|>"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(8))) for _ in range(n)]


def test_byte_bpe_matches_tokenizers(hf_tokenizer_folder):
    tokenizers = pytest.importorskip("tokenizers")
    oracle = tokenizers.Tokenizer.from_file(str(hf_tokenizer_folder / "tokenizer.json"))
    spec = json.loads((hf_tokenizer_folder / "tokenizer.json").read_text(encoding="utf-8"))
    bpe, bos, add_bos = _tokenizer._bpe_from_json(spec)
    assert bpe is not None and bos == 292 and add_bos and bpe.pre == "llama-bpe"
    ours = _tokenizer.Tokenizer(bpe, bos_token_id=bos, add_bos=add_bos)
    for text in TEXTS + _words(0) + random_texts(300, seed=1):
        want = oracle.encode(text).ids
        assert ours.encode(text) == want, repr(text)
        assert ours.decode(want) == oracle.decode(want, skip_special_tokens=False), repr(text)
        assert ours.decode(want, skip_special_tokens=True) == \
            oracle.decode(want, skip_special_tokens=True), repr(text)


@pytest.mark.parametrize("engine", ["tokenizers", "bytebpe", "gguf"])
def test_tokenizer_round_trip_and_stream(tmp_path, hf_tokenizer_folder, monkeypatch, engine):
    if engine == "tokenizers":
        pytest.importorskip("tokenizers")
        tok = _tokenizer.Tokenizer.from_folder(hf_tokenizer_folder)
    elif engine == "bytebpe":  # tokenizer.json without the tokenizers package
        monkeypatch.setitem(sys.modules, "tokenizers", None)
        tok = _tokenizer.Tokenizer.from_folder(hf_tokenizer_folder)
        assert isinstance(tok._engine, _tokenizer.ByteBPE)
    else:
        path = str(tmp_path / "m.gguf")
        bf.write_gguf(path, bf.tiny_model(0))
        tok = _load.load(path)[2]
    assert tok.bos_token_id == 292 and tok.eos_token_id == 293 and tok.vocab_size >= 295
    for text in TEXTS + random_texts(100, seed=2):
        ids = tok.encode(text)
        assert ids[0] == 292
        assert tok.decode(ids, skip_special_tokens=True) == text.replace(
            "<|begin_of_text|>", "").replace("<|eot_id|>", ""), repr(text)
        assert tok.decode(ids[1:]) == text
    text = "日本 😀 the fox 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # the emoji are split across byte tokens
    stream = tok.stream_decoder()
    pieces = [stream.step(ids[:i]) for i in range(1, len(ids) + 1)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3 + 1  # held back while a character is incomplete
    with pytest.raises(ValueError, match="extend"):
        stream.step(ids[:2])
    half = tok.encode("😀", add_special_tokens=False)[:2]
    assert tok.stream_decoder().step(half) == ""
    assert "\ufffd" in tok.stream_decoder().step(half, final=True)
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([tok.vocab_size])


def test_gguf_tokenizer_matches_tokenizer_json(tmp_path, hf_tokenizer_folder):
    pytest.importorskip("tokenizers")
    hf = _tokenizer.Tokenizer.from_folder(hf_tokenizer_folder)
    path = str(tmp_path / "m.gguf")
    bf.write_gguf(path, bf.tiny_model(0))
    gg = _load.load(path)[2]
    for text in TEXTS + _words(3, 50):
        assert gg.encode(text) == hf.encode(text), repr(text)


def test_tokenizer_unsupported(tmp_path, model):
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.warns(UserWarning, match="not supported"):
        assert _tokenizer.Tokenizer.from_gguf(fields, "x.gguf") is None
    assert _tokenizer.Tokenizer.from_gguf({}, "x.gguf") is None
    odd = _tokenizer.Tokenizer(object())
    with pytest.warns(UserWarning, match="placeholder vocabulary"):
        _gguf.save_gguf(tmp_path / "m.gguf", *_load.load(
            bf.write_hf_offline(tmp_path / "hf", model, tokenizer=False).path)[:2],
            tokenizer=odd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = _load.load(tmp_path / "m.gguf")[2]
    assert tok.vocab_size == model.config.vocab_size  # 257 placeholder tokens, padded
