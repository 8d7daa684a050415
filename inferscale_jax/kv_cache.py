"""The paged KV cache pytree and the attention that reads and writes it.

``PagedKVCache`` holds the page pool of every layer: ``k[l]``/``v[l]`` are ``[Hkv, P, S, D]``
(the kernels' layout, ``pallas_kernels/common.py``).  One array per layer, so the attention
kernels read a layer's pages in place and the jitted step (which donates the cache) updates
them in place.  Page 0 is the null page that padding points at.

``attend`` is the model's one replaceable attention function (``models/transformer.py``):
it scatters the step's new K/V into their slots (``AttnMeta.slots``), then runs paged
attention over everything each sequence has in pages.  Engine steps hand it a flat token batch
``q [1, N]``: a *mixed* step (``AttnMeta.ragged``: prefill chunks and decode rows together,
row ``r`` owning tokens ``cu_q_lens[r] .. cu_q_lens[r + 1] - 1``) runs the ragged kernel
(cached pages + causal over the row's own chunk); a *decode* step (one token per row, ``N``
rows) runs the decode kernel, or the cascade kernel when a group of rows shares a prefix read
once for the group.  Blend's recompute (``by_position``) keeps its own ``[B, T]`` layout.  ``impl``
picks the Pallas kernels or their pure-jnp references (fast on the CPU, where Pallas only
interprets).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from models.config import ModelConfig
from models.dense_cache import dense_attention
from pallas_kernels.cascade_attention import (shared_prefix_decode_attention,
                                              shared_prefix_decode_attention_ref)
from pallas_kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.kv_write import write_kv, write_kv_pallas
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_ref


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnMeta:
    slots: jax.Array  # [B*T] int32: slot (page * S + offset) of every new token; padding -> null page
    page_table: jax.Array  # [B, max_pages] int32
    q_lens: jax.Array  # [B] int32: new tokens of each sequence in this step
    kv_lens: jax.Array  # [B] int32: tokens in pages after this step (cached + new)
    # cascade decode: the full pages the rows of one group share ([Ps] int32, padded with the null
    # page), how many tokens they hold and which rows belong to the group ([B] bool); page_table /
    # kv_lens then describe a group row's own suffix only, and any other row's whole context
    shared_pages: jax.Array | None = None
    shared_len: jax.Array | None = None  # [] int32
    shared_rows: jax.Array | None = None  # [B] bool
    # a mixed step: q is the flat [1, N] token batch, row r owning tokens cu_q_lens[r] ..
    # cu_q_lens[r + 1] - 1 ([R + 1] int32); else (engine steps) every row has one token, q [1, R]
    cu_q_lens: jax.Array | None = None
    ragged: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # blend's recompute: queries at arbitrary positions, each seeing keys at positions <= its own
    by_position: bool = dataclasses.field(default=False, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    k: list[jax.Array]  # L x [Hkv, P, S, D]
    v: list[jax.Array]  # L x [Hkv, P, S, D]
    impl: str = dataclasses.field(default="ref", metadata=dict(static=True))
    # tensor parallelism (inferscale_jax/sharding.py): the pages are split on kv heads over this
    # mesh's "tp" axis and ``attend`` runs per shard; None: one device
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, impl: str = "ref",
               mesh: Mesh | None = None) -> "PagedKVCache":
        shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        if mesh is None:
            zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
        else:  # each device allocates only its own kv heads
            from inferscale_jax.sharding import kv_sharding
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_sharding(mesh))
        return cls(k=[zeros() for _ in range(cfg.num_layers)], v=[zeros() for _ in range(cfg.num_layers)],
                   impl=impl, mesh=mesh)

    def with_pages(self, k: list, v: list) -> "PagedKVCache":
        """The same cache (impl, mesh) over other page arrays."""
        return dataclasses.replace(self, k=k, v=v)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def layer_view(self, layer: int) -> "PagedKVCache":
        """The cache of one layer (as layer 0), for ``forward``'s per-layer nested jit."""
        return self.with_pages([self.k[layer]], [self.v[layer]])

    def with_layer(self, layer: int, view: "PagedKVCache") -> "PagedKVCache":
        ks, vs = list(self.k), list(self.v)
        ks[layer], vs[layer] = view.k[0], view.v[0]
        return self.with_pages(ks, vs)

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, meta: AttnMeta) -> tuple[jax.Array, "PagedKVCache"]:
        if self.mesh is None:
            out, kp, vp = _write_and_attend(q, k, v, self.k[layer], self.v[layer], positions, meta, self.impl)
        else:  # per shard: each device its own q / kv heads and pages; tables and lengths replicated
            heads = PartitionSpec(None, None, "tp", None)
            pages = PartitionSpec("tp")
            rep = PartitionSpec()
            fn = jax.shard_map(functools.partial(_write_and_attend, impl=self.impl), mesh=self.mesh,
                               in_specs=(heads, heads, heads, pages, pages, rep, rep),
                               out_specs=(heads, pages, pages), check_vma=False)
            out, kp, vp = fn(q, k, v, self.k[layer], self.v[layer], positions, meta)
        ks, vs = list(self.k), list(self.v)
        ks[layer], vs[layer] = kp, vp
        return out, self.with_pages(ks, vs)


def _write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      positions: jax.Array, meta: AttnMeta, impl: str):
    """Scatter the step's new K/V into their slots, then attend (one device's heads)."""
    b, t, hq, d = q.shape  # q [B, T, Hq, D]; k/v [B, T, Hkv, D]
    hkv = k.shape[2]
    dtype = k_pages.dtype
    pallas = impl == "pallas"
    write = write_kv_pallas if pallas else write_kv  # the Pallas scatter is ~5x faster on the H200
    kp, vp = write(k_pages, v_pages, k.reshape(b * t, hkv, d).astype(dtype),
                   v.reshape(b * t, hkv, d).astype(dtype), meta.slots)
    q = q.astype(dtype)
    if meta.by_position:
        out = paged_attention_by_position(q, kp, vp, meta.page_table, positions)
    elif meta.ragged:  # q [1, N]: the flat tokens of a mixed step
        fn = ragged_paged_attention if pallas else ragged_paged_attention_ref
        out = fn(q[0], kp, vp, meta.page_table, meta.cu_q_lens, meta.kv_lens)[None]  # [1, N, Hq, D]
    elif meta.shared_pages is not None:  # q [1, R]: one token per row, a cascade group
        fn = shared_prefix_decode_attention if pallas else shared_prefix_decode_attention_ref
        out = fn(q[0], kp, vp, meta.shared_pages, meta.shared_len, meta.page_table,
                 meta.kv_lens, meta.shared_rows)[None]
    else:  # q [1, R]: one token per row
        fn = paged_decode_attention if pallas else paged_decode_attention_ref
        out = fn(q[0], kp, vp, meta.page_table, meta.kv_lens)[None]
    return out, kp, vp


def paged_attention_by_position(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """q [B, T, Hq, D] at ``positions [B, T]`` over the sequence's pages: each query sees the keys
    at positions <= its own.  Plain jnp (gathers the sequence's pages); used only by blend mode
    to recompute a scattered subset of tokens, so it is not a kernel."""
    hkv, _, s, d = k_pages.shape
    b, mp = page_table.shape
    k = k_pages[:, page_table].reshape(hkv, b, mp * s, d).transpose(1, 2, 0, 3)  # [B, MP*S, Hkv, D]
    v = v_pages[:, page_table].reshape(hkv, b, mp * s, d).transpose(1, 2, 0, 3)
    return dense_attention(q, k, v, positions)


def page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes one page takes across all layers, K and V."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize
