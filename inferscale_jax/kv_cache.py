"""The paged KV cache pytree and the attention that reads and writes it.

``PagedKVCache`` holds the page pool of every layer: ``k[l]``/``v[l]`` are ``[Hkv, P, S, D]``
(the kernels' layout, ``pallas_kernels/common.py``).  One array per layer, so the attention
kernels read a layer's pages in place and the jitted step (which donates the cache) updates
them in place.  Page 0 is the null page that padding points at.

``attend`` is the model's replaceable attention function (``models/transformer.py``; the cache
also supplies the glue beside it as kernels: ``qkv_rope``, the qkv split and RoPE, and
``add_rms_norm``, each residual add with its norm, and ``linear``, the projections at decode-sized row counts,
under their switches):
it scatters the step's new K/V into their slots (``AttnMeta.slots``), then runs paged
attention over everything each sequence has in pages.  Engine steps hand it a flat token batch
``q [1, N]``: a *mixed* step (``AttnMeta.ragged``: prefill chunks and decode rows together,
row ``r`` owning tokens ``cu_q_lens[r] .. cu_q_lens[r + 1] - 1``) runs the ragged kernel
(cached pages + causal over the row's own chunk); a *decode* step (one token per row, ``N``
rows) runs the decode kernel, or the multi-group cascade kernel when rows share prefixes.
Blend's recompute (``by_position``) keeps its own ``[B, T]`` layout.

Cascade (``AttnMeta.group_pages`` set): the step's rows are grouped by shared prefix - a
segment chain's node, or prefix-cache hits several rows share - into a *group table*:
``group_pages [G, Ps]`` (each group's shared full pages, padded with the null page),
``group_lens [G]`` (its shared tokens, a multiple of the page size; 0 for padding groups) and
``row_group [R]`` (each row's group, -1 for none).  A group row's ``page_table`` / ``kv_lens``
then describe its own suffix only; any other row's, its whole context.  One launch of
``pallas_kernels/cascade_attention.py``'s grouped kernel reads every group's pages once per row
block of that group's members, and the suffixes go through the decode kernel, which starts each
row's online softmax from its group's shared partials (``"ref"``: the kernel's jnp reference, the two
parts merged by their log-sum-exps: same semantics).  Decode steps and
mixed steps both carry groups: in a mixed step the group rows are its one-token decode rows, the
ragged kernel runs over every row as usual (a group row seeing only its suffix, its log-sum-exp
kept) and the grouped kernel's shared part, in the same jitted step, adds each group row's shared
prefix (``_mixed``): each suffix is read once.  The ragged kernel starts each group token's online
softmax from the shared part's split partials, so its output is final (``INFERSCALE_MIXED_MERGE=jnp``,
the earlier form kept as an A/B switch: the two merged by their log-sum-exps in jnp after it).
(``INFERSCALE_MIXED_DECODE=cascade``, an A/B switch that measured slower: the one-token rows of a
mixed step through the decode step's cascade kernel instead, ``_mixed_split``.)  The kernels read
their environment switches (``pallas_kernels.common.switches``) while tracing; the cache carries
them as a static field (``switches``), so they key every jit it goes through.

``impl`` picks the kernels, here and nowhere else (:func:`resolve_impl`, at construction):
``"pallas"`` the GPU (Triton-style) kernels of ``pallas_kernels/``, ``"pallas_tpu"`` the Mosaic TPU
kernels of ``pallas_kernels/tpu/`` (TPU interpret mode off a TPU), ``"ref"`` their pure-jnp
references (fast on the CPU, where Pallas only interprets).  ``"auto"`` follows
``jax.default_backend()``: GPU kernels on a GPU, TPU kernels on a TPU, references elsewhere.  On
``pallas_tpu`` a decode step and a cascade step run the ragged TPU kernel (a decode row is a row
of one token; a group row's page list is its group's shared pages followed by its own), and
pages the TPU kernels cannot take - compressed KV, or shapes that do not tile
(``pallas_kernels/tpu/common.py``) - run the references, with the reason logged once.

Compressed KV (``kv_dtype`` int8 / float8_e4m3fn, ``pallas_kernels/quant.py``): ``k_scale`` /
``v_scale`` hold one float32 scale per (token, kv head), ``[Hkv, P, S]`` per layer; the write
quantizes the step's new tokens and the kernels dequantize what they read.  Tensor parallelism
(``mesh``, ``inferscale_jax/sharding.py``): every page array is split on kv heads and ``attend``
runs per shard in ``jax.shard_map``, the tables and lengths replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from models.config import ModelConfig
from models.dense_cache import dense_attention
from pallas_kernels import common
from pallas_kernels.cascade_attention import (SHARED_BLOCK_KV, default_block_rows, grouped_cascade_decode_attention,
                                              grouped_cascade_decode_attention_ref,
                                              grouped_shared_prefix_attention,
                                              grouped_shared_prefix_attention_ref, grouped_shared_prefix_partials,
                                              merge_lse)
from pallas_kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.gemm import check_matmul_inputs, default_blocks, matmul_pallas
from pallas_kernels.norm import add_rms_norm_pallas, add_rms_norm_ref
from pallas_kernels.rope import qkv_rope_pallas
from pallas_kernels.kv_write import write_kv, write_kv_pallas, write_kv_quantized, write_kv_quantized_pallas
from pallas_kernels.quant import SCALE_BYTES, dequantize_pages, is_quantized, pack_block, unpack_block
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_ref
from pallas_kernels.splice import splice_kv, splice_kv_ref
from pallas_kernels.splice_quantized import splice_kv_quantized, splice_kv_quantized_ref
from pallas_kernels.tpu import ragged_paged_attention_tpu, splice_kv_tpu, tiling_problem, write_kv_tpu

log = logging.getLogger("inferscale.kv_cache")
IMPLS = ("pallas", "pallas_tpu", "ref")  # what ``impl`` holds once resolved ("auto" never)
# ``linear``'s kernel: steps of MATMUL_MIN_ROWS-MATMUL_MAX_ROWS tokens, weights of at most MATMUL_MAX_N columns (runs
# AZ and BA's sweeps, bench/NOTES.md: the kernel wins 2-10% at 16-128 rows on qkv, o and down; XLA's dot is as fast
# at 1 row and on the 8B's 28672-column gate_up; past 128 rows its cuBLAS GEMMs near the FLOP ceiling)
MATMUL_MIN_ROWS = 16
MATMUL_MAX_ROWS = 128
MATMUL_MAX_N = 8192


def resolve_impl(requested: str, head_dim: int, page_size: int, dtype, kv_dtype=None) -> str:
    """The kernels a cache of this shape runs (one of IMPLS) for ``EngineConfig.attention_impl``.

    "auto": the GPU kernels on a GPU (power-of-two head_dim >= 16, Triton's tiles), the TPU kernels
    on a TPU, else the references.  "pallas_tpu" (forced, or chosen by "auto") falls back to "ref"
    when the TPU kernels cannot take these pages, and says why."""
    impl = requested
    if requested == "auto":
        backend = jax.default_backend()
        pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
        impl = {"gpu": "pallas" if pow2 else "ref", "tpu": "pallas_tpu"}.get(backend, "ref")
    if impl == "pallas_tpu":
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        problem = (f"compressed KV ({kv_dtype.name}) is not supported by the TPU kernels" if is_quantized(kv_dtype)
                   else tiling_problem(head_dim, page_size, dtype))
        if problem:
            log.warning("attention_impl=%r: the TPU kernels cannot run these pages, using the jnp references: %s",
                        requested, problem)
            impl = "ref"
    if impl not in IMPLS:
        raise ValueError(f"attention_impl: got {requested!r}, expected 'auto' or one of {IMPLS}")
    return impl


def splice_fn(impl: str, quantized: bool):
    """The splice (K/V between slots, K re-rotated) of a cache: the impl's kernel or the reference.
    Compressed pages dequantize, rotate and quantize again: in one Pallas kernel for "pallas" (it must
    stay bit-identical to the jnp form: tests/kernels/test_kernels_splice.py; its speed: bench/results/kv_dtype.md),
    else the jnp form."""
    if quantized:
        return splice_kv_quantized if impl == "pallas" else splice_kv_quantized_ref
    return {"pallas": splice_kv, "pallas_tpu": splice_kv_tpu}.get(impl, splice_kv_ref)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnMeta:
    slots: jax.Array  # [B*T] int32: slot (page * S + offset) of every new token; padding -> null page
    page_table: jax.Array  # [B, max_pages] int32
    q_lens: jax.Array  # [B] int32: new tokens of each sequence in this step
    kv_lens: jax.Array  # [B] int32: tokens in pages after this step (cached + new)
    # cascade decode (the group table, module docstring): each group's shared full pages ([G, Ps]
    # int32, padded with the null page), how many tokens they hold ([G] int32) and each row's group
    # ([B] int32, -1: none); page_table / kv_lens then describe a group row's own suffix only, and
    # any other row's whole context
    group_pages: jax.Array | None = None
    group_lens: jax.Array | None = None  # [G] int32
    row_group: jax.Array | None = None  # [B] int32
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
    # compressed KV (pallas_kernels/quant.py): int8 / float8 pages and one float32 scale per (token,
    # kv head), L x [Hkv, P, S]; None for pages of the model's dtype
    k_scale: list[jax.Array] | None = None
    v_scale: list[jax.Array] | None = None
    compute_dtype: str = dataclasses.field(default="bfloat16", metadata=dict(static=True))  # of dequantized KV
    # the kernels' environment switches when the cache was made (pallas_kernels.common.switches_key):
    # the kernels read them while tracing, so they key every jit the cache goes through, the model's
    # nested per-layer jit included (an engine made after a switch changed traces its own steps)
    switches: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @classmethod
    def create(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, impl: str = "ref",
               mesh: Mesh | None = None, kv_dtype=None) -> "PagedKVCache":
        """Zeroed pages; ``impl`` as ``EngineConfig.attention_impl`` ("auto" resolved here)."""
        impl = resolve_impl(impl, cfg.head_dim, page_size, dtype, kv_dtype)
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

        def zeros_of(shp, dt):
            if mesh is None:
                return lambda: jnp.zeros(shp, dt)
            from inferscale_jax.sharding import kv_sharding  # each device allocates only its own kv heads
            return jax.jit(lambda: jnp.zeros(shp, dt), out_shardings=kv_sharding(mesh))

        zeros = zeros_of(shape, kv_dtype)
        scales = None
        if is_quantized(kv_dtype):
            ones = zeros_of(shape[:-1], jnp.float32)
            scales = ([ones() for _ in range(cfg.num_layers)], [ones() for _ in range(cfg.num_layers)])
        return cls(k=[zeros() for _ in range(cfg.num_layers)], v=[zeros() for _ in range(cfg.num_layers)],
                   impl=impl, mesh=mesh, k_scale=scales[0] if scales else None,
                   v_scale=scales[1] if scales else None, compute_dtype=jnp.dtype(dtype).name,
                   switches=common.switches_key())

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def with_pages(self, k: list, v: list, k_scale: list | None = None, v_scale: list | None = None) -> "PagedKVCache":
        """The same cache (impl, mesh, dtypes) over other page arrays (and scales, when quantized)."""
        return dataclasses.replace(self, k=k, v=v, k_scale=k_scale, v_scale=v_scale)

    def _scales(self, layer: int):
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def layer_view(self, layer: int) -> "PagedKVCache":
        """The cache of one layer (as layer 0), for ``forward``'s per-layer nested jit."""
        ks, vs = self._scales(layer)
        return self.with_pages([self.k[layer]], [self.v[layer]], *(([ks], [vs]) if self.quantized else ()))

    def with_layer(self, layer: int, view: "PagedKVCache") -> "PagedKVCache":
        return self._set_layer(layer, view.k[0], view.v[0], view._scales(0))

    def _set_layer(self, layer: int, k, v, scales) -> "PagedKVCache":
        """The cache with one layer's pages (and scales, when quantized) replaced."""
        new = [list(self.k), list(self.v)] + ([list(self.k_scale), list(self.v_scale)] if self.quantized else [])
        for arrays, value in zip(new, (k, v, *scales)):
            arrays[layer] = value
        return self.with_pages(*new)

    def add_rms_norm(self, x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                     eps: float) -> tuple[jax.Array, jax.Array]:
        """The model's residual add and the RMSNorm after it (``models/transformer.py``): one Pallas kernel
        with ``INFERSCALE_NORM=pallas`` on the GPU kernels, one device and a power-of-two hidden size
        (``pallas_kernels/norm.py``); else the model's jnp, which XLA fuses."""
        h = x.shape[-1]
        if self.impl == "pallas" and self.mesh is None and not h & (h - 1) and common.norm() == "pallas":
            return add_rms_norm_pallas(x, delta, weight, eps)
        return add_rms_norm_ref(x, delta, weight, eps)

    def linear(self, x: jax.Array, w: jax.Array) -> jax.Array | None:
        """``x [..., K] @ w [K, N]`` for the model's projections (``models/transformer.py``'s ``_linear``): the
        skinny-matmul kernel (``pallas_kernels/gemm.py``; ``INFERSCALE_MATMUL``, on by default) on the GPU kernels, one
        device, 16-bit activations and weights, ``MATMUL_MIN_ROWS``-``MATMUL_MAX_ROWS`` rows, at most ``MATMUL_MAX_N``
        columns and the kernel's tiled shapes; None where XLA's dot runs."""
        if (self.impl != "pallas" or self.mesh is not None or common.matmul() != "pallas" or x.dtype != w.dtype
                or x.dtype.itemsize != 2 or w.ndim != 2):  # (16-bit: the measured case; float32 engines check numerics)
            return None
        lead, (k, n) = x.shape[:-1], w.shape
        m = math.prod(lead)
        if not MATMUL_MIN_ROWS <= m <= MATMUL_MAX_ROWS or n > MATMUL_MAX_N:
            return None
        knobs = default_blocks(m, k, n, x.dtype.itemsize)
        try:
            check_matmul_inputs(x.reshape(m, k), w, knobs["block_n"], knobs["block_k"], knobs["split_k"])
        except ValueError:  # (a shape the kernel does not tile: XLA's dot)
            return None
        return matmul_pallas(x.reshape(m, k), w, **knobs).reshape(*lead, n)

    def qkv_rope(self, qkv: jax.Array, positions: jax.Array, freq, num_heads: int, num_kv_heads: int):
        """The model's q / k / v out of its fused ``[q | k | v]`` projection ``qkv [B, T, (Hq + 2 Hkv) D]``, RoPE on
        q and k by ``positions [B, T]`` and the ``[D/2]`` frequencies (``models/transformer.py``'s
        ``project_qkv``): one Pallas kernel (``pallas_kernels/rope.py``) on the GPU kernels and one device unless
        ``INFERSCALE_ROPE=jnp``; None where the model's own form runs."""
        if self.impl != "pallas" or self.mesh is not None or common.rope() != "pallas":
            return None
        b, t, f = qkv.shape
        # (interpret mode, the CPU: 64-token blocks, a few sequential programs instead of many; same numbers)
        block = {"block_tokens": 64} if common.default_interpret() else {}
        q, k, v = qkv_rope_pallas(qkv.reshape(b * t, f), positions.reshape(b * t), jnp.asarray(freq),
                                  num_heads, num_kv_heads, **block)
        return q.reshape(b, t, *q.shape[1:]), k.reshape(b, t, *k.shape[1:]), v.reshape(b, t, *v.shape[1:])

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, meta: AttnMeta) -> tuple[jax.Array, "PagedKVCache"]:
        if self.switches and self.switches != common.switches_key():  # (traced code only: no cost per step)
            raise ValueError(f"the kernels' environment switches changed after this cache was made: "
                             f"{dict(self.switches)} then, {dict(common.switches_key())} now; set INFERSCALE_* "
                             f"switches before making the engine (pallas_kernels/common.py)")
        scales = self._scales(layer)
        fn = functools.partial(_write_and_attend, impl=self.impl, compute_dtype=self.compute_dtype)
        if self.mesh is not None:  # per shard: each device its own q / kv heads and pages; tables replicated
            heads = PartitionSpec(None, None, "tp", None)
            pages = PartitionSpec("tp")
            rep = PartitionSpec()
            fn = jax.shard_map(fn, mesh=self.mesh, in_specs=(heads, heads, heads, pages, pages, pages, rep, rep),
                               out_specs=(heads, pages, pages, pages), check_vma=False)
        out, kp, vp, new_scales = fn(q, k, v, self.k[layer], self.v[layer], scales, positions, meta)
        return out, self._set_layer(layer, kp, vp, new_scales)


def _write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      scales: tuple, positions: jax.Array, meta: AttnMeta, impl: str, compute_dtype: str):
    """Scatter the step's new K/V into their slots, then attend (one device's heads).  Quantized pages
    (``scales`` = (k_scale, v_scale)): the new tokens are quantized as they are written, and the
    kernels (and their references) dequantize each row they read with its scale."""
    b, t, hq, d = q.shape  # q [B, T, Hq, D]; k/v [B, T, Hkv, D]
    hkv = k.shape[2]
    if scales[0] is not None:  # compressed pages: quantized as written, dequantized as read
        pallas = impl == "pallas"  # (resolve_impl never leaves "pallas_tpu" on compressed pages)
        write = write_kv_quantized_pallas if pallas else write_kv_quantized  # quantized in the scatter
        kq, vq, ks, vs = write(k_pages, v_pages, scales[0], scales[1], k.reshape(b * t, hkv, d),
                               v.reshape(b * t, hkv, d), meta.slots)
        out = _attend(q.astype(jnp.dtype(compute_dtype)), kq, vq, positions, meta, impl, (ks, vs))
        return out, kq, vq, (ks, vs)
    dtype = k_pages.dtype
    # the kernels' own scatter where there is one (faster than XLA's: bench/kernels/kernels.py); the TPU one is DMAs
    write = {"pallas": write_kv_pallas, "pallas_tpu": write_kv_tpu}.get(impl, write_kv)
    kp, vp = write(k_pages, v_pages, k.reshape(b * t, hkv, d).astype(dtype),
                   v.reshape(b * t, hkv, d).astype(dtype), meta.slots)
    return _attend(q.astype(dtype), kp, vp, positions, meta, impl), kp, vp, (None, None)


def _attend(q, kp, vp, positions, meta: AttnMeta, impl: str, scales=(None, None)):
    sc = {} if scales[0] is None else dict(k_scale=scales[0], v_scale=scales[1])
    pallas = impl == "pallas"
    if meta.by_position:  # (blend's recompute, plain jnp: compressed pages dequantized first)
        kp, vp = dequantize_pages(kp, vp, *scales, q.dtype)
        out = paged_attention_by_position(q, kp, vp, meta.page_table, positions)
    elif impl == "pallas_tpu":  # one TPU kernel for mixed, decode and cascade steps
        out = ragged_paged_attention_tpu(q[0], kp, vp, *_as_ragged(meta, kp.shape[2]))[None]
    elif meta.ragged:  # q [1, N]: the flat tokens of a mixed step
        out = _mixed(q[0], kp, vp, meta, pallas, sc)[None]  # [1, N, Hq, D]
    elif meta.group_pages is not None:  # q [1, R]: one token per row, cascade groups
        fn = grouped_cascade_decode_attention if pallas else grouped_cascade_decode_attention_ref
        knobs = _decode_shared_knobs(q.shape[1], q.shape[-1], kp, q.shape[2], meta.group_pages.shape[0],
                                     q.dtype) if pallas else {}
        out = fn(q[0], kp, vp, meta.group_pages, meta.group_lens, meta.row_group, meta.page_table,
                 meta.kv_lens, **knobs, **sc)[None]
    else:  # q [1, R]: one token per row
        fn = paged_decode_attention if pallas else paged_decode_attention_ref
        out = fn(q[0], kp, vp, meta.page_table, meta.kv_lens, **sc)[None]
    return out


MIXED_BLOCK_ROWS = 64  # the shared part's row blocks in a mixed step (its group count is not known statically)
MIXED_REAL_GROUPS = 16  # the shared part's split count in a mixed step assumes at most this many real groups
# The shared part's split count in a mixed step by the step's token bucket: from ``MIXED_SPLIT_BUCKETS[i][0]``
# tokens up, ``[i][1]`` splits for ``MIXED_SPLIT_KV_HEADS`` kv heads on the device (fewer, e.g. under tensor
# parallelism: proportionally more splits, so the kernel keeps the program count that was measured); below the
# smallest, the automatic count (not measured).  Measured (bench/NOTES.md, run AV: the shared kernel's GPU time a
# layer on an H100, Llama-3-8B's 8 kv heads, 8 segments of 4096, the group table padded to 64): 128 tokens (C = 64)
# 91.2 us with the automatic 3 splits, 76.8 with 2, 86-95 with 5-8; 512 (spread answers at C = 256) 134.6 / 130.8
# with 2, worse with 5-8; 2048 (a wave of questions) 454.4 / 447.6 with 2 / 422.1 with 1 (1024: not measured).
# The C = 64 bare loop with 2: +2.2% tok/s (one run each way).  Run AX (H100, the engine's `fit` group table, 3
# stages): C = 64's 256-token step (three questions: each question's group is 4 row blocks of 64 over 4096 keys,
# so the step's longest programs) 102.0 us with 2, 75.8 with 3; the 128-token step 58.6 / 73.5 and spread answers'
# 512 106.3 / 109.9 keep 2.
MIXED_SPLIT_BUCKETS = ((1024, 1), (512, 2), (256, 3), (128, 2))  # (largest first)
MIXED_SPLIT_KV_HEADS = 8
assert list(MIXED_SPLIT_BUCKETS) == sorted(MIXED_SPLIT_BUCKETS, reverse=True)
# The shared part's pipeline stages in a mixed step (the kernel's own default there is 2), where one K (or V) tile
# is at most MIXED_STAGES_MAX_TILE_BYTES: the measured tile, 64 tokens x head dim 128 x bf16 (on bf16 or fp32 pages a
# 256-wide or 128-token tile, or fp32 at all, x 3 stages would near the shared-memory limit: those keep the kernel's
# default; int8 / fp8 pages pass the gate at twice the tokens or width, by bytes, not measured).
# Measured (bench/NOTES.md, run AW: H100, 8 segments of 4096, the engine's `fit` group table, by the GPU's kernel
# time a layer): 3 stages against 2: 57.0 / 68.7 us at C = 64 (128 tokens), 107.5 / 123.1 at spread answers
# (512), 391.9 / 419.4 on a wave of questions (2048); the same replayed mixed step -0.36 ms at C = 64, -0.44 at
# C = 256; the bare loop +2.3% / +1.9% tok/s (one run each way, inside its 2-3.5% spread between runs).
MIXED_SHARED_STAGES = 3
MIXED_STAGES_MAX_TILE_BYTES = 64 * 128 * 2
# (INFERSCALE_MIXED_SHARED overrides these and the kernel's other knobs: pallas_kernels/common.py)
# The decode steps' cascade shared part likewise (the kernel's default there is 2 beside many groups), under the
# same tile gate.  Measured (bench/NOTES.md, run AX: H100, 8 segments of 4096, the kernels' GPU time a layer):
# 64 rows 121.6 -> 110.5 us, 256 rows 192.4 -> 180.4.
DECODE_SHARED_STAGES = 3
# The decode steps' shared part with 8 warps where its row blocks are 32 rows or fewer (about 32 rows of a group
# a block: 64-128 rows over 8 segments).  Measured (bench/NOTES.md, run BF: H100, steps.py's decode steps over 8
# segments of 4096, three runs each way interleaved on one host): 64 rows 7.334 -> 7.202 ms (-1.8%); 256 rows (64-row
# blocks) 11.145 -> 11.127 with 8 warps too, inside the spread, so they keep 4.  (In the mixed steps 8 warps on
# 64-row blocks took the shared kernel 50-60% longer: they stay at 4.)
DECODE_SHARED_SMALL_BLOCK_ROWS = 32
DECODE_SHARED_SMALL_BLOCK_WARPS = 8
# The ragged kernel's stages in a mixed step with cascade groups and one-token rows (16-bit pages) of at most
# MIXED_RAGGED_CASCADE_MAX_TOKENS tokens. Its decode rows there read only their private keys (~100): one or two
# tiles, so a pipeline buys little, and its chunks are short (a bucket of 512 tokens). Measured (bench/NOTES.md,
# run BB: H100, the kernel's GPU time a layer): 1 stage against 2 took the C = 256 (512 tokens) and C = 64 (128)
# steps -14% / -15%, the C = 256 loop +1.8% tok/s (one run each way). Where a block walks many tiles, 1 stage took
# more time: +8% on a lone question over 4k, +19% on a 2048-token chunk. So bigger buckets (the 2048-token cohort
# step measured -9%, but a long question may share its bucket), steps without groups and the chunks-only launch of
# INFERSCALE_MIXED_DECODE=cascade keep the kernel's stages. INFERSCALE_MIXED_RAGGED=st=N overrides it.
MIXED_RAGGED_CASCADE_STAGES = 1
MIXED_RAGGED_CASCADE_MAX_TOKENS = 512
# The decode steps' cascade shared part's split count by the step's row bucket (for MIXED_SPLIT_KV_HEADS kv heads,
# as MIXED_SPLIT_BUCKETS); below the smallest, the kernel's automatic count (it chose 3 at both 64 and 256 rows
# on the measured workload).
# Measured (run AX, 3 stages): 256 rows 180.4 us with the automatic 3, 166.0 with 2; 64 rows 110.5 / 115.1 (keeps 3).
DECODE_SPLIT_BUCKETS = ((256, 2),)
assert list(DECODE_SPLIT_BUCKETS) == sorted(DECODE_SPLIT_BUCKETS, reverse=True)


def shared_stages(stages: int | None, block_kv: int, head_dim: int, k_pages) -> int | None:
    """``stages`` for a cascade shared part whose K tile (``block_kv`` tokens x ``head_dim`` of ``k_pages``'
    dtype) is at most ``MIXED_STAGES_MAX_TILE_BYTES``; else None (the kernel's own default)."""
    return stages if block_kv * head_dim * k_pages.dtype.itemsize <= MIXED_STAGES_MAX_TILE_BYTES else None


def mixed_shared_splits(tokens: int, kv_heads: int) -> int | None:
    """The shared part's split count in a mixed step of ``tokens`` (bucketed) tokens over ``kv_heads`` kv heads
    on this device (``MIXED_SPLIT_BUCKETS``); None: the kernel's automatic count."""
    return _splits_by(MIXED_SPLIT_BUCKETS, tokens, kv_heads)


def decode_shared_splits(rows: int, kv_heads: int) -> int | None:
    """The shared part's split count in a decode step of ``rows`` (bucketed) rows (``DECODE_SPLIT_BUCKETS``, as
    ``mixed_shared_splits``); None: the kernel's automatic count."""
    return _splits_by(DECODE_SPLIT_BUCKETS, rows, kv_heads)


def _decode_shared_knobs(rows: int, head_dim: int, k_pages, q_heads: int, groups: int, dtype) -> dict:
    """The decode steps' cascade shared-part knobs for ``rows`` (bucketed) rows of ``q_heads`` query heads over a
    group table of ``groups``: ``DECODE_SHARED_STAGES`` under the tile gate, ``DECODE_SPLIT_BUCKETS``' split count,
    ``DECODE_SHARED_SMALL_BLOCK_WARPS`` warps where the kernel's row blocks are at most
    ``DECODE_SHARED_SMALL_BLOCK_ROWS``; ``INFERSCALE_DECODE_SHARED`` overrides any of them (``bk=N`` gates the stages
    by its tile, as ``INFERSCALE_MIXED_SHARED`` does in the mixed steps)."""
    user = common.decode_shared_knobs()
    knobs = dict(num_stages=shared_stages(DECODE_SHARED_STAGES, user.get("block_kv", SHARED_BLOCK_KV), head_dim,
                                          k_pages),
                 num_splits=decode_shared_splits(rows, k_pages.shape[0]))
    block_rows = user.get("block_rows") or default_block_rows(rows, q_heads // k_pages.shape[0], groups, dtype)
    if block_rows <= DECODE_SHARED_SMALL_BLOCK_ROWS:  # (one group: blocks of the cap, 128 rows)
        knobs["num_warps"] = DECODE_SHARED_SMALL_BLOCK_WARPS
    return {**knobs, **user}


def _splits_by(buckets, size: int, kv_heads: int) -> int | None:
    base = next((sp for at_least, sp in buckets if size >= at_least), None)
    return None if base is None else base * max(1, MIXED_SPLIT_KV_HEADS // max(1, kv_heads))


def _mixed(q, kp, vp, meta: AttnMeta, pallas: bool, sc: dict):
    """A mixed step's attention ``[N, Hq, D]``: the ragged kernel over every row, and when the
    step has cascade groups, the shared prefix of each group row's tokens (a decode row's one token,
    a chunk's every token: ``row_group >= 0``) through the grouped kernel's shared part first, the
    ragged kernel then continuing those tokens from its partials (their suffix pages only; with
    ``INFERSCALE_MIXED_MERGE=jnp`` the two merged by log-sum-exps after it, ``_mixed_shared``).  So a
    group row's suffix is read once, by the ragged kernel, and a chunk
    over a shared segment reads the segment in the shared kernel's split programs rather than in
    one long ragged program per query block."""
    ragged = ragged_paged_attention if pallas else ragged_paged_attention_ref
    if meta.group_pages is None or 0 in meta.group_pages.shape:
        return ragged(q, kp, vp, meta.page_table, meta.cu_q_lens, meta.kv_lens, **_ragged_knobs(pallas), **sc)
    if common.mixed_decode() == "cascade":
        return _mixed_split(q, kp, vp, meta, pallas, sc)
    return _mixed_shared(q, kp, vp, meta, pallas, sc)


def _ragged_knobs(pallas: bool, kp=None, tokens: int = 0) -> dict:
    """The mixed steps' ragged-kernel knobs: ``INFERSCALE_MIXED_RAGGED``'s over the defaults.  A cascade step with
    one-token rows (``kp``: its pages, 16-bit) of at most ``MIXED_RAGGED_CASCADE_MAX_TOKENS`` tokens runs
    ``MIXED_RAGGED_CASCADE_STAGES`` stages; other steps, the kernel's defaults."""
    if not pallas:
        return {}
    one = kp is not None and kp.dtype.itemsize == 2 and tokens <= MIXED_RAGGED_CASCADE_MAX_TOKENS
    return {**(dict(num_stages=MIXED_RAGGED_CASCADE_STAGES) if one else {}), **common.mixed_ragged_knobs()}


def _mixed_shared(q, kp, vp, meta: AttnMeta, pallas: bool, sc: dict, one_token_rows: bool = True):
    """``_mixed`` with cascade groups: the ragged kernel over every row, each group row's tokens'
    shared prefix through the grouped kernel's shared part.  With one shared launch on the GPU (the
    default) the ragged kernel starts each group token from the shared part's split partials
    (``init``): its output is final.  Otherwise (``INFERSCALE_MIXED_MERGE=jnp``, the references, or
    ``INFERSCALE_MIXED_SHARED``'s ``cb``) the two merge by log-sum-exps in jnp.  The shared part is
    one launch, or with ``cb`` two: the one-token rows' tokens in one, the chunks' in the other with
    their own row blocks, warps and splits (``cb`` / ``cw`` / ``cs``); ``one_token_rows=False`` (the
    caller has none) makes it one launch with the chunks' knobs."""
    ragged = ragged_paged_attention if pallas else ragged_paged_attention_ref
    n, rows = q.shape[0], meta.row_group.shape[0]
    row = jnp.searchsorted(meta.cu_q_lens[1:], jnp.arange(n, dtype=jnp.int32), side="right")  # [N]; R: padding
    group = jnp.where(row < rows, meta.row_group[jnp.minimum(row, rows - 1)], -1)  # [N] each token's group
    shared = grouped_shared_prefix_attention if pallas else grouped_shared_prefix_attention_ref
    # the bucket pads the group table (up to 64 groups) and the tokens: the split count by the token bucket
    # (MIXED_SPLIT_BUCKETS), below it from the rows (most are one-token decode rows) and the real groups (with
    # cb, both launches the same unless cs sets the chunks')
    splits = mixed_shared_splits(n, kp.shape[0])
    user = common.mixed_shared_knobs()  # (INFERSCALE_MIXED_SHARED: st=N sets the stages, bk=N the tile)
    chunk_rows, chunk_warps = user.pop("chunk_block_rows", None), user.pop("chunk_num_warps", None)
    chunk_splits = user.pop("chunk_num_splits", None)
    stages = shared_stages(MIXED_SHARED_STAGES, user.get("block_kv", SHARED_BLOCK_KV), q.shape[-1], kp)
    knobs = {**dict(block_rows=MIXED_BLOCK_ROWS, real_groups=MIXED_REAL_GROUPS, real_rows=rows, num_splits=splits,
                    num_stages=stages), **user} if pallas else {}
    rk = _ragged_knobs(pallas, kp if one_token_rows else None, q.shape[0])  # (only chunks: the kernel's stages)
    chunk = {**knobs, "block_rows": chunk_rows, "num_warps": chunk_warps or knobs.get("num_warps"),
             "num_splits": chunk_splits or knobs["num_splits"]} if pallas and chunk_rows else None  # (cb=N)
    if pallas and not (chunk and one_token_rows) and common.mixed_merge() == "kernel":  # one shared launch
        init = grouped_shared_prefix_partials(q, kp, vp, meta.group_pages, meta.group_lens, group,
                                              **(chunk or knobs), **sc)
        return ragged(q, kp, vp, meta.page_table, meta.cu_q_lens, meta.kv_lens, init=init, **rk, **sc)
    out, lse = ragged(q, kp, vp, meta.page_table, meta.cu_q_lens, meta.kv_lens, return_lse=True, **rk, **sc)
    if chunk and one_token_rows:  # the chunks' tokens in a launch of their own, the one-token rows' in the other
        q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]  # [R]
        one = q_lens[jnp.minimum(row, rows - 1)] == 1  # [N] a one-token row's token (padding: group -1)
        o_a, lse_a = shared(q, kp, vp, meta.group_pages, meta.group_lens, jnp.where(one, group, -1), **knobs, **sc)
        o_b, lse_b = shared(q, kp, vp, meta.group_pages, meta.group_lens, jnp.where(one, -1, group), **chunk, **sc)
        o_sh, lse_sh = jnp.where(one[:, None, None], o_a, o_b), jnp.where(one[:, None], lse_a, lse_b)
    else:  # one launch (only chunks here with cb: theirs)
        o_sh, lse_sh = shared(q, kp, vp, meta.group_pages, meta.group_lens, group, **(chunk or knobs), **sc)
    merged, _ = merge_lse(o_sh, lse_sh, out, lse)
    return jnp.where((group >= 0)[:, None, None], merged.astype(out.dtype), out)


def _mixed_split(q, kp, vp, meta: AttnMeta, pallas: bool, sc: dict):
    """``_mixed`` with cascade groups, its one-token rows apart (``INFERSCALE_MIXED_DECODE=cascade``).

    A row of one token (a decode row, or a chunk's last single token) is what a decode step
    attends: its token runs through the decode step's cascade kernel (each group's shared pages
    read once per row block, the row's suffix in the fused decode kernel) over ``[R]`` rows, the
    other rows masked out (group -1, no suffix).  The rows of two or more tokens keep ``_mixed``'s
    path over a compacted token batch: their tokens gathered to the front (the one-token rows left
    empty, ``q_len`` 0, so the ragged kernel gives them no blocks and the shared part no rows).
    Each token's output is then taken from the side that computed it; padding tokens stay zeros."""
    n, rows = q.shape[0], meta.row_group.shape[0]
    i32 = jnp.int32
    cu = meta.cu_q_lens
    q_len = cu[1:] - cu[:-1]  # [R]
    single = q_len == 1
    decode = grouped_cascade_decode_attention if pallas else grouped_cascade_decode_attention_ref
    knobs = dict(real_groups=MIXED_REAL_GROUPS, **_decode_shared_knobs(rows, q.shape[-1], kp, q.shape[1],
                                                                        meta.group_pages.shape[0], q.dtype)) if pallas else {}
    o_dec = decode(q[jnp.clip(cu[1:] - 1, 0, n - 1)], kp, vp, meta.group_pages, meta.group_lens,
                   jnp.where(single, meta.row_group, -1).astype(i32), meta.page_table,
                   jnp.where(single, meta.kv_lens, 0).astype(i32), **knobs, **sc)  # [R, Hq, D]
    cu_c = jnp.concatenate([jnp.zeros((1,), i32), jnp.cumsum(jnp.where(single, 0, q_len), dtype=i32)])
    tok = jnp.arange(n, dtype=i32)
    row_c = jnp.minimum(jnp.searchsorted(cu_c[1:], tok, side="right"), rows - 1)  # [N] compacted -> row
    q_c = q[jnp.where(tok < cu_c[rows], cu[row_c] + tok - cu_c[row_c], 0)]
    out_c = _mixed_shared(q_c, kp, vp, dataclasses.replace(meta, cu_q_lens=cu_c), pallas, sc, one_token_rows=False)
    row = jnp.searchsorted(cu[1:], tok, side="right")  # [N] each token's row; R: padding
    rc = jnp.minimum(row, rows - 1)
    real = (row < rows)[:, None, None]
    from_c = out_c[jnp.clip(cu_c[rc] + tok - cu[rc], 0, n - 1)]
    return jnp.where(real & single[rc][:, None, None], o_dec[rc],
                     jnp.where(real, from_c, jnp.zeros_like(from_c)))


def _as_ragged(meta: AttnMeta, page_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(page_table, cu_q_lens, kv_lens) of the ragged kernel for any non-blend step: a mixed step's
    own; a decode step's rows are rows of one token; a group row's page list is its group's shared
    pages (``group_lens``, full pages: the engine's guarantee) followed by its own suffix pages."""
    table, kv_lens = meta.page_table, meta.kv_lens
    rows, width = table.shape
    cu = meta.cu_q_lens if meta.ragged else jnp.arange(rows + 1, dtype=jnp.int32)
    if meta.group_pages is None or 0 in meta.group_pages.shape:
        return table, cu, kv_lens
    num_groups, num_shared = meta.group_pages.shape
    rg = meta.row_group
    in_group = (rg >= 0) & (rg < num_groups)  # [R]
    rg = jnp.clip(rg, 0, num_groups - 1)
    n_sh = jnp.where(in_group, meta.group_lens[rg] // page_size, 0)[:, None]  # [R, 1] shared pages of each row
    col = jnp.arange(num_shared + width, dtype=jnp.int32)[None, :]  # [1, Ps + W]
    own = jnp.take_along_axis(table, jnp.clip(col - n_sh, 0, width - 1), axis=1)  # [R, Ps + W]
    shared = jnp.take_along_axis(meta.group_pages[rg], jnp.clip(col, 0, num_shared - 1), axis=1)  # [R, Ps + W]
    full = jnp.where(col < n_sh, shared, jnp.where(col - n_sh < width, own, 0))
    return full.astype(jnp.int32), cu, kv_lens + n_sh[:, 0] * page_size


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
    """Bytes one page takes across all layers, K and V; a compressed KV dtype's rows hold D bytes and
    their scale (``pallas_kernels/quant.py``)."""
    row = cfg.head_dim + SCALE_BYTES if is_quantized(dtype) else cfg.head_dim * jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * row


@functools.partial(jax.jit, static_argnames=("rep",))
def gather_pages(cache: PagedKVCache, pages: jax.Array, rep: int = 1) -> jax.Array:
    """pages [n] int32 -> [L, 2, Hkv, n, S, D]: every layer's K and V of those pages.  ``rep`` > 1:
    the pool repeats each real kv head ``rep`` times (tensor parallelism, sharding.py): one copy.
    Quantized pages: [L, 2, Hkv, n, S, D + 4] uint8, each row's scale appended (quant.pack_block)."""
    if cache.quantized:
        return jnp.stack([jnp.stack([pack_block(k[::rep, pages], ks[::rep, pages]),
                                     pack_block(v[::rep, pages], vs[::rep, pages])])
                          for k, v, ks, vs in zip(cache.k, cache.v, cache.k_scale, cache.v_scale)])
    return jnp.stack([jnp.stack([k[::rep, pages], v[::rep, pages]]) for k, v in zip(cache.k, cache.v)])


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("rep",))
def scatter_pages(cache: PagedKVCache, kv: jax.Array, pages: jax.Array, rep: int = 1) -> PagedKVCache:
    """Write kv [L, 2, Hkv, n, S, D] into pages [n] int32 (each kv head ``rep`` times); ids outside the
    pool are dropped."""
    grow = (lambda x: jnp.repeat(x, rep, axis=0)) if rep > 1 else (lambda x: x)  # noqa: E731
    if cache.quantized:
        out: list[list] = [[], [], [], []]
        for i, (k, v, ks, vs) in enumerate(zip(cache.k, cache.v, cache.k_scale, cache.v_scale)):
            (kq, kss), (vq, vss) = unpack_block(kv[i, 0], k.dtype), unpack_block(kv[i, 1], v.dtype)
            for j, (arr, new) in enumerate(((k, kq), (v, vq), (ks, kss), (vs, vss))):
                out[j].append(arr.at[:, pages].set(grow(new), mode="drop"))
        return cache.with_pages(*out)
    ks = [k.at[:, pages].set(grow(kv[i, 0]), mode="drop") for i, k in enumerate(cache.k)]
    vs = [v.at[:, pages].set(grow(kv[i, 1]), mode="drop") for i, v in enumerate(cache.v)]
    return cache.with_pages(ks, vs)
