"""Ragged paged attention on a TPU (Mosaic): one kernel for a flat batch of decode rows and prefill chunks.

Same contract as :func:`pallas_kernels.ragged_attention.ragged_paged_attention` (and the same
reference, :func:`~pallas_kernels.ragged_attention.ragged_paged_attention_ref`, and validator):
``q [N, Hq, D]`` flat tokens, row ``r`` owning tokens ``[cu_q_lens[r], cu_q_lens[r + 1])``, each
query attending to its row's cached keys and causally to its own chunk; pages ``[Hkv, P, S, D]``;
padding tokens give zeros; key slots past ``kv_lens[r]`` may hold anything, NaN included.

Work list (wrapper, jnp ops of static size).  Every row is cut into query blocks of ``block_q``
tokens; at most ``min(R, N) + N // block_q`` blocks exist (the static grid size), blocks past the
real count are empty.  Each block is five int32 words (first token, token count, position of its
first query, the row's kv_len, the row's page-table offset).  The work list and the page table go
to the kernel as **scalar prefetch** (SMEM), so the index maps and the kernel read them before any
vector work.  The wrapper gathers each block's queries into a tile ``[M, D]`` per kv head, the
``G = Hq // Hkv`` query heads of the kv head packed into the rows (row ``i`` = token ``i // G``,
head ``h * G + i % G``; ``M = block_q * G`` rounded up to the sublane tile, the extra rows
repeating the last query), and scatters the output tiles back to ``[N, Hq, D]`` the same way;
the tiles travel through Pallas' own pipeline (BlockSpecs), auto double-buffered.

Kernel, grid ``(Hkv, blocks)``.  A program owns one query block of one kv head.  The pages stay in
HBM (``memory_space=ANY``); the program streams its row's pages into VMEM itself, ``pages_per_block``
pages per KV block (``T = pages_per_block * S`` keys), each page one DMA of its ``[S, D]`` tile into
its place in a ``[2, T, D]`` buffer: **double-buffered**, block ``j + 1``'s copies start before block
``j``'s are waited on, so the DMA of the next block overlaps the matmuls of this one.  Page-table
entries past the row's pages fetch the null page 0 (masked).  Online softmax (FlashAttention-2) in
fp32: scores ``q k^T`` on the MXU, masked to ``kpos <= qpos`` and ``kpos < kv_len`` (V rows past
kv_len are zeroed too: 0 * NaN guard), running max / sum carried through the KV loop; a block only
loops over the KV blocks up to its last query's position (causal end).

Block sizes: decode-shaped steps (every row about one token) use ``block_q = max(1, sublanes // G)``
(a tile of one sublane group: 8 rows fp32, 16 bf16); others ``max(1, 128 // G)`` (about 128 rows,
one MXU pass).  ``pages_per_block`` defaults to 256 keys' worth (at most the table width).

Not done here (tpu-inference does them): prefetching the next program's first KV block across
grid steps (a decode row has one or two KV blocks, so its first DMA is exposed), packing several
decode rows into one query tile, and splitting KV across cores for long single chunks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.ragged_attention import check_ragged_inputs, ragged_paged_attention_ref
from pallas_kernels.tpu import common as tpu_common

__all__ = ["ragged_paged_attention_tpu", "ragged_paged_attention_ref", "choose_blocks"]

_META = 5  # int32 words per query block: tok0, count, pos0, kv_len, page-table offset
_MASK = -1e30  # a masked score: finite, so a row's running max is never -inf - -inf
_KV_BLOCK_KEYS = 256  # pages_per_block=None: about this many keys per KV block


def choose_blocks(num_tokens: int, num_rows: int, group: int, page_size: int, max_pages: int, dtype,
                  block_q: int | None = None, pages_per_block: int | None = None) -> tuple[int, int, int]:
    """(block_q, tile rows M, pages_per_block) for a step (see the module docstring)."""
    sub = tpu_common.sublanes(dtype)
    if block_q is None:
        small = max(1, sub // group)
        block_q = small if num_tokens <= num_rows * small else max(1, 128 // group)
    if pages_per_block is None:
        pages_per_block = max(1, min(max_pages, _KV_BLOCK_KEYS // page_size))
    if block_q < 1:
        common._fail("block_q", block_q, ">= 1 (query tokens per block)")
    if not 1 <= pages_per_block <= max(1, max_pages):
        common._fail("pages_per_block", pages_per_block, f"in [1, {max_pages}] (the page-table width)")
    return block_q, tpu_common.round_up(block_q * group, sub), pages_per_block


def _work_list(cu_q_lens, kv_lens, *, num_tokens, num_blocks, block_q, max_pages, page_size):
    """(meta [blocks * _META] int32, block of each token [N], its index in the block [N], real [N])."""
    rows = kv_lens.shape[0]
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)  # [R+1]
    q_len = jnp.maximum(cu[1:] - cu[:-1], 0)  # [R]
    kv = jnp.minimum(kv_lens.astype(jnp.int32), max_pages * page_size)
    nblk = (q_len + block_q - 1) // block_q
    end = jnp.cumsum(nblk)
    start = end - nblk
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.sum(end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)  # [NB]; R: an empty block
    rc = jnp.minimum(row, rows - 1)
    q0 = (b - start[rc]) * block_q
    cnt = jnp.where(row < rows, jnp.clip(q_len[rc] - q0, 0, block_q), 0)
    meta = jnp.stack([cu[rc] + q0, cnt, kv[rc] - q_len[rc] + q0, kv[rc], rc * max_pages], axis=1)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    trow = jnp.minimum(jnp.sum(cu[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), rows - 1)
    off = t - cu[trow]
    real = t < cu[rows]
    return meta.reshape(-1), jnp.where(real, start[trow] + off // block_q, 0), off % block_q, real


def _kernel(meta_ref, pt_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sem, *, block_q, group, page_size,
            pages_per_block, max_pages, sm_scale, precision):
    """meta_ref [NB * 5], pt_ref [R * max_pages] (SMEM); q_ref / o_ref [M, D] (VMEM, this block and kv
    head); k_hbm / v_hbm [Hkv, P, S, D] (HBM); k_buf / v_buf [2, T, D] VMEM; sem: 2 DMA semaphores."""
    h, blk = pl.program_id(0), pl.program_id(1)
    cnt, pos0, kv_len, pt_off = (meta_ref[blk * _META + i] for i in range(1, _META))
    keys = pages_per_block * page_size  # T
    n_kv = jnp.where(cnt > 0, jnp.minimum(pl.cdiv(pos0 + cnt, keys), pl.cdiv(kv_len, keys)), 0)
    n_pages = pl.cdiv(kv_len, page_size)

    def page_copies(j, slot, i):  # page i of KV block j -> its rows of buffer slot (K and V)
        idx = j * pages_per_block + i
        page = jnp.where(idx < n_pages, pt_ref[pt_off + jnp.minimum(idx, max_pages - 1)], 0)
        return [pltpu.make_async_copy(src.at[h, page], buf.at[slot, pl.ds(i * page_size, page_size)], sem.at[slot])
                for src, buf in ((k_hbm, k_buf), (v_hbm, v_buf))]

    def fetch(j, slot):  # start KV block j's page DMAs (a loop, not unrolled: one descriptor per page)
        def body(i, carry):
            for c in page_copies(j, slot, i):
                c.start()
            return carry
        lax.fori_loop(0, pages_per_block, body, 0)

    def wait(slot):  # every DMA of a block has one page's size: wait that many times
        def body(i, carry):
            for c in page_copies(0, slot, i):
                c.wait()
            return carry
        lax.fori_loop(0, pages_per_block, body, 0)

    @pl.when(n_kv > 0)
    def _():
        fetch(0, 0)

    rows, head_dim = q_ref.shape
    q = q_ref[...]
    r = jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), block_q * group - 1)
    q_pos = pos0 + jnp.minimum(r // group, cnt - 1)  # [M, 1] absolute positions
    kcol = lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    krow = lax.broadcasted_iota(jnp.int32, (keys, 1), 0)

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [M, D], [M, 1], [M, 1] fp32
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < n_kv)
        def _():
            fetch(j + 1, 1 - slot)

        wait(slot)
        k, v = k_buf[slot], v_buf[slot]  # [T, D]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale  # [M, T]
        kpos = j * keys + kcol
        s = jnp.where((kpos <= q_pos) & (kpos < kv_len), s, _MASK)
        v = jnp.where(j * keys + krow < kv_len, v, jnp.zeros_like(v))  # 0 * NaN guard
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)
        l_next = l_prev * alpha + p.sum(axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)  # [M, D]
        return acc * alpha + pv, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), -jnp.inf, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    acc, _, l = lax.fori_loop(0, n_kv, body, init)
    valid = l > 0  # no keys (an empty block): zeros
    o_ref[...] = jnp.where(valid, acc / jnp.where(valid, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "rows", "pages_per_block", "interpret"))
def _ragged_tpu(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, *, sm_scale, block_q, rows, pages_per_block,
                interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_rows, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    num_blocks = max(1, min(num_rows, num_tokens) + num_tokens // block_q)
    meta, tok_blk, tok_idx, real = _work_list(cu_q_lens, kv_lens, num_tokens=num_tokens, num_blocks=num_blocks,
                                              block_q=block_q, max_pages=max_pages, page_size=page_size)
    # query tiles [Hkv, NB, M, D]: tile row i = token tok0 + min(i // G, cnt - 1), head h * G + i % G
    meta2 = meta.reshape(num_blocks, _META)
    i = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), block_q * group - 1)
    tok = meta2[:, :1] + jnp.minimum(i[None, :] // group, jnp.maximum(meta2[:, 1:2] - 1, 0))  # [NB, M]
    q_tiles = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok, :, (i % group)[None, :]]  # [NB, M, Hkv, D]
    q_tiles = q_tiles.transpose(2, 0, 1, 3)
    tile = pl.BlockSpec((None, None, rows, head_dim), lambda h, b, *_: (h, b, 0, 0))
    keys = pages_per_block * page_size
    kernel = functools.partial(
        _kernel, block_q=block_q, group=group, page_size=page_size, pages_per_block=pages_per_block,
        max_pages=max_pages, sm_scale=sm_scale,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_kv_heads, num_blocks),
            in_specs=[tile, pl.BlockSpec(memory_space=tpu_common.ANY), pl.BlockSpec(memory_space=tpu_common.ANY)],
            out_specs=tile,
            scratch_shapes=[pltpu.VMEM((2, keys, head_dim), k_pages.dtype),
                            pltpu.VMEM((2, keys, head_dim), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=tpu_common.compiler_params(pltpu.PARALLEL, pltpu.PARALLEL),
        interpret=tpu_common.interpret_params(interpret),
        name=f"ragged_paged_attention_tpu_bq{block_q}_m{rows}_kv{keys}_g{group}",
    )(meta, page_table.astype(jnp.int32).reshape(-1), q_tiles, k_pages, v_pages)
    # back to [N, Hq, D]: token t's head h * G + g is row (index * G + g) of its block's tile
    rows_of = tok_idx[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]  # [N, G]
    o = out[:, tok_blk[:, None], rows_of]  # [Hkv, N, G, D]
    o = o.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(real[:, None, None], o, jnp.zeros_like(o))


def ragged_paged_attention_tpu(
    q: jax.Array,  # [N, Hq, D] flat new tokens
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [R, max_pages] int32
    cu_q_lens: jax.Array,  # [R + 1] int32, row r owns tokens [cu[r], cu[r+1])
    kv_lens: jax.Array,  # [R] int32, cached + new tokens, all already in the pages
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret=None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:  # [N, Hq, D], q.dtype; padding tokens: zeros
    """Causal attention of a flat batch of decode rows and prefill chunks on a TPU (see module doc).

    ``interpret``: None = Mosaic on a TPU, TPU interpret mode elsewhere; True / an
    ``pltpu.InterpretParams`` = interpret mode.  Compressed pages (``k_scale``) are not supported
    here: the engine runs them on the references.  Eager calls also check the length values."""
    num_tokens, num_rows, num_q_heads, num_kv_heads, _, page_size, head_dim = check_ragged_inputs(
        q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale)
    if k_scale is not None:
        common._fail("k_scale", "given", "None: compressed pages run ragged_paged_attention_ref on a TPU")
    tpu_common.check_tiling(head_dim, page_size, k_pages.dtype)
    block_q, rows, pages_per_block = choose_blocks(
        num_tokens, num_rows, num_q_heads // num_kv_heads, page_size, int(page_table.shape[1]), q.dtype,
        block_q, pages_per_block)
    if num_tokens == 0 or num_rows == 0:
        return jnp.zeros_like(q)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return _ragged_tpu(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, sm_scale=sm_scale, block_q=block_q,
                       rows=rows, pages_per_block=pages_per_block, interpret=tpu_common.interpret_params(interpret))
