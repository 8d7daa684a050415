"""Model configuration: an HF ``config.json`` turned into one frozen, hashable dataclass.

``ModelConfig`` is registered as a *static* pytree node (no leaves), so it can be passed
straight into ``jax.jit`` and used for shapes and Python control flow inside traced code.
Test configs are ``dataclasses.replace(cfg, num_layers=2, ...)``.

Both spellings of RoPE settings found in the wild are accepted: transformers v5 writes
``rope_parameters`` (``{"rope_type", "rope_theta", ...}``) while older files carry
``rope_theta`` + ``rope_scaling`` (``{"type" | "rope_type", "factor", ...}``).  Supported RoPE
types: ``default``, ``linear`` and ``llama3``; anything else fails here, at load, with an error
naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature this engine does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias=True
    o_bias: bool = False  # Llama with attention_bias=True
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Layout of the fused q/k/v and gate/up matrices: shard-major in this many groups for tensor
    # parallelism (inferscale_jax/sharding.py: group i holds the q, k and v heads - and the gate and up
    # columns - of device i); 1 is the layout as loaded, [q | k | v] and [gate | up].  Not in repr, so
    # the config digest (model fingerprint) is the same for every layout.
    fused_shards: int = dataclasses.field(default=1, repr=False)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures={archs!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = int(d.get("head_dim") or hidden // heads)
        max_pos = int(d.get("max_position_embeddings", 4096))
        # Sliding-window attention is the same as full attention while the whole sequence
        # fits in the window, so the usable context is capped at the window instead.
        window = d.get("sliding_window")
        uses_window = kind == "mistral" or d.get("use_sliding_window", False)
        if window is not None and uses_window and int(window) < max_pos:
            max_pos = int(window)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(d),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or attention_bias,
            o_bias=kind in ("llama", "mistral") and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=kind == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(os.fspath(model_dir), "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: a model folder needs an HF config.json")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rtype!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rtype == "default":
        return RopeConfig(theta=theta)
    factor = float(params["factor"])
    if rtype == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


# Static pytree nodes: no leaves, compared and hashed by value under jit.
jax.tree_util.register_static(RopeConfig)
jax.tree_util.register_static(ModelConfig)
