"""The functional decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3).

``forward(params, cfg, tokens, positions, cache, meta)`` is a pure function: embeddings, then
per layer RMSNorm -> q/k/v projections (+bias for Qwen2, +q/k RMSNorm for Qwen3) -> RoPE ->
attention -> output projection -> residual -> RMSNorm -> SwiGLU MLP -> residual; final norm and
the LM head (tied to the embeddings when the config says so).  Each residual add runs together with the
RMSNorm after it (``add_rms_norm``; a layer hands its MLP output to the next one unadded), so a cache can
supply both as one kernel (``PagedKVCache.add_rms_norm``); it may also split the qkv projection into heads and
apply RoPE in one kernel (``PagedKVCache.qkv_rope``), and run the projections (``PagedKVCache.linear``).

Attention is the replaceable part: the model hands each layer's new ``q``/``k``/``v`` to
``cache.attend(layer, q, k, v, positions, meta)``, which stores ``k``/``v`` in the cache and
returns the attention output together with the updated cache.  A cache may also supply the glue
next to it as kernels (the optional ``add_rms_norm``, ``qkv_rope`` and ``linear`` above, the same numbers within
a rounding step).
``models/dense_cache.py`` is a dense cache for simple generation and tests; the engine's paged cache (page pool + Pallas
kernels) implements the same method, so the model never knows how KV is stored.

Numerics follow transformers: RMSNorm in float32 then cast back, RoPE cos/sin in float32 cast
to the activation dtype, softmax in float32, logits in float32.  ``precision`` sets the matmul
precision of every dot traced inside ``forward`` (``jax.default_matmul_precision``, so the
cache's attention is covered too): JAX's default runs float32 dots as TF32 on a GPU, "highest"
makes them IEEE float32 (``EngineConfig.matmul_precision``, docs/architecture.md).  Callers that
jit ``forward`` pass it as a static argument, so each precision is its own compile.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.rope import apply_rope, inv_freq, rope_cos_sin


class KVCache(Protocol):
    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, meta: Any) -> tuple[jax.Array, "KVCache"]:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] (RoPE applied) -> (out [B, T, Hq, D], cache)."""
        ...


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(dtype)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                 eps: float) -> tuple[jax.Array, jax.Array]:
    """A residual add and the RMSNorm after it: (x + delta, rms_norm(x + delta)); ``delta`` None: (x, rms_norm(x))."""
    s = x if delta is None else x + delta
    return s, rms_norm(s, weight, eps)


def _add_norm_of(cache) -> Any:
    """The cache's own residual add + RMSNorm when it has one (``PagedKVCache.add_rms_norm``: a Pallas kernel
    on the GPU), else :func:`add_rms_norm`; the same numbers within one rounding step (the kernel sums the
    squares in another order)."""
    return getattr(cache, "add_rms_norm", add_rms_norm)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, cache: Any = None) -> jax.Array:
    """``x @ w (+ b)``: the cache's own matmul where it has one and takes the shape (``PagedKVCache.linear``: a
    Pallas kernel at decode-sized row counts under its switch), else XLA's dot."""
    mm = getattr(cache, "linear", None)
    y = mm(x, w) if mm is not None else None
    if y is None:
        y = jnp.einsum("...i,io->...o", x, w)
    return y if b is None else y + b


def project_qkv(cfg: ModelConfig, p: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
                positions: jax.Array | None = None, cache: Any = None):
    """A layer's attention inputs: h [B, T, H] (the layer's input after its attention norm) -> q [B, T, Hq, D],
    k/v [B, T, Hkv, D] (RoPE on q, k).  A cache with its own split + RoPE (``PagedKVCache.qkv_rope``: one
    kernel on the GPU) takes the plain ``[q | k | v]`` layout without q/k norms from ``positions``."""
    b, t, _ = h.shape
    d = cfg.head_dim
    qkv = _linear(h, p["wqkv"], p.get("bqkv"), cache)  # [B, T, (Hq + 2 Hkv) * D]
    rope = getattr(cache, "qkv_rope", None)
    if rope is not None and positions is not None and cfg.fused_shards == 1 and not cfg.qk_norm:
        out = rope(qkv, positions, inv_freq(cfg.rope, d), cfg.num_heads, cfg.num_kv_heads)
        if out is not None:
            return out
    n = cfg.fused_shards  # shard-major groups [q_i | k_i | v_i] (ModelConfig.fused_shards); 1: [q | k | v]
    qkv = qkv.reshape(b, t, n, -1)
    qd, kvd = cfg.num_heads * d // n, cfg.num_kv_heads * d // n
    q = qkv[..., :qd].reshape(b, t, cfg.num_heads, d)
    k = qkv[..., qd:qd + kvd].reshape(b, t, cfg.num_kv_heads, d)
    v = qkv[..., qd + kvd:].reshape(b, t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _layer(cfg: ModelConfig, p: dict, layer: int, x: jax.Array, delta: jax.Array | None, cos: jax.Array,
           sin: jax.Array, positions: jax.Array, cache: KVCache,
           meta: Any) -> tuple[jax.Array, jax.Array, KVCache]:
    """One layer: its input is ``x + delta`` (the residual stream and the layer before's MLP output, not yet
    added; ``_forward`` gives the first layer zeros, a caller may give None), its output ``(x, delta, cache)`` the
    same way, so that each residual add runs with the RMSNorm after it (``_add_norm_of``); ``_forward`` adds the
    last one."""
    b, t, _ = x.shape  # x [B, T, H]
    add_norm = _add_norm_of(cache)
    x, h = add_norm(x, delta, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(cfg, p, h, cos, sin, positions, cache)
    attn, cache = cache.attend(layer, q, k, v, positions, meta)  # [B, T, Hq, D]
    o = _linear(attn.reshape(b, t, cfg.num_heads * cfg.head_dim), p["wo"], p.get("bo"), cache)
    x, h = add_norm(x, o, p["mlp_norm"], cfg.rms_norm_eps)
    gate_up = _linear(h, p["w_gate_up"], p.get("b_gate_up"), cache)  # [B, T, 2I], [gate_i | up_i] per group
    gate, up = jnp.split(gate_up.reshape(b, t, cfg.fused_shards, -1), 2, axis=-1)
    act = (jax.nn.silu(gate) * up).reshape(b, t, -1)  # [B, T, I]
    return x, _linear(act, p["w_down"], p.get("b_down"), cache), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer_nested(cfg: ModelConfig, p: dict, x: jax.Array, delta: jax.Array | None, cos: jax.Array,
                  sin: jax.Array, positions: jax.Array, view: KVCache,
                  meta: Any) -> tuple[jax.Array, jax.Array, KVCache]:
    """One layer over a one-layer view of the cache, as a nested jit: inside ``forward``'s trace
    it is traced and lowered once for all layers of the same shapes (XLA inlines the calls, so the
    compiled step is the same), which cuts a step's trace + lowering time several-fold."""
    return _layer(cfg, p, 0, x, delta, cos, sin, positions, view, meta)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, meta: Any = None, logits_index: jax.Array | None = None,
            precision: str | None = None) -> tuple[jax.Array, KVCache]:
    """tokens, positions [B, T] int32 -> (logits, cache).

    logits are ``[B, T, V]`` float32, or ``[B, V]`` at ``logits_index [B]`` (the position in
    the chunk whose next-token distribution is wanted) when that is given, which skips the LM
    head for every other token; ``logits_index [B, R]`` gives ``[B, R, V]`` (a flat batch of
    many sequences' tokens, ``B == 1``: the last token of each).  precision: "default" / "high" / "highest", or None for the
    ambient ``jax.default_matmul_precision`` (module docstring).
    """
    scope = jax.default_matmul_precision(precision) if precision is not None else contextlib.nullcontext()
    with scope:
        return _forward(params, cfg, tokens, positions, cache, meta, logits_index)


def _forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
             cache: KVCache, meta: Any, logits_index: jax.Array | None) -> tuple[jax.Array, KVCache]:
    x = params["embed"][tokens]  # [B, T, H]
    cos, sin = rope_cos_sin(positions, jnp.asarray(inv_freq(cfg.rope, cfg.head_dim)))
    nested = hasattr(cache, "layer_view")
    # the layer before's MLP output, added to x with the next norm (_layer); zeros for the first layer, so every
    # layer is one trace of the nested jit (XLA folds the add of zeros away in the jnp form)
    delta = jnp.zeros_like(x)
    for layer, p in enumerate(params["layers"]):
        if nested:
            x, delta, view = _layer_nested(cfg, p, x, delta, cos, sin, positions, cache.layer_view(layer), meta)
            cache = cache.with_layer(layer, view)
        else:
            x, delta, cache = _layer(cfg, p, layer, x, delta, cos, sin, positions, cache, meta)
    if logits_index is not None and logits_index.ndim == 2:  # [B, R] tokens per sequence
        take = lambda a: jnp.take_along_axis(a, logits_index[:, :, None].astype(jnp.int32), axis=1)  # [B, R, H]
        x, delta = take(x), take(delta)
    elif logits_index is not None:
        take = lambda a: jnp.take_along_axis(a, logits_index[:, None, None].astype(jnp.int32), axis=1)[:, 0]  # [B, H]
        x, delta = take(x), take(delta)
    _, x = add_rms_norm(x, delta, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]  # [H, V]
    logits = jnp.einsum("...h,hv->...v", x, head, preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32), cache
