"""The parameter pytree, described once.

``param_specs(cfg)`` is the single description of every weight: its path in the pytree, shape,
logical axis names (for later sharding), the HF tensor it comes from, and whether that tensor
is stored transposed (HF ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, out]`` so a
layer is ``x @ w``).  ``init_params`` (random), ``abstract_params`` (shapes only) and the
safetensors loader (``models/loader.py``) are all derived from it.

Pytree layout::

    {"embed": [V, H],
     "layers": [ {"attn_norm": [H], "wqkv": [H, (Hq + 2 Hkv) * D], "wo": [Hq*D, H],
                  ("bqkv": [(Hq + 2 Hkv) * D]), ("bo"), ("q_norm": [D], "k_norm": [D]),
                  "mlp_norm": [H], "w_gate_up": [H, 2 I], "w_down": [I, H]}, ... L ],
     "final_norm": [H],
     ("lm_head": [H, V])}          # absent when embeddings are tied

q/k/v and gate/up are fused into one matrix each (concatenated along the output axis at load
time; ``to_hf_tensors`` splits them back): at decode every matmul is a weight-bandwidth-bound
GEMV, and fewer, larger ones waste less.

Layers are a Python list (not stacked) because the paged KV cache keeps one page array per
layer and attention kernels read a layer's pages in place; a stacked/scanned layout would
slice (copy) the pool every step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple[str | int, ...]  # position in the pytree, e.g. ("layers", 3, "wq")
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, e.g. ("embed", "q_heads")
    hf_name: str | tuple[str, ...]  # several names: concatenated along the output axis
    transpose: bool = False  # the HF tensor(s) are stored as [out, in]
    init: str = "normal"  # "normal" | "ones" | "zeros"

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.hf_name if isinstance(self.hf_name, tuple) else (self.hf_name,)


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    specs = [ParamSpec(("embed",), (cfg.vocab_size, h), ("vocab", "embed"), "model.embed_tokens.weight")]
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."

        def s(name, shape, axes, hf, transpose=False, init="normal"):
            hf = hf if isinstance(hf, tuple) else p + hf  # tuples are given fully qualified
            specs.append(ParamSpec(("layers", l, name), shape, axes, hf, transpose, init))

        s("attn_norm", (h,), ("embed",), "input_layernorm.weight", init="ones")
        qkv = tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")
        s("wqkv", (h, qd + 2 * kvd), ("embed", "qkv_heads"), qkv, True)
        s("wo", (qd, h), ("q_heads", "embed"), "self_attn.o_proj.weight", True)
        if cfg.qkv_bias:
            s("bqkv", (qd + 2 * kvd,), ("qkv_heads",), tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"))
        if cfg.o_bias:
            s("bo", (h,), ("embed",), "self_attn.o_proj.bias")
        if cfg.qk_norm:
            s("q_norm", (d,), ("head_dim",), "self_attn.q_norm.weight", init="ones")
            s("k_norm", (d,), ("head_dim",), "self_attn.k_norm.weight", init="ones")
        s("mlp_norm", (h,), ("embed",), "post_attention_layernorm.weight", init="ones")
        s("w_gate_up", (h, 2 * i), ("embed", "mlp2"), (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), True)
        s("w_down", (i, h), ("mlp", "embed"), "mlp.down_proj.weight", True)
        if cfg.mlp_bias:
            s("b_gate_up", (2 * i,), ("mlp2",), (p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"))
            s("b_down", (h,), ("embed",), "mlp.down_proj.bias")
    specs.append(ParamSpec(("final_norm",), (h,), ("embed",), "model.norm.weight", init="ones"))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), (h, cfg.vocab_size), ("embed", "vocab"), "lm_head.weight", True))
    return specs


def assemble(cfg: ModelConfig, leaves: dict[tuple, jax.Array]) -> dict:
    """Build the nested pytree from ``{spec.path: array}``."""
    tree: dict = {"layers": [dict() for _ in range(cfg.num_layers)]}
    for path, value in leaves.items():
        if path[0] == "layers":
            tree["layers"][path[1]][path[2]] = value
        else:
            tree[path[0]] = value
    return tree


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    return assemble(cfg, {s.path: jax.ShapeDtypeStruct(s.shape, dtype) for s in param_specs(cfg)})


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random weights (normal * scale; norms at one), generated on the default device."""
    specs = param_specs(cfg)
    keys = jax.random.split(key, len(specs))
    leaves = {}
    for k, s in zip(keys, specs):
        if s.init == "ones":
            leaves[s.path] = jnp.ones(s.shape, dtype)
        elif s.init == "zeros":
            leaves[s.path] = jnp.zeros(s.shape, dtype)
        else:
            leaves[s.path] = (scale * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
    return assemble(cfg, leaves)


def hf_split_sizes(cfg: ModelConfig, spec: ParamSpec) -> list[int]:
    """Output-axis sizes of the HF tensors fused into ``spec``."""
    if len(spec.hf_names) == 1:
        return [spec.shape[-1]]
    if len(spec.hf_names) == 3:  # q, k, v
        return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    return [cfg.intermediate_size] * 2  # gate, up


def to_hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The inverse of loading: HF-named host arrays (used to write checkpoints)."""
    out = {}
    for s in param_specs(cfg):
        node = params
        for k in s.path:
            node = node[k]
        arr = np.asarray(node)
        parts = np.split(arr, np.cumsum(hf_split_sizes(cfg, s))[:-1], axis=-1)
        for name, part in zip(s.hf_names, parts):
            out[name] = np.ascontiguousarray(part.T if s.transpose else part)
    return out


def num_params(params: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
