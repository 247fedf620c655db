"""The tokenizer of a BitNet model file: ``Tokenizer`` (``encode``, ``decode``,
``stream_decoder``), built from a Hugging Face folder's ``tokenizer.json`` or a GGUF file's
``tokenizer.ggml.*`` metadata.

Two engines behind one class:

- the ``tokenizers`` package (``pip install "lowbit[bitnet]"``), for any ``tokenizer.json``;
- ``ByteBPE``, written here: byte-level BPE with merge ranks, the model GGUF calls "gpt2"
  (Llama 3's and BitNet b1.58 2B4T's vocabulary), with the Llama-3 pre-tokenizer
  (``tokenizer.ggml.pre`` "llama-bpe") or GPT-2's ("gpt2"). It serves GGUF files, and
  ``tokenizer.json`` files of that kind when ``tokenizers`` is missing.

``pretokenize`` scans the two pre-tokenizer regular expressions by hand (no ``regex`` package),
alternative by alternative as a backtracking regex engine would. Two simplifications, both
outside what real text holds: ``\\s`` is ``str.isspace`` (which also counts U+001C..U+001F), and
the Llama-3 contractions ignore case for ASCII letters only (a regex engine's case folding also
lets U+017F stand for "s" and U+212A for "k"). ``tests/test_bitnet_load.py`` checks the scanner
against the ``regex`` package and ``ByteBPE`` against ``tokenizers``.

A tokenizer the code cannot build (an unsupported GGUF model or pre-tokenizer, a
``tokenizer.json`` without ``tokenizers`` that is no byte-level BPE) gives a warning and
``None``: the model still loads, and runs on token ids.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

#: GGUF ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
#: ``tokenizer.ggml.pre`` names and the pre-tokenizer each uses.
PRE_TOKENIZERS = {"llama-bpe": "llama3", "llama3": "llama3", "gpt2": "gpt2"}
#: The Llama-3 pre-tokenizer regex as ``tokenizer.json`` spells it.
LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
                " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte 0..255
    (printable Latin-1 bytes stand for themselves, the others for U+0100 onwards in order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


_BYTE_CHARS = byte_chars()
_CHAR_BYTES = {c: b for b, c in enumerate(_BYTE_CHARS)}


def _letter(c: str) -> bool:
    return unicodedata.category(c)[0] == "L"


def _number(c: str) -> bool:
    return unicodedata.category(c)[0] == "N"


def _other(c: str) -> bool:  # [^\s\p{L}\p{N}]
    return not (c.isspace() or _letter(c) or _number(c))


def _run(s: str, i: int, pred: Any, limit: int | None = None) -> int:
    """The end of the run of characters satisfying ``pred`` from ``i`` (at most ``limit``)."""
    end = len(s) if limit is None else min(len(s), i + limit)
    while i < end and pred(s[i]):
        i += 1
    return i


def _space_match(s: str, i: int, llama3: bool) -> int:
    """End of the whitespace alternatives' match at ``i`` (``s[i]`` is whitespace):
    Llama-3's ``\\s*[\\r\\n]+``, then ``\\s+(?!\\S)``, then ``\\s+``."""
    j = _run(s, i, str.isspace)
    if llama3:
        for k in range(j - 1, i - 1, -1):  # \s* backs off to the last newline of the run
            if s[k] in "\r\n":
                return k + 1
    if j == len(s) or j - i == 1:
        return j  # \s+(?!\S) at the end of the text, or the lone \s+
    return j - 1  # \s+(?!\S): leave the last space to the word that follows


def _match(s: str, i: int, llama3: bool) -> int:
    """End of the pre-tokenizer regex's match at ``i``."""
    c, n = s[i], len(s)
    nxt = s[i + 1] if i + 1 < n else ""
    if c == "'":
        rest = s[i + 1:i + 3]
        for t in _CONTRACTIONS:
            got = rest[:len(t)]
            if (got.lower() if llama3 and got.isascii() else got) == t:
                return i + 1 + len(t)
    if llama3:
        if _letter(c):
            return _run(s, i + 1, _letter)
        if c not in "\r\n" and not _number(c) and nxt and _letter(nxt):
            return _run(s, i + 2, _letter)
        if _number(c):
            return _run(s, i, _number, 3)
        start = i + 1 if c == " " and nxt and _other(nxt) else i
        if _other(s[start]):
            j = _run(s, start, _other)
            return _run(s, j, lambda ch: ch in "\r\n")
        return _space_match(s, i, True)
    start = i + 1 if c == " " and nxt and not nxt.isspace() else i
    if start < n:
        for pred in (_letter, _number, _other):
            if pred(s[start]):
                return _run(s, start, pred)
    return _space_match(s, i, False)


def pretokenize(text: str, kind: str = "llama3") -> list[str]:
    """Split ``text`` as the pre-tokenizer regex does (``kind`` "llama3" or "gpt2")."""
    if kind not in ("llama3", "gpt2"):
        raise ValueError(f"kind must be 'llama3' or 'gpt2', got {kind!r}")
    out, i = [], 0
    while i < len(text):
        j = _match(text, i, kind == "llama3")
        out.append(text[i:j])
        i = j
    return out


class ByteBPE:
    """Byte-level BPE (GGUF's "gpt2" model).

    Args:
        tokens: the token strings by id, in the byte-level alphabet (``byte_chars``).
        merges: "left right" strings, best (lowest rank) first.
        token_types: GGUF token types by id (default all ``NORMAL``); ``CONTROL`` and
            ``USER_DEFINED`` tokens are matched literally in the text before pre-tokenizing.
        pre: the ``tokenizer.ggml.pre`` name (a key of ``PRE_TOKENIZERS``).
        ignore_merges: a pre-token that is itself a token is emitted whole (Llama 3's BPE).
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str],
                 token_types: Sequence[int] | None = None, pre: str = "llama-bpe",
                 ignore_merges: bool | None = None) -> None:
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported (only "
                             f"{sorted(PRE_TOKENIZERS)})")
        self.tokens = list(tokens)
        self.merges = list(merges)
        self.token_types = [NORMAL] * len(self.tokens) if token_types is None else \
            [int(t) for t in token_types]
        if len(self.token_types) != len(self.tokens):
            raise ValueError(f"{len(self.token_types)} token types for {len(self.tokens)} "
                             "tokens")
        self.pre = pre
        self.kind = PRE_TOKENIZERS[pre]
        self.ignore_merges = self.kind == "llama3" if ignore_merges is None else ignore_merges
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(self.merges):
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"merge {rank} {m!r} is not two space-separated tokens")
            self.ranks.setdefault((parts[0], parts[1]), rank)
        special = [t for t, k in zip(self.tokens, self.token_types)
                   if k in (CONTROL, USER_DEFINED) and t]
        special.sort(key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, special))) if special else None
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[int]:
        word = "".join(_BYTE_CHARS[b] for b in piece.encode("utf-8"))
        if self.ignore_merges and word in self.ids:
            return [self.ids[word]]
        syms = list(word)
        while len(syms) > 1:
            best, at = None, -1
            for k in range(len(syms) - 1):
                r = self.ranks.get((syms[k], syms[k + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, k
            if best is None:
                break
            syms[at:at + 2] = [syms[at] + syms[at + 1]]
        out = []
        for sym in syms:
            if sym not in self.ids:
                raise ValueError(f"the vocabulary lacks the token {sym!r} (byte-level BPE needs "
                                 "every byte's token)")
            out.append(self.ids[sym])
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS)."""
        out: list[int] = []
        pos = 0
        spans = list(self._special.finditer(text)) if self._special else []
        for m in [*spans, None]:
            chunk = text[pos:m.start() if m else len(text)]
            for piece in pretokenize(chunk, self.kind):
                ids = self._cache.get(piece)
                if ids is None:
                    ids = self._bpe(piece)
                    if len(self._cache) < 65536:
                        self._cache[piece] = ids
                out.extend(ids)
            if m:
                out.append(self.ids[m.group()])
                pos = m.end()
        return out

    def token_bytes(self, i: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes token ``i`` stands for."""
        text, kind = self.tokens[i], self.token_types[i]
        if kind == CONTROL:
            return b"" if skip_special_tokens else text.encode("utf-8")
        if kind == BYTE and re.fullmatch("<0x[0-9A-Fa-f]{2}>", text):
            return bytes([int(text[3:5], 16)])
        if kind != NORMAL:
            return text.encode("utf-8")
        return b"".join(bytes([_CHAR_BYTES[c]]) if c in _CHAR_BYTES else c.encode("utf-8")
                        for c in text)


class Tokenizer:
    """Text <-> token ids for a BitNet model (build it with ``from_folder`` / ``from_gguf``).

    Attributes:
        bos_token_id: int or None; ``encode`` puts it first where the file says so.
        eos_token_id: int or None.
        source: the file it was read from.
    """

    def __init__(self, engine: Any, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, add_bos: bool = False, source: str = "",
                 gguf_fields: dict[str, Any] | None = None) -> None:
        self._engine = engine
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._add_bos = add_bos
        self.source = source
        self._gguf_fields = gguf_fields

    @property
    def vocab_size(self) -> int:
        """The number of tokens (added ones included)."""
        if isinstance(self._engine, ByteBPE):
            return len(self._engine.tokens)
        return int(self._engine.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, the BOS (and whatever the
        ``tokenizer.json`` post-processor adds)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if isinstance(self._engine, ByteBPE):
            ids = self._engine.encode(text)
            if add_special_tokens and self._add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            return ids
        return list(self._engine.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (an incomplete UTF-8 sequence becomes U+FFFD)."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token ids must be in [0, {n}), got {bad[:5]}")
        if isinstance(self._engine, ByteBPE):
            data = b"".join(self._engine.token_bytes(i, skip_special_tokens) for i in ids)
            return data.decode("utf-8", errors="replace")
        return str(self._engine.decode(ids, skip_special_tokens=skip_special_tokens))

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A ``StreamDecoder`` over this tokenizer, for printing while generating."""
        return StreamDecoder(self, skip_special_tokens)

    def gguf_metadata(self) -> dict[str, Any] | None:
        """The ``tokenizer.ggml.*`` entries that describe this tokenizer ("gpt2" byte-level BPE),
        or None where it is of another kind."""
        if self._gguf_fields is not None:
            return dict(self._gguf_fields)
        if isinstance(self._engine, ByteBPE):
            return _bpe_fields(self._engine, self.bos_token_id, self.eos_token_id,
                               self._add_bos)
        return None

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer | None:
        """The tokenizer of a Hugging Face folder's ``tokenizer.json``, or None without one.

        Raises:
            ValueError: a ``tokenizer.json`` that is not JSON.
        """
        path = os.path.join(os.fspath(folder), "tokenizer.json")
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a JSON file ({exc})") from None
        bpe, bos, add_bos = _bpe_from_json(spec)
        eos = _special_id(os.path.dirname(path), spec, "eos_token")
        try:
            import tokenizers
        except ImportError:
            if bpe is None:
                warnings.warn(f"{path}: this tokenizer needs the tokenizers package (pip install "
                              '"lowbit[bitnet]"); the model loads without a tokenizer',
                              stacklevel=2)
                return None
            return cls(bpe, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos, source=path,
                       gguf_fields=_bpe_fields(bpe, bos, eos, add_bos))
        tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
        fields = _bpe_fields(bpe, bos, eos, add_bos) if bpe is not None else None
        return cls(tok, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos, source=path,
                   gguf_fields=fields)

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any], source: str = "") -> Tokenizer | None:
        """The tokenizer of a GGUF file's metadata (``tokenizer.ggml.*`` keys, values as
        ``gguf.ReaderField.contents`` gives them), or None where there is none."""
        model = fields.get("tokenizer.ggml.model")
        tokens = fields.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            return None
        pre = fields.get("tokenizer.ggml.pre", "gpt2")
        if model != "gpt2" or pre not in PRE_TOKENIZERS:
            warnings.warn(f"{source}: the GGUF tokenizer model {model!r} with pre-tokenizer "
                          f"{pre!r} is not supported (only 'gpt2' with {sorted(PRE_TOKENIZERS)});"
                          " the model loads without a tokenizer", stacklevel=2)
            return None
        try:
            bpe = ByteBPE(tokens, fields.get("tokenizer.ggml.merges", []),
                          fields.get("tokenizer.ggml.token_type"), pre)
        except ValueError as exc:
            raise ValueError(f"{source}: tokenizer metadata: {exc}") from None
        bos = fields.get("tokenizer.ggml.bos_token_id")
        add_bos = fields.get("tokenizer.ggml.add_bos_token", PRE_TOKENIZERS[pre] == "llama3")
        kept = {k: v for k, v in fields.items() if k.startswith("tokenizer.ggml.")}
        return cls(bpe, bos_token_id=bos, eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
                   add_bos=bool(add_bos), source=source, gguf_fields=kept)


class StreamDecoder:
    """Incremental decoding: ``step(ids)`` with every id so far returns only the text that the
    new ids complete, holding back a character whose UTF-8 bytes are split across tokens.

    It decodes a window of ids that starts one printed chunk back (so tokenizers whose decoding
    depends on the previous token stay right) and prints once the window's text grows and does
    not end in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._prefix = 0
        self._read = 0
        self._seen = 0

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        """The new text of ``ids`` (all the ids so far, extending the previous call's); with
        ``final``, also whatever is held back (as U+FFFD where incomplete).

        Raises:
            ValueError: ``ids`` shorter than in the previous call.
        """
        if len(ids) < self._seen:
            raise ValueError(f"ids must extend the previous call's {self._seen} ids, got "
                             f"{len(ids)}")
        self._seen = len(ids)
        before = self._tok.decode(ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(ids[self._prefix:], self._skip)
        if len(text) > len(before) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(ids)
            return text[len(before):]
        return ""


def _bpe_fields(bpe: ByteBPE | None, bos: int | None, eos: int | None,
                add_bos: bool) -> dict[str, Any] | None:
    if bpe is None:
        return None
    out: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": bpe.pre,
                           "tokenizer.ggml.tokens": list(bpe.tokens),
                           "tokenizer.ggml.token_type": list(bpe.token_types),
                           "tokenizer.ggml.merges": list(bpe.merges),
                           "tokenizer.ggml.add_bos_token": bool(add_bos)}
    if bos is not None:
        out["tokenizer.ggml.bos_token_id"] = int(bos)
    if eos is not None:
        out["tokenizer.ggml.eos_token_id"] = int(eos)
    return out


def _bpe_from_json(spec: Any) -> tuple[ByteBPE | None, int | None, bool]:
    """``(ByteBPE or None, bos id, add_bos)`` of a parsed ``tokenizer.json``: a ByteBPE where it
    is a byte-level BPE with the Llama-3 or GPT-2 pre-tokenizer (llama.cpp's converter's case)."""
    if not isinstance(spec, dict):
        return None, None, False
    added = {a["content"]: a for a in spec.get("added_tokens") or [] if isinstance(a, dict)}
    bos, add_bos = None, False
    post = spec.get("post_processor") or {}
    procs = post.get("processors", [post]) if isinstance(post, dict) else []
    for p in procs:
        single = p.get("single") if isinstance(p, dict) else None
        if p.get("type") == "TemplateProcessing" and single and "SpecialToken" in single[0]:
            name = single[0]["SpecialToken"]["id"]
            ids = (p.get("special_tokens", {}).get(name) or {}).get("ids") or []
            bos = ids[0] if ids else added.get(name, {}).get("id")
            add_bos = bos is not None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["Split", "ByteLevel"] and steps[0].get("pattern") == {"Regex": LLAMA3_REGEX} \
            and steps[0].get("behavior") == "Isolated" and not steps[1].get("use_regex", True):
        name = "llama-bpe"
    elif kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        name = "gpt2"
    else:
        return None, bos, add_bos
    if (model.get("type") != "BPE" or spec.get("normalizer") or steps[-1].get("add_prefix_space")
            or model.get("dropout") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or model.get("byte_fallback")):
        return None, bos, add_bos
    vocab = dict(model.get("vocab") or {})
    types = {}
    for content, a in added.items():
        vocab[content] = a["id"]
        types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    n = max(vocab.values(), default=-1) + 1
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    kinds_by_id = [types.get(i, NORMAL if tokens[i] else UNUSED) for i in range(n)]
    try:
        bpe = ByteBPE(tokens, merges, kinds_by_id, name, bool(model.get("ignore_merges", False)))
    except ValueError:
        return None, bos, add_bos
    return bpe, bos, add_bos


def _special_id(folder: str, spec: dict[str, Any], key: str) -> int | None:
    """The id of ``key`` ("eos_token") from ``tokenizer_config.json``, if it names one."""
    path = os.path.join(folder, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, dict):
        value = value.get("content")
    for a in spec.get("added_tokens") or []:
        if isinstance(a, dict) and a.get("content") == value:
            return int(a["id"])
    return None
