"""The parameters of a BitNet model: names, value types, and the check against a config.

``params`` is a flat dict under transformers' tensor names without the ``.weight`` suffix:

- ``"model.embed_tokens"``: ``Dense`` [vocab, hidden] in the checkpoint's precision;
- ``"lm_head"``: ``Dense`` [vocab, hidden] (absent when the config ties it to the embedding),
  or an int8 ``PackedWeight`` of shape (hidden, vocab) (``quantize_head``'s opt-in);
- ``"model.norm"`` and, per layer ``N``, ``"model.layers.N.input_layernorm"``,
  ``"...post_attention_layernorm"``, ``"...self_attn.attn_sub_norm"`` (hidden),
  ``"...mlp.ffn_sub_norm"`` (intermediate): float32 [width] arrays;
- ``"model.layers.N.self_attn.{q,k,v,o}_proj"``, ``"model.layers.N.mlp.{gate,up,down}_proj"``:
  ternary ``PackedWeight`` of shape (in_features, out_features).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Union

import numpy as np

from ... import _backend
from ..._typing import Array
from ...ops.quantize import PackedWeight
from ._config import BitNetConfig

#: ``Dense.dtype`` values and the array dtype that holds each (bfloat16 as its uint16 bits).
DENSE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclasses.dataclass(frozen=True)
class Dense:
    """A matrix kept in a checkpoint's precision (the embedding and ``lm_head``).

    Attributes:
        data: [rows, cols] array (numpy or cupy) of float32, float16, or uint16 holding
            bfloat16 bit patterns.
        dtype: "float32", "float16" or "bfloat16".
    """

    data: Array
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DENSE_DTYPES:
            raise ValueError(f"Dense.dtype must be one of {tuple(DENSE_DTYPES)}, got "
                             f"{self.dtype!r}")
        if getattr(self.data, "ndim", None) != 2 or self.data.dtype != DENSE_DTYPES[self.dtype]:
            raise ValueError(f"Dense.data must be a 2-d {np.dtype(DENSE_DTYPES[self.dtype])} "
                             f"array for dtype {self.dtype!r}, got "
                             f"{getattr(self.data, 'dtype', type(self.data).__name__)} "
                             f"of shape {getattr(self.data, 'shape', None)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def float32(self, rows: Any = slice(None)) -> Array:
        """Rows ``rows`` (a slice or an index array) decoded exactly to float32."""
        block = self.data[rows]
        xp = _backend.array_module(block)
        if self.dtype == "bfloat16":
            return (block.astype(xp.uint32) << 16).view(xp.float32)
        return block.astype(xp.float32)

    @classmethod
    def from_float(cls, w: Array, dtype: str) -> Dense:
        """``w`` rounded to ``dtype`` (bfloat16: round to nearest even, as torch does)."""
        xp = _backend.array_module(w)
        if dtype == "bfloat16":
            bits = xp.ascontiguousarray(w, dtype=xp.float32).view(xp.uint32)
            bias = ((bits >> 16) & 1) + xp.uint32(0x7FFF)
            return cls(((bits + bias) >> 16).astype(xp.uint16), dtype)
        return cls(xp.ascontiguousarray(w, dtype=DENSE_DTYPES[dtype]), dtype)


Param = Union[Dense, PackedWeight, np.ndarray]

_LAYER_PROJ = {"self_attn.q_proj": ("hidden_size", "q_size"),
               "self_attn.k_proj": ("hidden_size", "kv_size"),
               "self_attn.v_proj": ("hidden_size", "kv_size"),
               "self_attn.o_proj": ("q_size", "hidden_size"),
               "mlp.gate_proj": ("hidden_size", "intermediate_size"),
               "mlp.up_proj": ("hidden_size", "intermediate_size"),
               "mlp.down_proj": ("intermediate_size", "hidden_size")}
_LAYER_NORM = {"input_layernorm": "hidden_size", "post_attention_layernorm": "hidden_size",
               "self_attn.attn_sub_norm": "hidden_size", "mlp.ffn_sub_norm": "intermediate_size"}


@functools.lru_cache(maxsize=16)
def expected_shapes(config: BitNetConfig) -> Mapping[str, tuple[str, tuple[int, ...]]]:
    """name -> (kind, shape) of every parameter the config implies: kind "dense" ([vocab,
    hidden]), "ternary" ((in, out) PackedWeight) or "norm" ([width] float32). Read-only, and
    made once per config (every forward checks its params against it)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens": ("dense", (config.vocab_size, config.hidden_size)),
        "model.norm": ("norm", (config.hidden_size,))}
    if not config.tie_word_embeddings:
        out["lm_head"] = ("dense", (config.vocab_size, config.hidden_size))
    for n in range(config.num_hidden_layers):
        for name, (k, m) in _LAYER_PROJ.items():
            out[f"model.layers.{n}.{name}"] = ("ternary", (getattr(config, k), getattr(config, m)))
        for name, w in _LAYER_NORM.items():
            out[f"model.layers.{n}.{name}"] = ("norm", (getattr(config, w),))
    return MappingProxyType(out)


def check_params(config: BitNetConfig, params: dict[str, Param], source: str = "params") -> None:
    """Every parameter present, of its kind and shape, nothing extra.

    ``lm_head`` may also be an int8 ``PackedWeight`` (hidden, vocab), tied or not.

    Raises:
        ValueError: naming ``source`` and the tensor.
    """
    want = expected_shapes(config)
    extra = sorted(set(params) - set(want) - {"lm_head"})
    if extra:
        raise ValueError(f"{source}: unexpected tensor(s) {extra[:5]} for this config")
    for name, (kind, shape) in want.items():
        if name not in params:
            raise ValueError(f"{source}: missing tensor {name!r}")
    for name, value in params.items():
        kind, shape = want.get(name, ("dense", (config.vocab_size, config.hidden_size)))
        if name == "lm_head" and isinstance(value, PackedWeight):
            if value.format != "int8" or value.shape != (config.hidden_size, config.vocab_size):
                raise ValueError(f"{source}: lm_head as a PackedWeight must be int8 of shape "
                                 f"{(config.hidden_size, config.vocab_size)}, got "
                                 f"{value.format} {value.shape}")
            continue
        if kind == "dense":
            ok = isinstance(value, Dense) and value.shape == shape
        elif kind == "ternary":
            ok = (isinstance(value, PackedWeight) and value.format == "ternary"
                  and value.shape == shape)
        else:
            ok = (getattr(value, "dtype", None) == np.float32
                  and tuple(getattr(value, "shape", ())) == shape)
        if not ok:  # (the message only now: formatting it for every tensor cost ~2 ms a call)
            label = {"dense": type(value).__name__,
                     "ternary": getattr(value, "format", type(value).__name__),
                     "norm": getattr(value, "dtype", type(value).__name__)}[kind]
            got = f"{label} {getattr(value, 'shape', None)}"
            what = {"dense": "a Dense matrix", "ternary": "a ternary PackedWeight",
                    "norm": "a float32 vector"}[kind]
            raise ValueError(f"{source}: tensor {name!r} must be {what} of shape {shape}, "
                             f"got {got}")


def _ternary_bytes(rng, shape) -> np.ndarray:
    """Random packed ternary bytes: each 2-bit field holds 0, 1 or 2 (code + 1)."""
    valid = np.array([b for b in range(256) if all((b >> (2 * i)) & 3 != 3 for i in range(4))],
                     np.uint8)
    return valid[rng.integers(0, len(valid), size=shape, dtype=np.uint8)]


def random_params(config: BitNetConfig, *, seed: int = 0, dense_dtype: str = "bfloat16",
                  xp: Any = np) -> dict[str, Param]:
    """A model of ``config``'s shapes with random weights (tests and benchmarks; no download).

    Ternary codes uniform over {-1, 0, 1} with scale ``1 / sqrt(in_features)`` (so activations
    keep their size through the layers), norms ``1 + N(0, 0.1)``, the embedding ``N(0, 1)`` in
    ``dense_dtype``; numpy arrays, or moved with ``xp.asarray`` for ``xp=cupy``.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, Param] = {}
    for name, (kind, shape) in expected_shapes(config).items():
        if kind == "dense":
            w = rng.standard_normal(shape, dtype=np.float32)
            out[name] = Dense.from_float(xp.asarray(w), dense_dtype)
        elif kind == "ternary":
            K, N = shape
            data = xp.asarray(_ternary_bytes(rng, (N, -(-K // 4))))
            if K % 4:  # the fields past K are zero, as quantize_weight packs them
                last = data[:, -1] & np.uint8((1 << (2 * (K % 4))) - 1)
                data[:, -1] = last
            out[name] = PackedWeight("ternary", shape, data,
                                     xp.asarray(np.float32(1 / np.sqrt(K))))
        else:
            out[name] = xp.asarray((1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
    return fuse_projections(config, out, in_place=True)


#: Projections that read the same input, fused into one weight buffer by ``fuse_projections``.
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         ("mlp.gate_proj", "mlp.up_proj"))


def _address(a: Any) -> int:
    return int(a.data.ptr) if _backend.is_cupy_array(a) else int(a.__array_interface__["data"][0])


def fuse_projections(config: BitNetConfig, params: dict[str, Param], *,
                     in_place: bool = False) -> dict[str, Param]:
    """``params`` with each layer's q/k/v (and gate/up) packed rows moved into one buffer: each
    ``PackedWeight`` keeps its own shape and scale, its ``data`` a view of consecutive rows, so
    the forward multiplies them in one ``packed_matmul`` (``fused_view``). Same values; weights
    already laid out so, or of other kinds, are left as they are. ``in_place``: update and
    return ``params`` itself (a loader's own dict: each layer's old arrays are freed as it
    goes), else a new dict."""
    out = params if in_place else dict(params)
    for n in range(config.num_hidden_layers):
        for group in FUSED:
            names = [f"model.layers.{n}.{g}" for g in group]
            pws = [pw for pw in (out[name] for name in names) if isinstance(pw, PackedWeight)]
            if len(pws) < len(names) or any(pw.format != "ternary" for pw in pws):
                continue
            if fused_view(pws) is not None:
                continue
            xp = _backend.array_module(pws[0].data)
            buffer = xp.concatenate([pw.data for pw in pws])
            row = 0
            for name, pw in zip(names, pws):
                N = pw.data.shape[0]
                out[name] = dataclasses.replace(pw, data=buffer[row:row + N])
                row += N
    return out


def fused_view(pws: list) -> PackedWeight | None:
    """One ternary ``PackedWeight`` of scale 1 over the weights' packed rows, when they are
    consecutive rows of one buffer with the same input size (``fuse_projections``'s layout);
    else None."""
    first = pws[0]
    base = first.data.base
    if base is None or getattr(base, "ndim", 0) != 2:
        return None
    K, width = first.shape[0], first.data.shape[1]
    if base.shape[1] != width or not base.flags.c_contiguous:
        return None
    expect = _address(first.data)
    for pw in pws:
        if (not isinstance(pw, PackedWeight) or pw.format != "ternary" or pw.shape[0] != K
                or pw.data.base is not base or _address(pw.data) != expect
                or pw.data.dtype != base.dtype):
            return None
        expect += pw.data.nbytes
    start = (_address(first.data) - _address(base)) // (width * base.itemsize)
    rows = sum(pw.data.shape[0] for pw in pws)
    xp = _backend.array_module(base)
    return PackedWeight("ternary", (K, rows), base[start:start + rows],
                        xp.ones((), xp.float32))
