"""A dense (non-paged) KV cache: one ``[B, T_max, Hkv, D]`` buffer per layer.

Slot ``t`` of sequence ``b`` holds the key/value at absolute position ``t``.  ``attend`` writes
the chunk's K/V at its positions and lets each query see the keys at positions ``<=`` its own.
Because every sequence occupies positions ``0..len-1`` contiguously, that mask is exact for
ragged batches too: right-padding tokens (positions past a sequence's length) only write slots
that the sequence's real queries cannot see yet, and a later step overwrites them.

Used for plain generation (``inferscale generate``) and as the reference against the paged
engine; the engine's serving path uses the paged cache instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseKVCache:
    k: list[jax.Array]  # L x [B, T_max, Hkv, D]
    v: list[jax.Array]  # L x [B, T_max, Hkv, D]

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_len: int, dtype) -> "DenseKVCache":
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
                   v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)])

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, meta: Any = None) -> tuple[jax.Array, "DenseKVCache"]:
        b, t, hq, d = q.shape  # q [B, T, Hq, D]; k/v [B, T, Hkv, D]; positions [B, T]
        rows = jnp.arange(b)[:, None]
        kc = self.k[layer].at[rows, positions].set(k.astype(self.k[layer].dtype))
        vc = self.v[layer].at[rows, positions].set(v.astype(self.v[layer].dtype))
        out = dense_attention(q, kc, vc, positions)
        ks, vs = list(self.k), list(self.v)
        ks[layer], vs[layer] = kc, vc
        return out, DenseKVCache(ks, vs)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array) -> jax.Array:
    """q [B, T, Hq, D]; k/v [B, S, Hkv, D] indexed by position; query at position p sees keys <= p."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    key_pos = jnp.arange(k.shape[1])
    mask = key_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
