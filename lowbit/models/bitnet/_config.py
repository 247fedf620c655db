"""``BitNetConfig``: the hyperparameters of a BitNet b1.58 model, under transformers' names.

Read from a Hugging Face ``config.json`` (``from_hf_dict``) or GGUF metadata (``_gguf.py``);
checked against the tensors by ``_params.check_params``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

#: ``hidden_act`` names that transformers' ``ACT2FN`` maps and this package computes.
ACTIVATIONS = ("relu2", "relu", "silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh",
               "gelu_fast", "quick_gelu", "tanh", "sigmoid", "relu6", "leaky_relu", "mish")


@dataclasses.dataclass(frozen=True)
class BitNetConfig:
    """BitNet b1.58 hyperparameters (transformers' ``BitNetConfig`` field names).

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads: the shapes; ``num_key_value_heads`` divides
            ``num_attention_heads`` (key/value head ``h`` serves query heads ``h*g .. h*g+g-1``).
        head_dim: per-head width (default ``hidden_size // num_attention_heads``), even.
        rms_norm_eps: RMSNorm's epsilon.
        rope_theta: rotary base (half-split rotation, transformers' ``rotate_half``).
        max_position_embeddings: the longest sequence (the KV cache's limit).
        tie_word_embeddings: ``lm_head`` is the embedding.
        bos_token_id: int or None.
        eos_token_id: tuple of ints (a config's int or list), possibly empty.
        hidden_act: the FFN activation, one of ``ACTIVATIONS`` (BitNet's is "relu2").
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hidden_act: str = "relu2"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BitNetConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"BitNetConfig.num_key_value_heads = {self.num_key_value_heads} "
                             f"must divide num_attention_heads = {self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"BitNetConfig.head_dim must be even (rotary pairs), got "
                             f"{self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"BitNetConfig.{name} must be a finite positive number, got "
                                 f"{value!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BitNetConfig.hidden_act must be one of {ACTIVATIONS}, got "
                             f"{self.hidden_act!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"BitNetConfig.tie_word_embeddings must be a bool, got "
                             f"{self.tie_word_embeddings!r}")
        ids = (() if self.bos_token_id is None else (self.bos_token_id,)) + self.eos_token_id
        for value in ids:
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value < self.vocab_size):
                raise ValueError(f"BitNetConfig token ids must be ints in [0, vocab_size = "
                                 f"{self.vocab_size}), got {value!r}")

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each key/value projection, ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> BitNetConfig:
        """From a parsed Hugging Face ``config.json`` (transformers 4.x or 5.x).

        ``rope_theta`` is read at the top level or inside ``rope_parameters`` (5.x);
        ``head_dim`` defaults to ``hidden_size // num_attention_heads``,
        ``num_key_value_heads`` to ``num_attention_heads``, ``hidden_act`` to "relu2",
        ``tie_word_embeddings`` to True (transformers' BitNet default).

        Raises:
            ValueError: a missing required field or a bad value, naming ``source``.
        """
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            theta = cfg.get("rope_theta")
            rope = cfg.get("rope_parameters")
            if theta is None and isinstance(rope, Mapping):
                theta = rope.get("rope_theta")
            if isinstance(rope, Mapping) and rope.get("rope_type", "default") != "default":
                raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported "
                                 "(only 'default')")
            scaling = cfg.get("rope_scaling")
            if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
                raise ValueError(f"rope_scaling {scaling!r} is not supported")
            eos = cfg.get("eos_token_id")
            eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
            return cls(
                vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta if theta is not None else 500000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos_ids,
                hidden_act=str(cfg.get("hidden_act", "relu2")))
        except KeyError as e:
            raise ValueError(f"{source}: missing the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers ``config.json`` fields (``architectures``, ``model_type`` included)."""
        d = dataclasses.asdict(self)
        eos = list(self.eos_token_id)
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
        d.update(architectures=["BitNetForCausalLM"], model_type="bitnet")
        return d
