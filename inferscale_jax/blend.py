"""compose and blend: reuse each segment's standalone KV at a new position.

**compose** (Prompt Cache style): a request naming segments ``[s1, ..., sn]`` shares ``s1``'s
pages as in exact mode (segment 1 is always exact), and for every later segment copies its
standalone KV (computed at positions ``bos..bos+len``) to its place in the request with the
splice kernel, which re-rotates K by the position shift (RoPE is a rotation, so this is exact
for layer 0 and approximate after: those tokens never attended to the segments before them).
Nothing is recomputed.

**blend** (CacheBlend style): compose, then recompute the ``blend_ratio`` fraction of the
tokens of segments 2..n whose KV deviates most from what the full context would give, in every
layer, so some cross-segment attention is restored.  The deviation measure is the squared L2
distance of **layer-1 K and V** (after RoPE, summed over heads) between the composed cache and
a recomputation of layer 1 over the composed context.  Why layer 1: layer-0 K/V depend only on
the token and its position, so composition is exact there and layer 1 is the first layer whose
K/V carry cross-segment context; CacheBlend found that tokens with a high KV deviation in an
early layer keep it in later layers, so one cheap layer ranks the tokens (cost: layer 0 + the
layer-1 projections for the candidate tokens, about 1.5/L of recomputing them).  The selected
tokens are then recomputed through all layers at their positions (attention by position over
the request's pages), overwriting their composed KV; the rest keep it.

Composed pages are private to the request and never enter the prefix cache (their KV is not
the exact KV of their tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from inferscale_jax.kv_cache import AttnMeta, PagedKVCache, paged_attention_by_position
from models import ModelConfig, forward
from models.rope import inv_freq, rope_cos_sin
from models.transformer import _layer, project_qkv


class _ReadOnlyByPosition:
    """Attention over the pages by position without writing them (layer 0 of the ranking pass)."""

    def __init__(self, cache: PagedKVCache, page_table: jax.Array):
        self.cache, self.page_table = cache, page_table

    def qkv_rope(self, *args):  # the wrapped cache's glue kernels: layer 1's K as the cache's was computed
        return self.cache.qkv_rope(*args)

    def add_rms_norm(self, *args):
        return self.cache.add_rms_norm(*args)

    def linear(self, *args):
        return self.cache.linear(*args)

    def attend(self, layer, q, k, v, positions, meta):
        return paged_attention_by_position(q, self.cache.k[layer], self.cache.v[layer], self.page_table,
                                           positions), self


@functools.partial(jax.jit, static_argnames=("cfg",))
def layer1_deviation(params, cfg: ModelConfig, cache: PagedKVCache, tokens, positions, slots, page_table):
    """tokens/positions [1, T], slots [T] (where their composed KV sits), page_table [1, MP]
    -> deviation [T] float32 (see module docstring)."""
    x = params["embed"][tokens]  # [1, T, H]
    cos, sin = rope_cos_sin(positions, jnp.asarray(inv_freq(cfg.rope, cfg.head_dim)))
    view = _ReadOnlyByPosition(cache, page_table)
    x, delta, _ = _layer(cfg, params["layers"][0], 0, x, None, cos, sin, positions, view, None)
    _, h = view.add_rms_norm(x, delta, params["layers"][1]["attn_norm"], cfg.rms_norm_eps)
    _, k, v = project_qkv(cfg, params["layers"][1], h, cos, sin, positions, view)  # [1, T, Hkv, D]
    hkv, p, s, d = cache.k[1].shape
    k_c = cache.k[1].reshape(hkv, p * s, d)[:, slots].transpose(1, 0, 2)  # [T, Hkv, D]
    v_c = cache.v[1].reshape(hkv, p * s, d)[:, slots].transpose(1, 0, 2)
    dk = (k[0].astype(jnp.float32) - k_c.astype(jnp.float32)) ** 2
    dv = (v[0].astype(jnp.float32) - v_c.astype(jnp.float32)) ** 2
    return dk.sum(axis=(1, 2)) + dv.sum(axis=(1, 2))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def recompute_tokens(params, cfg: ModelConfig, cache: PagedKVCache, tokens, positions, slots, page_table, kv_lens):
    """Recompute the K/V of tokens [1, T] at positions [1, T] through every layer, in place."""
    meta = AttnMeta(slots=slots, page_table=page_table, q_lens=jnp.ones_like(kv_lens), kv_lens=kv_lens,
                    by_position=True)
    _, cache = forward(params, cfg, tokens, positions, cache, meta, logits_index=jnp.zeros((1,), jnp.int32))
    return cache


def _pad(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def blend(runner, tokens: list[int], positions: list[int], pages: list[int], kv_len: int, ratio: float) -> int:
    """Recompute the ``ratio`` most-deviating of ``positions`` (tokens of segments 2..n) in place.
    Returns how many tokens were recomputed."""
    n = len(positions)
    if n == 0 or ratio <= 0.0:
        return 0
    s = runner.page_size
    width = 1 << max(2, (len(pages) - 1).bit_length())
    table = np.zeros((1, width), np.int32)
    table[0, :len(pages)] = pages
    pos = np.asarray(positions, np.int32)
    slots = np.asarray(pages, np.int32)[pos // s] * s + pos % s
    t = _pad(n)  # bucketed: padding tokens sit at position 0 and read/write the null page
    tok_p = np.zeros((1, t), np.int32)
    pos_p = np.zeros((1, t), np.int32)
    slot_p = np.zeros((t,), np.int32)
    tok_p[0, :n] = [tokens[p] for p in positions]
    pos_p[0, :n] = pos
    slot_p[:n] = slots
    dev = np.asarray(layer1_deviation(runner.params, runner.cfg, runner.cache, tok_p, pos_p, slot_p, table))[:n]
    k = min(n, max(1, int(np.ceil(ratio * n))))
    chosen = np.sort(np.argsort(-dev, kind="stable")[:k])  # in position order
    t = _pad(k)
    tok_r = np.zeros((1, t), np.int32)
    pos_r = np.zeros((1, t), np.int32)
    slot_r = np.zeros((t,), np.int32)
    tok_r[0, :k] = tok_p[0, chosen]
    pos_r[0, :k] = pos[chosen]
    slot_r[:k] = slots[chosen]
    runner.write(lambda cache: recompute_tokens(runner.params, runner.cfg, cache, tok_r, pos_r, slot_r, table,
                                                np.asarray([kv_len], np.int32)))
    return k
