"""Paged prefill attention: a chunk of new queries per sequence over its paged KV cache.

Inputs (one layer; page layout as in :mod:`pallas_kernels.common`):

* ``q [B, T, Hq, D]``: a padded chunk of new query tokens per sequence.  Row ``i < q_lens[b]``
  of sequence ``b`` is real; rows ``q_lens[b] <= i < T`` are padding.  ``q_lens[b] == 0``
  (an empty batch slot) is allowed.
* ``k_pages, v_pages [Hkv, P, S, D]``, ``page_table [B, max_pages] int32``.
* ``kv_lens [B] int32 = cached + q_lens``: the engine writes the chunk's own K/V into the pages
  *before* attending, so all ``kv_lens[b]`` tokens of sequence ``b`` are in its pages.

Semantics.  Query ``i`` of sequence ``b`` sits at absolute position
``pos = kv_lens[b] - q_lens[b] + i`` and attends exactly the keys at positions ``<= pos``: all
cached tokens (e.g. injected shared pages) plus, causally, the chunk itself.  Sequences are
ragged: each has its own cached length and chunk length.  Padding rows of the output are
written as exact zeros (never left uninitialised, never NaN).  The softmax runs in fp32;
the output has ``q``'s dtype.

Padding scheme.  ``T`` is padded up to a multiple of ``block_q`` inside the wrapper (a copy
only when ``T % block_q != 0``; engines bucket ``T`` so this is normally free).  Key slots at
positions ``>= kv_lens[b]`` (the tail of the last page, padded page-table entries, the null
page) are never used unmasked: their scores are masked *and* their V rows are zeroed, so even
NaN garbage there cannot leak into the output (tests poison them with NaN).  Padding rows of
``q`` may hold anything too: rows never mix, and padding rows are zeroed at the end.
Page-table reads past ``max_pages`` are clamped, so a block overhanging the table stays in
bounds.

Algorithm (Triton-style Pallas, FlashAttention-2 online softmax).

1. GQA packing.  One program owns one kv head ``h`` and ``block_q`` query tokens of one
   sequence and processes all ``G = Hq // Hkv`` query heads of that kv head together: its
   tile has ``M = next_pow2(block_q * G)`` rows, row ``r`` = (token ``r // G``, head
   ``h * G + r % G``), gathered straight from ``q`` viewed as ``[B, T * Hq, D]``.  Each K/V
   tile loaded from the pages is therefore used by G query heads (a G-fold cut in K/V
   traffic versus one program per query head, and a full 128-row MMA tile even for short
   chunks: 32 tokens x 4 heads).  Rows past ``block_q * G`` (only when G is
   not a power of two) duplicate the last real row and store identical values.
2. Paged gather.  K/V are passed unblocked as ``[P * S, D]`` per kv head.  A KV block of
   ``block_kv`` positions reads its page ids from the page table (one read per position,
   cached) and gathers rows at slots ``page * S + pos % S``, so ``S`` and ``block_kv`` are
   independent: a block may span several pages or part of one.
3. Loop bounds.  With ``ctx = kv_len - q_len`` and block queries ``[q0, q0 + block_q)``:
   keys ``< ctx + q0`` are visible to every row, so blocks ``[0, (ctx + q0) // block_kv)``
   run unmasked; the remaining blocks up to ``cdiv(ctx + min(q0 + block_q, q_len),
   block_kv)`` (the last key the last real row sees) apply the causal/length mask.  Query
   blocks entirely past ``q_len`` run no iterations and write zeros.  Query blocks are
   launched last-first (longest loops first) for load balance.
4. Split-KV (flash-decoding style) for small chunks: when ``B * Hkv * cdiv(T, block_q)``
   programs cannot fill the GPU, each program's KV block range is split ``kv_splits`` ways;
   the kernel writes fp32 partial outputs plus a log2-sum-exp per row and a small jnp
   epilogue merges them.  ``kv_splits=None`` picks the count from the SM count.

``paged_prefill_attention_ref`` is the pure-jnp reference (dense gather of the pages, fp32
softmax); both functions call :func:`check_prefill_inputs`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

_MASK = -1e30  # masked raw score: finite even after * sm_scale, so never inf - inf
_LOG2E = math.log2(math.e)
_PREC = lax.Precision.HIGHEST  # fp32: IEEE matmul on Triton (DEFAULT = TF32); no-op for bf16
_DEFAULT_ROWS = 128  # target rows (block_q * G) of one program's query tile
_MIN_SPLIT_BLOCKS = 8  # kv_splits=None: at least this many KV blocks per split


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_prefill_inputs(q, k_pages, v_pages, page_table, q_lens, kv_lens) -> tuple[int, ...]:
    """Validate the arguments of both prefill functions; return (B, T, Hq, Hkv, P, S, D).

    Length *values* are checked too when they are concrete (eager calls), skipped under jit.
    """
    if q.ndim != 4:
        common._fail("q.shape", q.shape, "[B, T, Hq, D] (4 dims)")
    batch, chunk, num_q_heads, head_dim = (int(x) for x in q.shape)
    num_kv_heads, num_pages, page_size, d_kv = common.check_pages(k_pages, v_pages)
    if d_kv != head_dim:
        common._fail("k_pages.shape[-1]", d_kv, f"q's head_dim {head_dim}")
    common.check_gqa(num_q_heads, num_kv_heads)
    max_pages = common.check_page_table(page_table, batch)
    common.check_int_vector("q_lens", q_lens, batch)
    common.check_int_vector("kv_lens", kv_lens, batch)
    if q.dtype != k_pages.dtype:
        common._fail("q.dtype", q.dtype, f"the dtype of k_pages ({k_pages.dtype}); cast one")
    try:
        ql, kl = np.asarray(q_lens), np.asarray(kv_lens)
    except jax.errors.TracerArrayConversionError:
        ql = kl = None  # traced: values unknown
    if ql is not None:
        capacity = max_pages * page_size
        if ((ql < 0) | (ql > chunk)).any():
            common._fail("q_lens", ql.tolist(), f"values in [0, T={chunk}]")
        if ((kl < ql) | (kl > capacity)).any():
            common._fail(
                "kv_lens", kl.tolist(),
                f"q_lens <= kv_lens <= max_pages * page_size = {capacity} "
                "(kv_lens counts cached + chunk tokens, all already written to the pages)")
    return batch, chunk, num_q_heads, num_kv_heads, num_pages, page_size, head_dim


def _choose_blocks(chunk, group, head_dim, itemsize, block_q, block_kv, num_warps, num_stages,
                   interpret):
    """Fill in defaults and check block sizes; returns (block_q, rows, block_kv, warps, stages).

    bf16 defaults come from the H200 sweep in bench/NOTES.md: chunks >= 1024 use 128-row tiles,
    block_kv 64, 4 warps, 2 stages (bench/NOTES.md, run 2); chunks 256..1023 use 64-row
    tiles with the same rest; chunks < 256 (split-KV path) keep 128 rows, 8 warps, 3 stages.
    fp32 (IEEE, no tensor cores: a correctness path) gets smaller tiles to limit spilling.
    """
    wide = itemsize >= 4
    big = chunk >= 1024  # H200 sweep (bench/NOTES.md): 128-row tiles for long chunks, 64 for mid
    small = chunk < 256  # short chunks take the split-KV path; 128 rows, 8 warps, 3 stages won
    if block_q is None:
        rows_wanted = 64 if wide else (_DEFAULT_ROWS if big or small else 64)
        block_q = max(1, rows_wanted // group)
        block_q = max(min(block_q, _next_pow2(chunk)), -(-16 // group))
    if block_q < 1:
        common._fail("block_q", block_q, "a positive number of query tokens per program")
    rows = _next_pow2(block_q * group)
    if rows < 16:
        common._fail("block_q", block_q,
                     f"block_q * (Hq // Hkv = {group}) >= 16 (Triton matmuls need M >= 16)")
    block_kv = (16 if wide else 64) if block_kv is None else block_kv
    if block_kv < 16 or block_kv != _next_pow2(block_kv):
        common._fail("block_kv", block_kv, "a power of two >= 16 (KV positions per step)")
    if not interpret and (head_dim < 16 or head_dim != _next_pow2(head_dim)):
        common._fail("head_dim", head_dim, "a power of two >= 16 for the Triton kernel")
    num_warps = ((8 if small and rows >= 128 else 4) if num_warps is None else num_warps)
    num_stages = ((3 if small and not wide else 2) if num_stages is None else num_stages)
    return block_q, rows, block_kv, num_warps, num_stages


def _default_kv_splits(programs: int, capacity: int, block_kv: int) -> int:
    """Enough KV splits to give every SM a program, each split >= _MIN_SPLIT_BLOCKS blocks."""
    num_sms = getattr(jax.devices()[0], "core_count", None) or 132
    if programs >= num_sms:
        return 1
    max_splits = max(1, capacity // (block_kv * _MIN_SPLIT_BLOCKS))
    return max(1, min(num_sms // programs, max_splits))


def _prefill_kernel(
    q_lens_ref,  # [B] int32
    kv_lens_ref,  # [B] int32
    page_table_ref,  # [max_pages] int32, this sequence's row
    q_ref,  # [Tp * Hq, D], this sequence's queries, row = token * Hq + head
    k_ref,  # [P * S, D], this kv head's page pool, row = slot
    v_ref,  # [P * S, D]
    o_ref,  # [Tp * Hq, D]: output (q dtype), or fp32 partial output when split
    *lse_refs,  # () or ([Tp * Hq] fp32 log2-sum-exp of this split)
    sm_scale: float, block_q: int, rows: int, block_kv: int, group: int,
    num_q_heads: int, page_size: int, num_q_blocks: int, num_splits: int,
):
    split = pl.program_id(0)
    q_block = num_q_blocks - 1 - pl.program_id(1)  # longest loops first
    head = pl.program_id(2)
    seq = pl.program_id(3)
    max_pages = page_table_ref.shape[0]
    q_len = q_lens_ref[seq]
    kv_len = kv_lens_ref[seq]
    ctx = kv_len - q_len  # tokens before the chunk
    q0 = q_block * block_q

    r = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), block_q * group - 1)  # [M]
    tok = q0 + lax.div(r, group)  # [M] query index within the chunk
    row_ids = tok * num_q_heads + head * group + lax.rem(r, group)  # [M] rows of q_ref / o_ref
    q = q_ref[row_ids, :]  # [M, D]
    q_pos = ctx + tok  # [M] absolute positions (padding rows: garbage, zeroed at the end)

    q_hi = jnp.minimum(q0 + block_q, q_len)  # one past this block's last real query
    n_total = jnp.where(q_hi > q0, lax.div(ctx + q_hi + block_kv - 1, block_kv), 0)
    n_full = jnp.minimum(lax.div(ctx + q0, block_kv), n_total)  # blocks visible to every row
    if num_splits == 1:
        lo, hi = 0, n_total
    else:
        per = lax.div(n_total + num_splits - 1, num_splits)
        lo = jnp.minimum(split * per, n_total)
        hi = jnp.minimum(lo + per, n_total)

    scale = sm_scale * _LOG2E  # scores in the log2 domain: exp(x) == exp2(x * log2(e))

    def body(j, carry, masked: bool):
        acc, m_prev, l_prev = carry  # [M, D] f32, [M] f32, [M] f32
        kpos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [block_kv]
        page_idx = lax.div(kpos, page_size)
        if masked:  # the last blocks may overhang kv_len and the page table
            page_idx = jnp.minimum(page_idx, max_pages - 1)
        slots = page_table_ref[page_idx] * page_size + lax.rem(kpos, page_size)  # [block_kv]
        if masked:
            slots = jnp.where(kpos < kv_len, slots, 0)
        k = k_ref[slots, :]  # [block_kv, D]
        v = v_ref[slots, :]  # [block_kv, D]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_PREC,
                            preferred_element_type=jnp.float32)  # [M, block_kv] raw scores
        if masked:
            s = jnp.where(kpos[None, :] <= q_pos[:, None], s, _MASK)
            v = jnp.where((kpos < kv_len)[:, None], v, jnp.zeros_like(v))  # 0 * NaN guard
        m_next = jnp.maximum(m_prev, s.max(axis=1) * scale)  # [M], scale > 0
        alpha = jnp.exp2(m_prev - m_next)  # [M]
        p = jnp.exp2(s * scale - m_next[:, None])  # [M, block_kv], one FMA per score
        l_next = l_prev * alpha + p.sum(axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_PREC,
                             preferred_element_type=jnp.float32)  # [M, D]
        return acc * alpha[:, None] + pv, m_next, l_next

    head_dim = q.shape[-1]
    carry = (jnp.zeros((rows, head_dim), jnp.float32),
             jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    mid = jnp.clip(n_full, lo, hi)
    carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)

    valid = (tok < q_len) & (l > 0)  # [M]; l == 0: no keys in this block / split
    out = acc / jnp.where(valid, l, 1.0)[:, None]
    out = jnp.where(valid[:, None], out, 0.0)  # padding rows: exact zeros
    o_ref[row_ids, :] = out.astype(o_ref.dtype)
    if lse_refs:
        lse_refs[0][row_ids] = jnp.where(valid, m + jnp.log2(jnp.where(valid, l, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_q", "rows", "block_kv", "num_warps", "num_stages", "kv_splits",
    "interpret"))
def _prefill(q, k_pages, v_pages, page_table, q_lens, kv_lens, *, sm_scale, block_q, rows,
             block_kv, num_warps, num_stages, kv_splits, interpret):
    batch, chunk, num_q_heads, head_dim = q.shape  # q: [B, T, Hq, D]
    num_kv_heads, num_pages, page_size, _ = k_pages.shape  # [Hkv, P, S, D]
    max_pages = page_table.shape[1]  # page_table: [B, max_pages]
    group = num_q_heads // num_kv_heads
    num_q_blocks = pl.cdiv(chunk, block_q)
    padded = num_q_blocks * block_q
    if padded != chunk:
        q = jnp.pad(q, ((0, 0), (0, padded - chunk), (0, 0), (0, 0)))
    q_rows = q.reshape(batch, padded * num_q_heads, head_dim)  # [B, Tp * Hq, D], free
    k_slots = k_pages.reshape(num_kv_heads, num_pages * page_size, head_dim)  # [Hkv, P*S, D]
    v_slots = v_pages.reshape(num_kv_heads, num_pages * page_size, head_dim)

    split = kv_splits > 1
    grid = (kv_splits, num_q_blocks, num_kv_heads, batch)  # dim 0 varies fastest on launch
    n_rows = padded * num_q_heads
    whole = lambda n: pl.BlockSpec((n,), lambda s, i, h, b: (0,))
    per_seq = pl.BlockSpec((None, n_rows, head_dim), lambda s, i, h, b: (b, 0, 0))
    per_head = pl.BlockSpec((None, num_pages * page_size, head_dim), lambda s, i, h, b: (h, 0, 0))
    if split:
        out_shape = [jax.ShapeDtypeStruct((kv_splits, batch, n_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((kv_splits, batch, n_rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, n_rows, head_dim), lambda s, i, h, b: (s, b, 0, 0)),
                     pl.BlockSpec((None, None, n_rows), lambda s, i, h, b: (s, b, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((batch, n_rows, head_dim), q.dtype)]
        out_specs = [per_seq]
    kernel = functools.partial(
        _prefill_kernel, sm_scale=sm_scale, block_q=block_q, rows=rows, block_kv=block_kv,
        group=group, num_q_heads=num_q_heads, page_size=page_size,
        num_q_blocks=num_q_blocks, num_splits=kv_splits)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(batch), whole(batch),
                  pl.BlockSpec((None, max_pages), lambda s, i, h, b: (b, 0)),
                  per_seq, per_head, per_head],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"paged_prefill_attention_bq{block_q}_bkv{block_kv}_g{group}_s{kv_splits}",
    )(q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
      q_rows, k_slots, v_slots)
    if split:  # [splits, B, Tp*Hq, D], [splits, B, Tp*Hq] -> merged
        out = common.merge_splits(*outs, q.dtype)
    else:
        (out,) = outs
    return out.reshape(batch, padded, num_q_heads, head_dim)[:, :chunk]


def paged_prefill_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [B, max_pages] int32
    q_lens: jax.Array,  # [B] int32, real queries per sequence (0..T)
    kv_lens: jax.Array,  # [B] int32, cached + q_lens tokens, all already in the pages
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [B, T, Hq, D], q.dtype; padding rows are zeros
    """Causal attention of a chunk of new queries over paged K/V (see the module docstring).

    Tuning knobs: ``block_q`` query *tokens* per program (the tile has ``block_q * Hq/Hkv``
    rows; default: 128 rows), ``block_kv`` KV positions per loop step (default 64),
    ``num_warps`` (8 for 128-row tiles, else 4), ``num_stages`` (3); fp32 defaults are
    smaller (64 rows, block_kv 16, 2 stages).  ``kv_splits`` (None:
    split the KV range only when the grid cannot fill the GPU; 1 disables splitting; 1 in
    interpret mode).  Eager calls also check the length values (one host sync); under jit
    only shapes are checked.
    """
    batch, chunk, num_q_heads, num_kv_heads, _, page_size, head_dim = check_prefill_inputs(
        q, k_pages, v_pages, page_table, q_lens, kv_lens)
    interpret = common.default_interpret() if interpret is None else interpret
    group = num_q_heads // num_kv_heads
    block_q, rows, block_kv, num_warps, num_stages = _choose_blocks(
        chunk, group, head_dim, q.dtype.itemsize, block_q, block_kv, num_warps, num_stages,
        interpret)
    if kv_splits is None and interpret:
        kv_splits = 1  # splitting only pays for itself on a GPU
    elif kv_splits is None:
        programs = batch * num_kv_heads * pl.cdiv(chunk, block_q)
        kv_splits = _default_kv_splits(programs, page_table.shape[1] * page_size, block_kv)
    if kv_splits < 1:
        common._fail("kv_splits", kv_splits, ">= 1 (1 = no split-KV)")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return _prefill(q, k_pages, v_pages, page_table, q_lens, kv_lens, sm_scale=sm_scale,
                    block_q=block_q, rows=rows, block_kv=block_kv, num_warps=num_warps,
                    num_stages=num_stages, kv_splits=int(kv_splits), interpret=interpret)


def paged_prefill_attention_ref(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [B, max_pages] int32
    q_lens: jax.Array,  # [B] int32
    kv_lens: jax.Array,  # [B] int32
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [B, T, Hq, D]
    """Pure-jnp reference: gather each sequence's pages densely, fp32 masked softmax.

    The tuning arguments are accepted (so both functions share one signature) and ignored.
    """
    del block_q, block_kv, num_warps, num_stages, kv_splits, interpret
    batch, chunk, num_q_heads, num_kv_heads, _, page_size, head_dim = check_prefill_inputs(
        q, k_pages, v_pages, page_table, q_lens, kv_lens)
    group = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    hi = lax.Precision.HIGHEST
    capacity = page_table.shape[1] * page_size
    kpos = jnp.arange(capacity)  # [L]
    key_ok = kpos[None, :] < kv_lens[:, None]  # [B, L]
    # [Hkv, B, max_pages, S, D] -> [B, Hkv, L, D]; invalid slots zeroed (they may hold NaN)
    def gather(pages):
        x = pages[:, page_table].reshape(num_kv_heads, batch, capacity, head_dim)
        x = jnp.swapaxes(x, 0, 1).astype(jnp.float32)
        return jnp.where(key_ok[:, None, :, None], x, 0.0)
    k, v = gather(k_pages), gather(v_pages)
    qf = q.astype(jnp.float32).reshape(batch, chunk, num_kv_heads, group, head_dim)
    s = jnp.einsum("bthgd,bhld->bhgtl", qf, k, precision=hi) * sm_scale  # [B, Hkv, G, T, L]
    tpos = (kv_lens - q_lens)[:, None] + jnp.arange(chunk)[None, :]  # [B, T]
    q_ok = jnp.arange(chunk)[None, :] < q_lens[:, None]  # [B, T]
    mask = (kpos[None, None, :] <= tpos[:, :, None]) & key_ok[:, None, :]  # [B, T, L]
    mask = mask & q_ok[:, :, None]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True, initial=-1e30))
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)  # padding rows: all zero
    o = jnp.einsum("bhgtl,bhld->bthgd", p, v, precision=hi)  # [B, T, Hkv, G, D]
    return o.reshape(batch, chunk, num_q_heads, head_dim).astype(q.dtype)
