"""``python -m lowbit.models.bitnet``: the command streams the greedy continuation that
``generate`` gives, decoded by the model's tokenizer, and reports its speeds on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lowbit.models import bitnet
from lowbit.models.bitnet.__main__ import main

import bitnet_files as files


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    files.write_hf_offline(d, files.tiny_model(seed=3), "bitlinear", tokenizer=True)
    return d


def test_prompt_streams_the_greedy_text(folder, capsys):
    config, params, tok = bitnet.load(folder)
    ids = tok.encode("the quick fox")
    want = list(bitnet.generate(config, params, ids, 6, temperature=0))
    assert main([str(folder), "--prompt", "the quick fox", "-n", "6", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == tok.decode(want, skip_special_tokens=True)
    assert "prefill" in err and "tokens/s" in err and "decode" in err


def test_ids_without_tokenizer(tmp_path, capsys):
    path = str(tmp_path / "m.gguf")
    files.write_gguf(path, files.tiny_model(seed=4), tokenizer=False)
    config, params, tok = bitnet.load(path)
    assert tok is None
    want = list(bitnet.generate(config, params, [5, 6, 7], 4, temperature=0))
    assert main([path, "--ids", "5,6,7", "-n", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want]
    assert main([path, "--prompt", "hello"]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err


def test_errors(tmp_path, folder, capsys):
    assert main([str(tmp_path / "nothing"), "--ids", "1"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main([str(folder), "--ids", "1,x"]) == 2
    assert main([str(folder), "--ids", "1", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_module_runs(folder):
    r = subprocess.run([sys.executable, "-m", "lowbit.models.bitnet", str(folder), "--ids",
                        "1,2", "-n", "2", "--temperature", "0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decode" in r.stderr
