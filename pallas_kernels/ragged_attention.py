"""Ragged paged attention: one flat token batch mixing decode rows and prefill chunks.

Inputs (one layer; page layout as in :mod:`pallas_kernels.common`):

* ``q [N, Hq, D]``: the flat new query tokens of one engine step.  Row (sequence) ``r`` owns
  tokens ``[cu_q_lens[r], cu_q_lens[r + 1])``; ``q_len[r] = cu_q_lens[r + 1] - cu_q_lens[r]``
  may be 0 (an empty padding row), 1 (a decode row) or many (a prefill chunk).  Tokens at
  index ``>= cu_q_lens[R]`` are padding.
* ``k_pages, v_pages [Hkv, P, S, D]``, ``page_table [R, max_pages] int32``.
* ``cu_q_lens [R + 1] int32``: nondecreasing, ``cu_q_lens[0] == 0``, ``cu_q_lens[R] <= N``.
* ``kv_lens [R] int32 = cached + q_len``: the new tokens' K/V are already in the pages.

Semantics.  Query ``i`` of row ``r`` sits at absolute position ``kv_lens[r] - q_len[r] + i``
and attends exactly the keys at positions ``<= `` its own: the cached tokens plus, causally,
its own chunk.  The softmax runs in fp32; the output has ``q``'s dtype.  Output rows of
padding tokens are exact zeros (unless ``init`` gives them partials, below).  Key slots at
positions ``>= kv_lens[r]`` (the tail of the
last page, padded table entries, the null page) may hold anything, NaN included: their scores
are masked *and* their V rows zeroed, as in :mod:`pallas_kernels.prefill_attention`.

Work list.  Shapes (``N``, ``R``, ``max_pages``) are static, lengths are traced.  The wrapper
cuts every row into query blocks of ``block_q`` tokens (``cdiv(q_len, block_q)`` blocks) with
jnp ops of static size, plus the padding tokens ``[cu_q_lens[R], N)`` as a pseudo-row without
keys (its blocks run no KV iterations and store zeros, so every output row is written).  At
most ``min(R, N) + N // block_q + 1`` blocks exist, the static grid size (with
``split_longest``, more: below); blocks past the actual count do nothing.  Each block is
described by five int32 words (first flat token, token count, position of its first query, the
row's kv_len, the row's page-table offset)
that the program reads before anything else.  Blocks are launched last-first: a chunk's later
blocks have the longest loops, and engines put chunks after the decode rows.

Kernel (Triton-style Pallas, FlashAttention-2 online softmax in base 2).  A program owns one
query block and one kv head ``h`` and, as in prefill, packs all ``G = Hq // Hkv`` query heads
of ``h`` into its tile rows (row ``i`` = token ``i // G``, head ``h * G + i % G``), gathered
straight from ``q`` viewed as ``[N * Hq, D]`` and stored back with the same row indices.
Tile rows past the block's last token repeat that token (clamped indices): they compute and
store identical values, so no load or store needs a mask and no row of another sequence is
touched.  Two tile shapes live in one kernel, picked per block with a ``lax.cond`` on the
block's token count:

* the *big* tile (``block_q * G`` rows, default 128 or 64, KV block ``block_kv``) for chunks;
  the same tile choices as :func:`paged_prefill_attention` (shared ``_choose_blocks``, with
  ``N`` in place of the chunk length);
* the *small* tile (``max(16, G)`` rows rounded to a power of two, ``max(1, 16 // G)``
  tokens; KV block ``2 * block_kv`` = 128 keys, the decode kernel's tile, with 2 pipeline
  stages, ``block_kv`` with 3 to stay within shared memory) for blocks of at most that many
  tokens: decode rows (and the short tail block of a chunk).  A decode row in a 128-row tile
  would do 8-32x the MMA work of its G real rows and turn a bandwidth-bound row
  compute-bound; 16 rows is what :func:`paged_decode_attention` uses.  Its loop prefetches
  the next block's page slots (the K/V gather of iteration ``j`` never waits on a page-table
  read).  When ``N`` is so small that the big tile is no bigger, only this one is compiled.

Only ``num_warps`` / ``num_stages`` are shared by the two tiles (one kernel); the defaults
follow the big tile's (prefill) choice.  So are the registers: the kernel gets its bigger branch's
budget.  ``separate_tiles=True`` runs the two tiles' blocks in two launches over the same grid (the
big tile's, then the small tile's writing into the same output in place), each kernel with one
tile's code; measured slower on the engine's mixed steps (bench/NOTES.md, run BD), so not the default.

Per block, with first query position ``p0`` and ``c`` tokens: keys ``< p0`` are visible to
every row, so KV blocks ``[0, p0 // block_kv)`` run unmasked and the rest up to
``cdiv(p0 + c, block_kv)`` apply the causal/length mask.  Page-table reads are clamped to
the row; slots past ``kv_len`` read the null page's slot 0 (masked).

Split-KV (flash-decoding style): when ``Hkv * cdiv(N, block_q)`` programs - the fewest the step's
real work can make, when it is one long chunk; the static grid bound counts blocks that are empty
then - cannot fill the GPU, each block's KV range (its own row's blocks, split at run time) is
split ``kv_splits`` ways; the kernel then writes fp32 partial outputs plus a log2-sum-exp per row and a jnp
epilogue merges them.  ``kv_splits=None`` picks about two programs per SM, at least
``_MIN_SPLIT_KEYS`` keys of capacity per split, bounded partial buffers; 1 in interpret mode.

That count is sized for one long chunk, but a step of many short rows pays for it too: every
block's programs run ``kv_splits`` times (the extra ones on empty ranges), every row is written as
fp32 partials and merged (run AT, bench/NOTES.md: a 64-row mixed step of ~100 private keys a row,
split 4 ways, was 0.49 ms slower than unsplit on an H100).  ``split_longest=True`` (the default since
run AU: as fast as unsplit on that step, 16% faster than every block split beside a 16k-key chunk,
within 4% on a lone question) splits only the blocks that need it: the ``cdiv(N, block_q) + 1``
blocks that see the most keys (as many as one chunk of all N tokens makes), each only if past
``long_keys`` (512); ``_split_plan`` builds the
work list (every block, a split one left without tokens there, then ``kv_splits`` programs for each
split block, launched first) and a route per program (split, slot).  A block run whole stores its
final rows; a split block stores its splits' partials in compact buffers (``slots x Hkv x rows of
the big tile`` per split: about the token rows of the whole step, so ``_MAX_PARTIAL_BYTES`` bounds
them too), and a second launch (``_merge_kernel``, grid (slot, kv head)) merges them into the first
launch's output in place.  A step with no long block then costs the unsplit kernel with
``slots x kv_splits x Hkv`` programs more that do nothing, a merge launch whose programs do nothing,
and the plan's few jnp ops (``lax.top_k`` over the blocks, a scatter, gathers).

Partials over other keys (``init``: the engine's mixed steps hand it the cascade shared part's split
partials, ``grouped_shared_prefix_partials``).  Split 0 of each block starts its rows' online softmax
from their partials instead of the empty state: its prologue gathers each tile row's ``NI`` partial rows
(token ``tok0 + t``'s first packed row, ``+ r % G``), merges them by their running maxima, and the loop
continues from there, so the stored output (and lse) already covers both key sets; a later split starts
empty and loads nothing, and the splits' merge (jnp, or ``_merge_kernel``) counts the partials once.

``ragged_paged_attention_ref`` is the pure-jnp reference (each token gathers its row's pages
densely, fp32 softmax); both call :func:`check_ragged_inputs`.
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
from pallas_kernels.cascade_attention import merge_lse, merge_partials
from pallas_kernels.prefill_attention import _LOG2E, _MASK, _PREC, _choose_blocks, _next_pow2
from pallas_kernels.quant import dequantize_rows, fold_probs, fold_scores, gather_pages, pv_dtype, scales_on_rows

_LN2 = math.log(2.0)  # return_lse: base-2 log-sum-exp * ln 2 = natural log
_MIN_SPLIT_KEYS = 256  # kv_splits=None: at least this much KV capacity per split
_SPLITS_PER_SM = 2  # kv_splits=None: aim for about this many programs per SM
_MAX_PARTIAL_BYTES = 8 << 20  # kv_splits=None: fp32 partials <= 8 MiB (their write + merge ~4 us)
_META = 5  # int32 words per query block: tok0, count, pos0, kv_len, page-table offset
_LONG_KEYS = 2 * _MIN_SPLIT_KEYS  # split_longest: a block that sees more keys than this is worth splitting
_REF_CHUNK_BYTES = 1 << 25  # the reference gathers K/V for this many bytes of tokens at once (32 MiB: the
# engine runs it on the CPU, where the allocator keeps its high-water mark as resident memory)


def check_ragged_inputs(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale=None,
                        v_scale=None) -> tuple[int, ...]:
    """Validate the arguments of both ragged functions; return (N, R, Hq, Hkv, P, S, D).

    Length *values* are checked too when they are concrete (eager calls), skipped under jit.
    """
    if q.ndim != 3:
        common._fail("q.shape", q.shape, "[N, Hq, D] (3 dims: flat tokens, heads, head_dim)")
    num_tokens, num_q_heads, head_dim = (int(x) for x in q.shape)
    num_kv_heads, num_pages, page_size, d_kv = common.check_pages(k_pages, v_pages)
    if d_kv != head_dim:
        common._fail("k_pages.shape[-1]", d_kv, f"q's head_dim {head_dim}")
    common.check_gqa(num_q_heads, num_kv_heads)
    if kv_lens.ndim != 1:
        common._fail("kv_lens.shape", kv_lens.shape, "[R] (one length per row)")
    rows = int(kv_lens.shape[0])
    max_pages = common.check_page_table(page_table, rows)
    common.check_int_vector("cu_q_lens", cu_q_lens, rows + 1)
    common.check_int_vector("kv_lens", kv_lens, rows)
    quantized = common.check_scales(k_pages, k_scale, v_scale)
    if q.dtype != k_pages.dtype and not quantized:
        common._fail("q.dtype", q.dtype, f"the dtype of k_pages ({k_pages.dtype}); cast one")
    common.query_dtype_ok(q, k_pages, quantized)
    if common.is_concrete(cu_q_lens, kv_lens):
        cu, kl = np.asarray(cu_q_lens, np.int64), np.asarray(kv_lens, np.int64)
        ql = np.diff(cu)
        if cu[0] != 0 or (ql < 0).any() or cu[-1] > num_tokens:
            common._fail("cu_q_lens", cu.tolist(),
                         f"nondecreasing offsets from 0 up to at most N={num_tokens}")
        capacity = max_pages * page_size
        if ((kl < ql) | (kl > capacity)).any():
            common._fail(
                "kv_lens", kl.tolist(),
                f"q_len <= kv_lens <= max_pages * page_size = {capacity} "
                "(kv_lens counts cached + new tokens, all already written to the pages)")
    return num_tokens, rows, num_q_heads, num_kv_heads, num_pages, page_size, head_dim


def _small_tile(group: int) -> tuple[int, int]:
    """(rows, tokens) of the small tile: >= 16 rows (Triton's smallest MMA), >= 1 token."""
    rows = max(common.MIN_DOT_DIM, _next_pow2(group))
    return rows, max(1, rows // group)


def _block_bound(num_tokens: int, num_rows: int, block_q: int) -> int:
    """Static upper bound of the query blocks (real rows + the padding pseudo-row)."""
    return min(num_rows, num_tokens) + num_tokens // block_q + 1


def _auto_kv_splits(programs: int, capacity: int, partial_bytes_per_split: int) -> int:
    """Splits for about _SPLITS_PER_SM programs per SM; 1 when the grid already fills it."""
    sms = common.num_sms()
    if programs >= sms:
        return 1
    splits = min(pl.cdiv(_SPLITS_PER_SM * sms, programs), capacity // _MIN_SPLIT_KEYS,
                 _MAX_PARTIAL_BYTES // max(1, partial_bytes_per_split))
    return max(1, splits)


def _default_kv_splits(num_tokens: int, num_kv_heads: int, block_q: int, capacity: int,
                       partial_bytes_per_token: int) -> int:
    """``kv_splits=None`` on a GPU, from the fewest programs the step's real work can make rather
    than the grid's static bound: the step may be one long chunk, ``cdiv(N, block_q)`` blocks per kv
    head.  (The engine's mixed buckets have as many rows as tokens up to ``max_batch``, so the static
    bound always looked full: a 64-token question over 16k cached tokens ran unsplit, 16 programs of
    16k keys each on a 132-SM GPU - bench/NOTES.md, issue 14.)  When the rows are in fact many
    decode rows, the extra splits cost the partial buffers' traffic, bounded by _MAX_PARTIAL_BYTES."""
    programs = num_kv_heads * pl.cdiv(num_tokens, block_q)
    return _auto_kv_splits(max(1, programs), capacity, num_tokens * partial_bytes_per_token)


def _block_meta(cu_q_lens, kv_lens, *, num_tokens, num_blocks, block_q, max_pages, capacity):
    """[num_blocks * _META] int32 work list (see the module docstring), jnp ops only."""
    rows = kv_lens.shape[0]
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)  # [R+1]
    # rows 0..R-1 plus the padding pseudo-row R: tokens [cu[R], N), no keys
    q_len = jnp.maximum(jnp.concatenate([cu[1:] - cu[:-1], num_tokens - cu[rows:]]), 0)
    kv = jnp.concatenate([jnp.minimum(kv_lens.astype(jnp.int32), capacity),
                          jnp.zeros((1,), jnp.int32)])  # [R+1]
    nblk = (q_len + block_q - 1) // block_q
    end = jnp.cumsum(nblk)
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.sum(end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)  # [NB], R+1: no work
    rc = jnp.minimum(row, rows)
    q0 = (b - (end - nblk)[rc]) * block_q
    cnt = jnp.where(row <= rows, jnp.clip(q_len[rc] - q0, 0, block_q), 0)
    pos0 = jnp.where(rc < rows, kv[rc] - q_len[rc] + q0, 0)
    meta = [cu[rc] + q0, cnt, pos0, kv[rc], jnp.minimum(rc, rows - 1) * max_pages]
    return jnp.stack(meta, axis=1).reshape(-1)


def _positive(x):
    """1 where int32 ``x > 0``, else 0, in integer arithmetic: Pallas' Triton lowering types a scalar
    ``jnp.where(bool, int, int)`` as i1, which then fails to meet the i32 it is added to (run AU,
    bench/NOTES.md); ``tests/kernels/test_engine_lowers_to_triton.py`` catches such forms on the CPU."""
    return jnp.minimum(jnp.maximum(x, 0), 1)


def _tile_rows(rows, last, tok0, cnt, head, group, num_q_heads):
    """A block's tile rows ``r`` ([rows], clamped to the tile's ``last`` row: extra rows repeat it), each
    row's token within the block ``t`` (clamped to its ``cnt`` tokens) and its query row in ``q`` viewed
    as ``[N * Hq, D]`` (token ``tok0 + t``, head ``head * group + r % group``)."""
    r = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), last)
    t = jnp.minimum(lax.div(r, group), cnt - 1)
    return r, t, (tok0 + t) * num_q_heads + head * group + lax.rem(r, group)


def _attend(meta, page_table_ref, q_ref, k_ref, v_ref, store, scale_refs, init_refs, tile, *, group,
            num_q_heads, page_size, max_pages, num_splits, sm_scale, v_rows, init_splits):
    """One program's attention with one static tile: (rows, block_q, block_kv, prefetch).  ``meta``:
    the block's five words, then this program's split, kv head and the block's split count (``<=
    num_splits``: ``num_splits`` itself, or in ``split_longest``'s kernel a traced 1 for a block run
    whole); ``store(r, row_ids, out, lse2)`` writes the normalised output rows and their
    log2-sum-exps (tile row ``r`` is query row ``row_ids``).  ``init_refs`` (``init_splits`` > 0): split
    0 starts each row's online softmax from its partials over other keys (``_initial_state``)."""
    rows, block_q, block_kv, prefetch = tile
    tok0, cnt, pos0, kv_len, pt_off, split, head, splits = meta
    r, t, row_ids = _tile_rows(rows, block_q * group - 1, tok0, cnt, head, group, num_q_heads)
    q = q_ref[row_ids, :]  # [M, D]
    q_pos = pos0 + t  # [M] absolute positions

    n_total = jnp.maximum(jnp.minimum(lax.div(pos0 + cnt + block_kv - 1, block_kv),
                                      lax.div(kv_len + block_kv - 1, block_kv)), 0)
    n_full = jnp.minimum(lax.div(jnp.maximum(pos0, 0), block_kv), n_total)  # mask-free blocks
    if num_splits == 1:
        lo, hi = 0, n_total
    else:
        per = lax.div(n_total + splits - 1, splits)
        lo = jnp.minimum(split * per, n_total)
        hi = jnp.minimum(lo + per, n_total)
    scale = sm_scale * _LOG2E  # log2 domain: exp(x) == exp2(x * log2(e))
    offs = jnp.arange(block_kv, dtype=jnp.int32)

    def slots_of(j, clamp):  # [block_kv] pool slots of KV block j (past kv_len: slot 0)
        kpos = j * block_kv + offs
        page_idx = lax.div(kpos, page_size)
        if clamp:  # the last blocks may overhang kv_len and the page table
            page_idx = jnp.minimum(page_idx, max_pages - 1)
        slots = page_table_ref[pt_off + page_idx] * page_size + lax.rem(kpos, page_size)
        return jnp.where(kpos < kv_len, slots, 0) if clamp else slots

    def body(j, carry, masked: bool):
        acc, m_prev, l_prev = carry[:3]  # [M, D], [M], [M] f32 (+ [block_kv] next slots)
        if prefetch:  # the next block's slots load alongside this block's K/V
            slots, nxt = carry[3], slots_of(j + 1, clamp=True)
        else:
            slots = slots_of(j, clamp=masked)
        k = k_ref[slots, :]  # [block_kv, D]
        v = v_ref[slots, :]
        if scale_refs:  # compressed pages: exact convert; the scales fold into scores and probs (quant.py)
            ks, vs = scale_refs[0][slots], scale_refs[1][slots]
            k = k.astype(q.dtype)
            # v_rows: V dequantized in registers (the tile reaches the PV dot as 16-bit rows);
            # else converted exactly, its scales folded into the probabilities below
            v = dequantize_rows(v, vs, q.dtype) if v_rows else v.astype(pv_dtype(q.dtype))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_PREC,
                            preferred_element_type=jnp.float32)  # [M, block_kv] raw scores
        if scale_refs:
            s = fold_scores(s, ks)
        in_kv = None
        if masked:
            kpos = j * block_kv + offs
            in_kv = kpos < kv_len
            s = jnp.where(kpos[None, :] <= q_pos[:, None], s, _MASK)
            v = jnp.where(in_kv[:, None], v, jnp.zeros_like(v))  # 0 * NaN guard
        m_next = jnp.maximum(m_prev, s.max(axis=1) * scale)  # [M], scale > 0
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s * scale - m_next[:, None])  # one FMA per score
        l_next = l_prev * alpha + p.sum(axis=1)
        w = fold_probs(p, vs, in_kv) if scale_refs and not v_rows else p
        pv = lax.dot_general(w.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_PREC,
                             preferred_element_type=jnp.float32)  # [M, D]
        return (acc * alpha[:, None] + pv, m_next, l_next) + ((nxt,) if prefetch else ())

    head_dim = q.shape[-1]
    mid = jnp.clip(n_full, lo, hi)
    if init_splits:  # split 0 continues the rows' attention over other keys (the cascade's shared part)
        start = _initial_state(init_refs, init_splits, tok0 + t, lax.rem(r, group), split)
    else:
        start = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                 jnp.zeros((rows,), jnp.float32))
    carry = start + ((slots_of(lo, clamp=True),) if prefetch else ())
    carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)[:3]

    valid = l > 0  # l == 0: no keys in this block / split (padding tokens, empty splits)
    out = jnp.where(valid[:, None], acc / jnp.where(valid, l, 1.0)[:, None], 0.0)
    store(r, row_ids, out, jnp.where(valid, m + jnp.log2(jnp.where(valid, l, 1.0)), -jnp.inf))


def _initial_state(init_refs, splits: int, tok, j, split):
    """Split 0's starting (acc, m, l) for the tile's rows: each row's ``splits`` partials over other keys
    (the cascade's shared part: unnormalised ``o``, base-2 ``m``, ``l``), merged as split partials are.
    ``init_row[tok]`` is the first packed row of the row's token (its heads follow: ``+ j``), ``< 0``
    for none; such rows, and every row of a later split (which loads nothing), take the usual empty start."""
    rows, head_dim = tok.shape[0], init_refs[1].shape[-1]
    empty = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    return lax.cond(split == 0, lambda: _merged_partials(init_refs, splits, tok, j, empty), lambda: empty)


def _merged_partials(init_refs, splits: int, tok, j, empty):
    row_ref, o_ref, m_ref, l_ref = init_refs  # partials flat: split u's rows at u * R
    per_split = m_ref.shape[0] // splits  # R
    base = row_ref[tok]  # [M]
    ok = base >= 0
    at = jnp.minimum(jnp.maximum(base, 0) + j, per_split - 1)  # (clamped: rows without partials read row 0..)
    ms = [m_ref[at + u * per_split] for u in range(splits)]
    m = functools.reduce(jnp.maximum, ms)
    acc, l = jnp.zeros_like(empty[0]), jnp.zeros_like(empty[2])
    for u in range(splits):
        w = jnp.exp2(ms[u] - m)  # 0 for a split with no key (its m is the shared part's finite floor, l 0)
        acc += w[:, None] * o_ref[at + u * per_split, :].astype(jnp.float32)
        l += w * l_ref[at + u * per_split]
    # (a row without partials may have read unwritten rows: selected away, never multiplied in)
    return (jnp.where(ok[:, None], acc, empty[0]), jnp.where(ok, m, empty[1]), jnp.where(ok, l, empty[2]))


def _kernel_refs(refs, quantized: bool, init_splits: int):
    """Split a kernel's trailing refs: (scale refs, init refs, the rest: its outputs)."""
    scale_refs, refs = (refs[:2], refs[2:]) if quantized else ((), refs)
    init_refs, refs = (refs[:4], refs[4:]) if init_splits else ((), refs)
    return scale_refs, init_refs, refs


def _ragged_kernel(meta_ref, page_table_ref, q_ref, k_ref, v_ref, *refs, quantized, num_blocks, tiles, only=None,
                   aliased=0, **kw):
    """meta_ref [NB * 5] int32; page_table_ref [R * max_pages]; q_ref / o_ref [N * Hq, D];
    k_ref / v_ref [P * S, D] (this kv head); refs: (ks_ref, vs_ref [P * S] fp32 when quantized),
    (init_row [N] int32, init_o [NI * R, D], init_m, init_l [NI * R] fp32 with ``init_splits``),
    ``aliased`` inputs (the outputs of the launch before, aliased to this one's: unread), o_ref, then () or
    (lse [N * Hq] fp32, log2-sum-exp) when split or asked for (``return_lse``).
    Grid (split, block, kv head): every block's KV range cut in ``num_splits`` runs.  ``only`` (0 or 1):
    this launch runs only the blocks of tile ``tiles[only]`` (``separate_tiles``)."""
    scale_refs, init_refs, refs = _kernel_refs(refs, quantized, kw["init_splits"])
    o_ref, *lse_refs = refs[aliased:]
    blk = num_blocks - 1 - pl.program_id(1)  # last blocks (longest loops) first
    # program ids are read here, outside the cond (interpret mode cannot read them inside)
    meta = tuple(meta_ref[blk * _META + i] for i in range(_META))
    meta += (pl.program_id(0), pl.program_id(2), kw["num_splits"])  # split, kv head, split count

    def store(r, row_ids, out, lse2):
        o_ref[row_ids, :] = out.astype(o_ref.dtype)
        if lse_refs:
            lse_refs[0][row_ids] = lse2

    _run_tiles(meta, tiles, functools.partial(_attend, meta, page_table_ref, q_ref, k_ref, v_ref, store,
                                              scale_refs, init_refs, **kw), only)


def _run_tiles(meta, tiles, attend, only=None):
    """Run ``attend(tile)`` for a block with tokens: its one tile, or (small, big) by its token count;
    ``only`` (0: small, 1: big): only the blocks that take that tile, the others do nothing."""
    cnt = meta[1]
    if only is not None:  # (separate_tiles: this launch's kernel holds one tile's code, one register budget)
        small = tiles[0][1]
        mine = jnp.logical_and(cnt > 0, cnt <= small) if only == 0 else cnt > small

        @pl.when(mine)
        def _():
            attend(tiles[only])
        return

    @pl.when(cnt > 0)
    def _():
        if len(tiles) == 1:
            attend(tiles[0])
        else:  # (small, big): a block of few tokens (a decode row) takes the small tile
            lax.cond(cnt <= tiles[0][1], lambda: attend(tiles[0]), lambda: attend(tiles[1]))


def _longest_kernel(meta_ref, route_ref, page_table_ref, q_ref, k_ref, v_ref, *refs, quantized, programs, tiles,
                    slots, part_rows, return_lse, **kw):
    """``split_longest``: grid (kv head, program) over ``_split_plan``'s work list (every block, the
    split ones emptied, then ``num_splits`` programs for each of the ``slots`` split blocks);
    ``route_ref [programs * 2]``: (split, slot).  Slot -1: the block runs whole and writes its rows of
    o_ref (and lse); else its split's normalised partial and log2-sum-exp go to the compact buffers
    at row ``((split * slots + slot) * Hkv + head) * part_rows + tile row`` for ``_merge_kernel``."""
    scale_refs, init_refs, refs = _kernel_refs(refs, quantized, kw["init_splits"])
    o_ref, *lse_refs = refs[:2] if return_lse else refs[:1]
    op_ref, lp_ref = refs[-2:]
    head = pl.program_id(0)  # (dim 0 varies fastest: a work item's heads side by side)
    p = programs - 1 - pl.program_id(1)  # the split blocks (end of the list) first
    meta = tuple(meta_ref[p * _META + i] for i in range(_META))
    split, slot = route_ref[2 * p], route_ref[2 * p + 1]
    meta += (split, head, 1 + (kw["num_splits"] - 1) * _positive(slot + 1))  # a split block: all its splits
    num_kv_heads = kw["num_q_heads"] // kw["group"]

    def store(r, row_ids, out, lse2):
        @pl.when(slot < 0)
        def _():
            o_ref[row_ids, :] = out.astype(o_ref.dtype)
            if lse_refs:
                lse_refs[0][row_ids] = lse2

        @pl.when(slot >= 0)
        def _():
            at = ((split * slots + slot) * num_kv_heads + head) * part_rows + r
            op_ref[at, :] = out
            lp_ref[at] = lse2

    _run_tiles(meta, tiles, functools.partial(_attend, meta, page_table_ref, q_ref, k_ref, v_ref, store,
                                              scale_refs, init_refs, **kw))


def _merge_kernel(meta_ref, op_ref, lp_ref, *refs, slots, num_splits, part_rows, group, num_q_heads, small_q,
                  block_q, return_lse):
    """``split_longest``'s merge, grid (slot, kv head): a split block's ``num_splits`` partials (compact
    rows, as ``_longest_kernel`` wrote them) merged by their log2-sum-exps into its rows of o_ref (and
    lse), which alias the first launch's outputs; an empty slot (no tokens) does nothing.  The weights
    come from the small lse vectors first, then one ``[rows, D]`` partial at a time is added in."""
    o_ref, *lse_refs = refs[len(refs) // 2:]  # (the aliased inputs come first)
    j, head = pl.program_id(0), pl.program_id(1)
    tok0, cnt = meta_ref[j * _META], meta_ref[j * _META + 1]
    num_kv_heads = num_q_heads // group

    @pl.when(cnt > 0)
    def _():
        last = (small_q + (block_q - small_q) * _positive(cnt - small_q)) * group - 1  # the tile it ran in
        r, _, row_ids = _tile_rows(part_rows, last, tok0, cnt, head, group, num_q_heads)
        at = [((s * slots + j) * num_kv_heads + head) * part_rows + r for s in range(num_splits)]
        lses = [lp_ref[a] for a in at]
        top = functools.reduce(jnp.maximum, lses)
        shift = jnp.where(jnp.isfinite(top), top, 0.0)
        ws = [jnp.exp2(x - shift) for x in lses]  # an empty split: 0
        den = functools.reduce(jnp.add, ws)
        acc = ws[0][:, None] * op_ref[at[0], :]
        for w, a in zip(ws[1:], at[1:]):
            acc += w[:, None] * op_ref[a, :]
        o_ref[row_ids, :] = (acc / jnp.where(den > 0, den, 1.0)[:, None]).astype(o_ref.dtype)
        if return_lse:
            lse_refs[0][row_ids] = jnp.where(den > 0, shift + jnp.log2(jnp.where(den > 0, den, 1.0)), -jnp.inf)


def _split_plan(meta, *, num_blocks, slots, num_splits, long_keys):
    """``split_longest``'s work list (jnp): the ``slots`` blocks that see the most keys, those past
    ``long_keys`` of them, are split ``num_splits`` ways; the others run whole.  Returns (the work
    list ``[(NB + slots * num_splits) * 5]``: every block, a split one with no tokens there, then each
    slot's ``num_splits`` programs; the route ``[same programs * 2]``: (split, slot or -1); the split
    blocks' words ``[slots * 5]``, zero words for a slot left empty)."""
    words = meta.reshape(num_blocks, _META)
    cnt = words[:, 1]
    keys = jnp.where(cnt > 0, jnp.minimum(words[:, 2] + cnt, words[:, 3]), -1)  # keys the block sees
    top, idx = lax.top_k(keys, slots)
    chosen = top > long_keys
    slot = jnp.where(chosen, jnp.arange(slots, dtype=jnp.int32), -1)
    whole = words.at[idx, 1].set(jnp.where(chosen, 0, cnt[idx]))  # (top_k's indices are distinct)
    split_words = jnp.where(chosen[:, None], words[idx], 0)  # [slots, 5]
    i32 = jnp.int32
    route = jnp.concatenate([
        jnp.stack([jnp.zeros((num_blocks,), i32), jnp.full((num_blocks,), -1, i32)], axis=1),
        jnp.stack([jnp.arange(slots * num_splits, dtype=i32) % num_splits, jnp.repeat(slot, num_splits)], axis=1)])
    work = jnp.concatenate([whole, jnp.repeat(split_words, num_splits, axis=0)])
    return work.reshape(-1), route.reshape(-1), split_words.reshape(-1)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_q", "tiles", "num_warps", "num_stages", "kv_splits", "interpret", "v_rows", "return_lse",
    "split_longest", "long_keys", "separate_tiles"))
def _ragged(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale, init=None, *, sm_scale, block_q,
            tiles, num_warps, num_stages, kv_splits, interpret, v_rows, return_lse=False, split_longest=True,
            long_keys=_LONG_KEYS, separate_tiles=False):
    num_tokens, num_q_heads, head_dim = q.shape  # [N, Hq, D]
    num_kv_heads, num_pages, page_size, _ = k_pages.shape  # [Hkv, P, S, D]
    num_rows, max_pages = page_table.shape  # [R, max_pages]
    group = num_q_heads // num_kv_heads
    num_blocks = _block_bound(num_tokens, num_rows, block_q)
    meta = _block_meta(cu_q_lens, kv_lens, num_tokens=num_tokens, num_blocks=num_blocks,
                       block_q=block_q, max_pages=max_pages, capacity=max_pages * page_size)
    n_rows = num_tokens * num_q_heads
    q_rows = q.reshape(n_rows, head_dim)  # free
    k_slots = k_pages.reshape(num_kv_heads, num_pages * page_size, head_dim)  # free
    v_slots = v_pages.reshape(num_kv_heads, num_pages * page_size, head_dim)
    page_table = page_table.astype(jnp.int32).reshape(-1)
    quantized = k_scale is not None
    scales = ()
    if quantized:  # each head's [P*S] scales, whole
        scales = (k_scale.reshape(num_kv_heads, -1), v_scale.reshape(num_kv_heads, -1))
    init_splits, flat_init = common.init_inputs(init, num_tokens, num_kv_heads, head_dim, "N")
    scales += flat_init  # (the rows' partials over other keys: the row index whole, each head's partials flat)
    kw = dict(quantized=quantized, tiles=tiles, group=group, num_q_heads=num_q_heads, page_size=page_size,
              max_pages=max_pages, num_splits=kv_splits, sm_scale=sm_scale, v_rows=v_rows and quantized,
              init_splits=init_splits)
    name = f"ragged_paged_attention_bq{block_q}_bkv{tiles[-1][2]}_g{group}_s{kv_splits}" + (
        f"_i{init_splits}" if init_splits else "") + (  # (_iN: started from N splits' partials)
        f"_sk{tiles[0][2]}" if len(tiles) == 2 and tiles[0][2] != _small_tile_keys(tiles[-1][2], num_stages)
        else "")  # (_skN: a small_block_kv other than the default)
    params = common.compiler_params(num_warps, num_stages)
    if split_longest and kv_splits > 1:
        out, lse = _ragged_longest(meta, page_table, q_rows, k_slots, v_slots, scales, kw, num_blocks=num_blocks,
                                   block_q=block_q, out_dtype=q.dtype, return_lse=return_lse, name=name,
                                   params=params, interpret=interpret, long_keys=long_keys)
    else:
        out, lse = _ragged_all(meta, page_table, q_rows, k_slots, v_slots, scales, kw, num_blocks=num_blocks,
                               out_dtype=q.dtype, return_lse=return_lse, name=name, params=params,
                               interpret=interpret, separate=separate_tiles and len(tiles) == 2)
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    if not return_lse:
        return out
    return out, (lse * _LN2).reshape(num_tokens, num_q_heads)  # natural log, -inf: no keys


def _whole(*shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _extra_specs(extras, head_of):
    """Block specs of the launch's trailing inputs (the scales, the init partials): a 1-D array whole
    (the init rows), any other one kv head's slice (its first dim), ``head_of(*grid ids)``."""
    return [_whole(x.shape[0]) if x.ndim == 1 else
            pl.BlockSpec((None, *x.shape[1:]), lambda *ids, n=x.ndim: (head_of(*ids),) + (0,) * (n - 1))
            for x in extras]


def _ragged_all(meta, page_table, q_rows, k_slots, v_slots, scales, kw, *, num_blocks, out_dtype, return_lse, name,
                params, interpret, separate=False):
    """Every block's KV range split ``kv_splits`` ways (1: unsplit): grid (split, block, kv head), the
    splits' fp32 partials merged in jnp.  ``separate``: two launches over the same grid, the big tile's
    blocks (``_big``) then the small tile's (``_small``), the second writing into the first's outputs in
    place.  Returns (out [N * Hq, D], log2 lse [N * Hq] or None)."""
    n_rows, head_dim = q_rows.shape
    num_kv_heads, num_slots, _ = k_slots.shape
    kv_splits = kw["num_splits"]
    split = kv_splits > 1
    per_head = pl.BlockSpec((None, num_slots, head_dim), lambda s, i, h: (h, 0, 0))
    if split:
        out_shape = [jax.ShapeDtypeStruct((kv_splits, n_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((kv_splits, n_rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, n_rows, head_dim), lambda s, i, h: (s, 0, 0)),
                     pl.BlockSpec((None, n_rows), lambda s, i, h: (s, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((n_rows, head_dim), out_dtype)]
        out_specs = [_whole(n_rows, head_dim)]
        if return_lse:  # each token row's log2-sum-exp beside its output
            out_shape.append(jax.ShapeDtypeStruct((n_rows,), jnp.float32))
            out_specs.append(_whole(n_rows))
    scale_specs = _extra_specs(scales, lambda s, i, h: h)

    def launch(only, before=(), suffix=""):  # (before: the outputs of the launch before, written in place)
        return pl.pallas_call(
            functools.partial(_ragged_kernel, num_blocks=num_blocks, only=only, aliased=len(before), **kw),
            grid=(kv_splits, num_blocks, num_kv_heads),  # dim 0 varies fastest on launch
            in_specs=[_whole(num_blocks * _META), _whole(page_table.shape[0]), _whole(n_rows, head_dim),
                      per_head, per_head, *scale_specs, *out_specs[:len(before)]],
            out_specs=out_specs,
            out_shape=out_shape,
            input_output_aliases={5 + len(scales) + i: i for i in range(len(before))},
            compiler_params=params,
            interpret=interpret,
            name=name + suffix,
        )(meta, page_table, q_rows, k_slots, v_slots, *scales, *before)

    outs = launch(1, suffix="_big") if separate else launch(None)
    if separate:
        outs = launch(0, tuple(outs), "_small")
    if split:  # [splits, N*Hq, D], [splits, N*Hq] -> merged (padding rows: all zero)
        merged = common.merge_splits(*outs, out_dtype, return_lse=return_lse)
        return merged if return_lse else (merged, None)
    return (outs[0], outs[1]) if return_lse else (outs[0], None)


def _ragged_longest(meta, page_table, q_rows, k_slots, v_slots, scales, kw, *, num_blocks, block_q, out_dtype,
                    return_lse, name, params, interpret, long_keys):
    """``split_longest``: only the few blocks that see the most keys (``_split_plan``) are split; every
    other block runs whole and writes its final rows, so a step of short rows pays no partial buffers
    and no merge pass over them.  Two launches: the attention (grid (kv head, program), the split
    blocks' partials in compact buffers), then ``_merge_kernel`` over the split blocks' rows, in place.
    Returns (out [N * Hq, D], log2 lse [N * Hq] or None)."""
    n_rows, head_dim = q_rows.shape
    num_kv_heads, num_slots, _ = k_slots.shape
    num_tokens = n_rows // kw["num_q_heads"]
    kv_splits, tiles = kw["num_splits"], kw["tiles"]
    # as many split blocks as one chunk of all N tokens makes (the case split-KV is sized for)
    slots = min(num_blocks, pl.cdiv(num_tokens, block_q) + 1)
    part_rows = tiles[-1][0]  # the biggest tile's rows
    work, route, split_words = _split_plan(meta, num_blocks=num_blocks, slots=slots, num_splits=kv_splits,
                                           long_keys=long_keys)
    programs = num_blocks + slots * kv_splits
    part = slots * num_kv_heads * part_rows * kv_splits
    per_head = pl.BlockSpec((None, num_slots, head_dim), lambda h, p: (h, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((n_rows, head_dim), out_dtype)]
    out_specs = [_whole(n_rows, head_dim)]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((n_rows,), jnp.float32))
        out_specs.append(_whole(n_rows))
    out_shape += [jax.ShapeDtypeStruct((part, head_dim), jnp.float32), jax.ShapeDtypeStruct((part,), jnp.float32)]
    out_specs += [_whole(part, head_dim), _whole(part)]
    scale_specs = _extra_specs(scales, lambda h, p: h)
    *outs, o_part, lse_part = pl.pallas_call(
        functools.partial(_longest_kernel, programs=programs, slots=slots, part_rows=part_rows,
                          return_lse=return_lse, **kw),
        grid=(num_kv_heads, programs),
        in_specs=[_whole(programs * _META), _whole(programs * 2), _whole(page_table.shape[0]),
                  _whole(n_rows, head_dim), per_head, per_head, *scale_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name=name + "_sl",
    )(work, route, page_table, q_rows, k_slots, v_slots, *scales)
    outs = pl.pallas_call(
        functools.partial(_merge_kernel, slots=slots, num_splits=kv_splits, part_rows=part_rows, group=kw["group"],
                          num_q_heads=kw["num_q_heads"], small_q=tiles[0][1], block_q=tiles[-1][1],
                          return_lse=return_lse),
        grid=(slots, num_kv_heads),
        in_specs=[_whole(slots * _META), _whole(part, head_dim), _whole(part)] + out_specs[:len(outs)],
        out_specs=out_specs[:len(outs)],
        out_shape=out_shape[:len(outs)],
        input_output_aliases={3 + i: i for i in range(len(outs))},
        compiler_params=common.compiler_params(8, 1),  # (a [rows, D] fp32 accumulator: 8 warps hold it)
        interpret=interpret,
        name=f"ragged_merge_s{kv_splits}",
    )(split_words, o_part, lse_part, *outs)
    return (outs[0], outs[1]) if return_lse else (outs[0], None)


def ragged_paged_attention(
    q: jax.Array,  # [N, Hq, D] flat new tokens
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [R, max_pages] int32
    cu_q_lens: jax.Array,  # [R + 1] int32, row r owns tokens [cu[r], cu[r+1])
    kv_lens: jax.Array,  # [R] int32, cached + new tokens, all already in the pages
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    v_rows: bool | None = None,
    return_lse: bool = False,
    split_longest: bool = True,
    long_keys: int | None = None,
    init: tuple[jax.Array, ...] | None = None,
    small_block_kv: int | None = None,
    separate_tiles: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [N, Hq, D], q.dtype; padding tokens: zeros (without init)
    """Causal attention of a flat batch of decode rows and prefill chunks (see module doc).
    ``return_lse=True`` returns ``(out, lse)``, ``lse [N, Hq] float32`` each query's natural-log
    log-sum-exp of its scaled scores (``-inf`` for padding tokens): what a caller needs to merge this
    output with attention over more keys (``init`` below does that merge inside the kernel).
    Compressed pages (int8 / float8_e4m3fn): ``k_scale`` / ``v_scale [Hkv, P, S]`` float32, each
    gathered tile converted to q's dtype, the scales folded into scores and probabilities
    (``pallas_kernels/quant.py``).  ``v_rows=True`` dequantizes the V tile in registers instead (its
    scales on the rows; a prefill tile serves many query rows, so the multiply is cheap there, and the PV
    dot then reads a 16-bit operand, not a transposed 1-byte one); ``None`` picks per page dtype
    (``quant.scales_on_rows``: on for float8_e4m3fn pages, off for int8: the faster form of each,
    bench/NOTES.md, "Figures moved from code comments").

    Knobs are static and default from ``N``, ``G = Hq // Hkv`` and the dtype, as in
    :func:`paged_prefill_attention` with ``N`` as the chunk length (H200 sweep,
    bench/NOTES.md): big tile ``block_q * G`` rows = 128 for ``N >= 1024`` (4 warps, 2 stages)
    and for ``N < 256`` (8 warps, 3 stages), 64 rows in between; ``block_kv`` 64; fp32 (a
    correctness path) 64 rows, ``block_kv`` 16.  A decode-shaped step (``N <= R * 16 // G``:
    rows average a small tile or less) uses the decode kernel's 4 warps and 2 stages instead.
    The small tile for blocks of at most ``max(1, 16 // G)`` tokens (decode rows) has
    ``max(16, G)`` rows and ``2 * block_kv`` keys per step (``block_kv`` with 3+ stages), or
    ``small_block_kv`` keys when given (a power of two >= 16): its shared memory is ``num_stages`` K and V
    tiles of that many keys, which bounds how many programs an SM holds.  ``separate_tiles=True`` runs the
    two tiles' blocks in two launches (the big tile's, then the small tile's writing into the same output), so
    each kernel is compiled with one tile's code and gets that tile's register budget (one kernel's registers
    are its bigger branch's: the small tile ran at two programs an SM, bench/NOTES.md run BD); not with
    ``split_longest``'s split path (the flag is ignored there).
    ``kv_splits``: None = automatic (1 when the grid fills the GPU and in interpret
    mode), 1 = no split-KV.  ``split_longest=True`` (the default; with ``kv_splits`` > 1 as given or
    chosen, else it changes nothing) splits only the blocks that see the most keys (as many as one
    chunk of all ``N`` tokens makes, each past ``long_keys``, None: ``_LONG_KEYS`` = 512) and runs the others
    whole, with no partial buffers for them (module docstring).  Eager calls also check the length
    values (one host sync).

    ``init = (row [N] int32, o [Hkv, NI, R, D], m [Hkv, NI, R], l [Hkv, NI, R] fp32)``: each token's
    attention over *other* keys, as ``NI`` split partials (unnormalised ``o``, base-2 running max ``m``
    of the scaled scores, sum ``l``: the cascade shared part's, ``grouped_shared_prefix_partials``); token
    ``n``'s query head ``h * G + j`` has its partials at row ``row[n] + j`` of kv head ``h`` (``row[n] <
    0``: none).  ``o`` may instead be normalised in a 16-bit dtype, with ``m`` its base-2 log-sum-exp and
    ``l`` 1 (0 without keys): the same merge (the shared part's ``INFERSCALE_SHARED_PARTIALS=q_dtype``).
    The kernel starts those rows' online softmax from them (split 0 of a split block), so
    the output (and lse) is the attention over both key sets, with no merge after it.  A padding token
    given partials (``row >= 0``) comes out as their attention, not zeros (the engine gives them none).
    """
    num_tokens, num_rows, num_q_heads, num_kv_heads, _, page_size, head_dim = (
        check_ragged_inputs(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale))
    common.init_inputs(init, num_tokens, num_kv_heads, head_dim, "N")  # (the checks, eagerly)
    interpret = common.default_interpret() if interpret is None else interpret
    if v_rows is None:
        v_rows = scales_on_rows(k_pages.dtype)
    group = num_q_heads // num_kv_heads
    small_rows, small_q = _small_tile(group)
    if num_tokens <= num_rows * small_q:  # decode-shaped step: as the decode kernel,
        num_warps = 4 if num_warps is None else num_warps  # 4 warps, 2 stages (so the
        num_stages = 2 if num_stages is None else num_stages  # small tile has 128 keys)
    block_q, rows, block_kv, num_warps, num_stages = _choose_blocks(
        num_tokens, group, head_dim, q.dtype.itemsize, block_q, block_kv, num_warps,
        num_stages, interpret)
    small_kv = _small_tile_keys(block_kv, num_stages)
    if small_block_kv is not None:
        if not isinstance(small_block_kv, (int, np.integer)):
            common._fail("small_block_kv", small_block_kv, "an int (keys per step of the small tile), or None")
        common.check_power_of_two("small_block_kv", int(small_block_kv), common.MIN_DOT_DIM)
        small_kv = int(small_block_kv)
    if small_q < block_q:  # (small, big) tiles, one picked per block
        tiles = ((small_rows, small_q, small_kv, True), (rows, block_q, block_kv, False))
    else:  # N so small that the big tile is decode-sized: one tile, the small tile's settings
        tiles = ((rows, block_q, small_kv, True),)
    if kv_splits is None and interpret:
        kv_splits = 1  # splitting only pays for itself on a GPU
    elif kv_splits is None:
        kv_splits = _default_kv_splits(num_tokens, num_kv_heads, block_q, page_table.shape[1] * page_size,
                                       num_q_heads * head_dim * 4)
    if kv_splits < 1:
        common._fail("kv_splits", kv_splits, ">= 1 (1 = no split-KV)")
    long_keys = _LONG_KEYS if long_keys is None else int(long_keys)
    if long_keys < 0:
        common._fail("long_keys", long_keys, ">= 0 (split_longest: keys a block must see past to be split)")
    if num_tokens == 0 or num_rows == 0:
        return _empty(q, return_lse)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return _ragged(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale, init, sm_scale=sm_scale,
                   block_q=block_q, tiles=tiles, num_warps=num_warps, num_stages=num_stages,
                   kv_splits=int(kv_splits), interpret=interpret, v_rows=v_rows, return_lse=return_lse,
                   split_longest=bool(split_longest), long_keys=long_keys, separate_tiles=bool(separate_tiles))


def _small_tile_keys(block_kv: int, num_stages: int) -> int:
    """The small tile's default keys per step: ``2 * block_kv`` with up to 2 stages, else ``block_kv`` (the
    shared-memory budget)."""
    return 2 * block_kv if num_stages <= 2 else block_kv


def _empty(q, return_lse: bool):
    """The result for no tokens or no rows: zeros (and ``-inf`` log-sum-exps)."""
    out = jnp.zeros_like(q)
    return (out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else out


def ragged_paged_attention_ref(
    q: jax.Array,  # [N, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [R, max_pages] int32
    cu_q_lens: jax.Array,  # [R + 1] int32
    kv_lens: jax.Array,  # [R] int32
    *,
    sm_scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    return_lse: bool = False,
    init: tuple[jax.Array, ...] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [N, Hq, D] (, lse [N, Hq])
    """Pure-jnp reference, token by token: each token finds its row and position, gathers
    its row's pages densely and runs a masked fp32 softmax (padding tokens: zeros).  Tokens
    go through ``lax.map`` in batches, so the gathered K/V stay within ``_REF_CHUNK_BYTES``.
    Compressed pages are dequantized to float32 as gathered: the exact values the quantized pages hold
    (the kernel folds the scales into scores and probabilities instead: equal up to rounding).
    ``return_lse``: also each query's natural-log log-sum-exp (``-inf`` without keys).  ``init``: as the
    kernel's, merged after the softmax by log-sum-exps (``cascade_attention.merge_partials``).
    """
    num_tokens, num_rows, num_q_heads, num_kv_heads, _, _, head_dim = check_ragged_inputs(
        q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale)
    common.init_inputs(init, num_tokens, num_kv_heads, head_dim, "N")  # (the checks)
    if num_tokens == 0 or num_rows == 0:
        return _empty(q, return_lse)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    out, lse = _ref(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale, sm_scale=sm_scale)
    if init is not None:
        out, lse = merge_lse(*merge_partials(init, num_q_heads), out, lse)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _ref(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, k_scale, v_scale, *, sm_scale):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_rows, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    capacity = max_pages * page_size
    hi = lax.Precision.HIGHEST
    tok = jnp.arange(num_tokens)
    cu = cu_q_lens.astype(jnp.int32)
    row = jnp.sum(cu[None, 1:] <= tok[:, None], axis=1)  # [N]; R for padding tokens
    real = row < num_rows
    row = jnp.minimum(row, num_rows - 1)
    kv = kv_lens.astype(jnp.int32)[row]
    pos = kv - (cu[row + 1] - cu[row]) + tok - cu[row]  # [N] absolute query positions
    kpos = jnp.arange(capacity)

    def one_token(args):  # q [Hq, D], its row, position, kv_len, realness
        qt, r, p, n, ok = args
        vis = (kpos <= p) & (kpos < n) & ok  # [L]
        def gather(pages, scale):  # [Hkv, P, S, D] -> [Hkv, L, D] fp32, invisible slots zeroed
            x = gather_pages(pages, scale, page_table[r]).reshape(num_kv_heads, capacity, head_dim)
            return jnp.where(vis[None, :, None], x, 0.0)
        k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
        qf = qt.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        s = jnp.einsum("hgd,hld->hgl", qf, k, precision=hi) * sm_scale
        s = jnp.where(vis, s, -jnp.inf)
        mx = jnp.max(s, axis=-1, keepdims=True, initial=-1e30)
        e = jnp.exp(s - mx)
        tot = e.sum(axis=-1, keepdims=True)
        p_ = e / jnp.maximum(tot, 1e-30)  # no keys: all zero
        lse = jnp.where(tot > 0, mx + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)  # [Hkv, G, 1]
        return (jnp.einsum("hgl,hld->hgd", p_, v, precision=hi).reshape(num_q_heads, head_dim),
                lse.reshape(num_q_heads))  # (fp32: the wrapper casts)

    per_token = 2 * num_kv_heads * capacity * head_dim * 4  # gathered K and V, fp32
    batch = max(1, min(num_tokens, _REF_CHUNK_BYTES // per_token))
    return lax.map(one_token, (q, row, pos, kv, real), batch_size=batch)  # [N, Hq, D] fp32, [N, Hq]
