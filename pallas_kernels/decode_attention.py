"""Paged decode attention (one new query token per sequence), flash-decoding style.

Layout (see ``common``): ``k_pages``/``v_pages`` ``[Hkv, P, S, D]``, ``page_table [B, max_pages]``,
``lengths [B]``.  The query ``q [B, Hq, D]`` of sequence ``b`` attends to its first
``lengths[b]`` cached tokens (the new token's own K/V are expected to be written already).

Algorithm
1. The wrapper views ``q`` as ``[B, Hkv, G, D]`` (``G = Hq // Hkv`` query heads share one KV
   head) and each page array as ``[Hkv, P*S, D]`` (a free reshape), so a token's K row of head
   ``h`` is ``k[h, slot]`` with ``slot = page * S + offset``.
2. Grid ``(B, Hkv, num_splits)``.  Program ``(b, h, s)`` owns tokens
   ``[s * T_split, (s + 1) * T_split)`` of sequence ``b`` clipped to ``lengths[b]``; its loop
   bound comes from the length, so no work is spent past the end of a sequence (an empty split
   runs zero iterations).
3. Each iteration handles a KV block of ``BK = pages_per_block * S`` tokens: the page ids of
   the block are read from the page table row (dynamic, per-token gather of the table), turned
   into ``BK`` slots, and the ``[BK, D]`` K and V tiles are gathered from up to
   ``pages_per_block`` scattered pages in one load each.  The slots of block ``i + 1`` are
   read during block ``i`` (carried in the loop state), so no load waits on another load.
   The pages are passed whole (a BlockSpec only selects the KV head), as in
   ``jax.experimental.pallas.ops.gpu.paged_attention``.
4. Logits ``[Gp, BK] = q [Gp, D] @ k^T`` on tensor cores: the ``G`` query heads are loaded as
   a ``Gp``-row tile (``G`` rounded up to a power of two, at least 16: Triton's minimum matmul
   size) with the padding rows masked to 0 and never stored.  Online softmax in fp32 in base 2 (``sm_scale * log2(e)`` folded into one multiply);
   tokens at or past the length get ``-inf`` logits and their V rows are zeroed, so stale or
   NaN data in unused pages cannot leak into the output.
5. ``num_splits == 1``: the program normalises and writes ``out`` directly.  Otherwise it writes
   the unnormalised partial output ``[G, D]``, running max ``m`` and sum ``l`` (fp32), and a
   small jnp step merges the splits: ``out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s``.
   A zero length yields zeros, never NaN.
6. ``return_lse=True`` (default off; the cascade kernel's suffix part uses it) also returns
   ``lse [B, Hq] float32``, the **natural-log** sum-exp of the scaled logits,
   ``log(sum_t exp(sm_scale * q . k_t))``, and ``-inf`` for a zero length (whose output stays
   0).  Direct path: the program also stores ``m + log2(l)`` per row; split path: from the
   merged ``m``/``l``.  Either way the wrapper converts base 2 to natural log.
7. ``init`` (the cascade's suffix part): split 0 starts from partial results over other keys
   instead of the empty state: its prologue loads the request's rows of each of ``NI`` partials
   (``o``, base-2 ``m``, ``l``, at a per-request row given in ``init[0]``), merges them as the
   wrapper merges splits, and the loop continues from there; the output is then the attention
   over both key sets (the cascade's shared prefix + the row's suffix) with no merge after it.

Auto tuning knobs (both static): ``pages_per_block`` makes a block 64 tokens (page sizes 8..64);
``num_splits`` makes ``B * Hkv * num_splits`` about four programs per SM, but keeps at least two
blocks per split (of the table's capacity).  Split ``s`` of a row covers the ``s``-th contiguous
``1/num_splits`` of that row's own blocks, so a row much shorter than the table still spreads over
every split (bench/NOTES.md, issue 14: a 4k row in a 32k-wide table used 2 of 9 splits).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.quant import dequantize_rows, fold_probs, fold_scores, gather_pages, pv_dtype, scales_on_rows

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)  # return_lse: base-2 log-sum-exp * ln 2 = natural log
_M_INIT = -1e30  # finite "minus infinity" for the running max: empty splits stay NaN-free
PROGRAMS_PER_SM = 4
TARGET_BLOCK_TOKENS = 128  # H200 sweep (bench/NOTES.md): 128-token tiles beat 64 at every shape
MIN_BLOCKS_PER_SPLIT = 1  # H200: B=1 short contexts want every block in flight (latency-bound)


def check_decode_inputs(q, k_pages, v_pages, page_table, lengths, k_scale=None, v_scale=None) -> tuple[int, ...]:
    """Validate decode inputs; return (B, Hq, Hkv, G, P, S, D, max_pages)."""
    hkv, p, s, d = common.check_pages(k_pages, v_pages)
    if q.ndim != 3 or q.shape[-1] != d:
        common._fail("q.shape", q.shape, f"[B, Hq, {d}] (head_dim of the pages)")
    common.query_dtype_ok(q, k_pages, common.check_scales(k_pages, k_scale, v_scale))
    b, hq, _ = q.shape
    g = common.check_gqa(hq, hkv)
    max_pages = common.check_page_table(page_table, b)
    common.check_int_vector("lengths", lengths, b)
    return b, hq, hkv, g, p, s, d, max_pages


def query_tile_rows(group: int) -> int:
    """The kernel's query tile: a request's ``group`` query heads of one KV head as a power-of-two
    row count, at least Triton's minimum matmul size (the padding rows are masked)."""
    return max(common.MIN_DOT_DIM, 1 << (group - 1).bit_length())


def auto_pages_per_block(page_size: int) -> int:
    return max(1, TARGET_BLOCK_TOKENS // page_size)


def auto_num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Splits so the grid fills the GPU ~PROGRAMS_PER_SM deep, with >= 2 blocks per split."""
    if batch * num_kv_heads >= common.num_sms():  # the grid already fills the GPU: no split
        return 1
    want = pl.cdiv(PROGRAMS_PER_SM * common.num_sms(), batch * num_kv_heads)
    cap = max(1, max_blocks // MIN_BLOCKS_PER_SPLIT)
    return int(max(1, min(want, cap)))


def _decode_kernel(
    lengths_ref,  # [B] int32 (whole array)
    page_table_ref,  # [max_pages] int32 (row b)
    q_ref,  # [Gp, D] (rows >= G are out of bounds: masked)
    k_ref,  # [P*S, D] (head h, all pages)
    v_ref,  # [P*S, D], or [P, D, S] with v_transposed (one page per block)
    *refs,  # (ks_ref, vs_ref [P*S] fp32 when quantized), (init_row_ref [B] int32, init_o_ref [NI*R, D],
    #         init_m_ref [NI*R], init_l_ref [NI*R] fp32 with init_splits), o_ref [Gp, D] (final out) or
    #         [Gp, D] fp32 partial, then () or (lse2_ref [Gp],) with the final out, or (m_ref [Gp], l_ref [Gp])
    quantized: bool,
    init_splits: int,
    fold_scales: bool,
    k_major: bool,
    v_transposed: bool,
    group: int,
    page_size: int,
    block_tokens: int,
    num_splits: int,
    max_pages: int,
    scale_log2: float,
    prefetch: bool,
):
    if quantized:
        ks_ref, vs_ref, *refs = refs
    init_refs, (o_ref, *stat_refs) = (refs[:4], refs[4:]) if init_splits else ((), refs)
    b, s = pl.program_id(0), pl.program_id(2)
    gp, d = q_ref.shape
    row_ok = jnp.arange(gp) < group  # [Gp]
    q = plt.load(q_ref.at[pl.ds(0, gp), :], mask=row_ok[:, None], other=0)  # [Gp, D]
    # fp32 pages: IEEE dots (Triton's DEFAULT is TF32); bf16 keeps the default, the path the
    # H200 figures were measured with (bench/NOTES.md)
    prec = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    length = jnp.minimum(lengths_ref[b], max_pages * page_size)
    # split s takes a contiguous 1/num_splits of THIS row's blocks (not of the table's capacity:
    # with a wide table a short row would otherwise leave all but its first splits idle)
    per = pl.cdiv(pl.cdiv(length, block_tokens), num_splits) * block_tokens
    tok_start = s * per
    tok_end = jnp.minimum(tok_start + per, length)
    num_iters = pl.cdiv(jnp.maximum(tok_end - tok_start, 0), block_tokens)
    offs = jnp.arange(block_tokens, dtype=jnp.int32)  # [BK]
    log2_s = page_size.bit_length() - 1
    num_pages = k_ref.shape[0] // page_size

    def slots_of(i):  # [BK] cache slots of block i of this split
        tok = tok_start + i * block_tokens + offs  # absolute positions
        # S is a power of two: shifts and masks instead of (signed, sign-fixed) // and %.
        # Positions past the table are clamped (they are past the length: masked below).
        page_idx = jnp.minimum(lax.shift_right_logical(tok, log2_s), max_pages - 1)
        page = jnp.clip(page_table_ref[page_idx], 0, num_pages - 1)  # a bad id cannot fault
        return lax.shift_left(page, log2_s) + (tok & (page_size - 1))

    def page_of(i):  # v_transposed: the one page of block i (a scalar)
        idx = jnp.minimum(lax.shift_right_logical(tok_start, log2_s) + i, max_pages - 1)
        return jnp.clip(page_table_ref[idx], 0, num_pages - 1)

    def body(i, carry):
        # [Gp, D], [Gp], [Gp] fp32; block i's [BK] slots; with v_transposed also its page (a scalar)
        o, m, l, *nxt = carry
        slot, *page = nxt if prefetch else (slots_of(i), *((page_of(i),) if v_transposed else ()))
        valid = tok_start + i * block_tokens + offs < length  # [BK]
        k = k_ref[slot]  # [BK, D] gathered from up to pages_per_block pages
        v = v_ref[page[0], :, :] if v_transposed else v_ref[slot]  # [D, BK] / [BK, D]
        folded = quantized and fold_scales
        if folded:  # compressed pages: exact convert; the scales multiply scores and probs (quant.py)
            ks, vs = ks_ref[slot], vs_ref[slot]
            k, v = k.astype(q.dtype), v.astype(pv_dtype(q.dtype))
        elif quantized:  # scales applied to the rows in registers (the earlier form, for comparison)
            k, v = dequantize_rows(k, ks_ref[slot], q.dtype), dequantize_rows(v, vs_ref[slot], q.dtype)
        # Prefetch: the next block's page ids load alongside this block's K/V, so the
        # page-table read is off the critical path (no dependent load inside an iteration).
        nxt = ((slots_of(i + 1), *((page_of(i + 1),) if v_transposed else ())) if prefetch else ())
        if k_major:  # K as the dot's row operand (untransposed), the [BK, Gp] result transposed back
            logits = lax.dot_general(k, q, (((1,), (1,)), ((), ())), precision=prec,
                                     preferred_element_type=jnp.float32).T  # [Gp, BK]
        else:
            logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                     preferred_element_type=jnp.float32)  # [Gp, BK]
        if folded:
            logits = fold_scores(logits, ks)
        logits = jnp.where(valid[None, :], logits * scale_log2, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))  # [Gp]
        p = jnp.exp2(logits - m_new[:, None])  # [Gp, BK]
        corr = jnp.exp2(m - m_new)  # [Gp]
        l_new = l * corr + jnp.sum(p, axis=1)
        # stale/NaN slots must not leak
        v = jnp.where(valid[None, :] if v_transposed else valid[:, None], v, jnp.zeros_like(v))
        w = fold_probs(p, vs, valid) if folded else p
        pv = lax.dot_general(w.astype(v.dtype), v, (((1,), (1 if v_transposed else 0,)), ((), ())),
                             precision=prec, preferred_element_type=jnp.float32)  # [Gp, D]
        return (o * corr[:, None] + pv, m_new, l_new, *nxt)

    init = (*(_initial_state(init_refs, b, s, row_ok, init_splits) if init_splits else
              (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), _M_INIT, jnp.float32), jnp.zeros((gp,), jnp.float32))),
            *((slots_of(0), *((page_of(0),) if v_transposed else ())) if prefetch else ()))
    o, m, l = lax.fori_loop(0, num_iters, body, init)[:3]

    if len(stat_refs) == 2:  # partial result of one split
        m_ref, l_ref = stat_refs
        plt.store(o_ref.at[pl.ds(0, gp), :], o, mask=row_ok[:, None])
        plt.store(m_ref.at[pl.ds(0, gp)], m, mask=row_ok)
        plt.store(l_ref.at[pl.ds(0, gp)], l, mask=row_ok)
    else:
        out = o / jnp.where(l > 0, l, 1.0)[:, None]
        plt.store(o_ref.at[pl.ds(0, gp), :], out.astype(o_ref.dtype), mask=row_ok[:, None])
        if stat_refs:  # return_lse: base-2 log-sum-exp, -inf for an empty sequence
            lse2 = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            plt.store(stat_refs[0].at[pl.ds(0, gp)], lse2, mask=row_ok)


def _initial_state(init_refs, b, s, row_ok, splits: int):
    """Split 0's starting (o, m, l) for request ``b``: the ``splits`` partials of another pass over
    other keys (the cascade's shared part), merged; rows ``init_row[b] .. + Gp`` of them hold its
    query rows (``init_row[b] < 0``: none, the usual empty start).  Base-2 ``m`` as the kernel's own."""
    row_ref, o_ref, m_ref, l_ref = init_refs  # partials flat: split t's rows at t * R
    gp = row_ok.shape[0]
    per_split = m_ref.shape[0] // splits  # R
    start = row_ref[b]
    ok = row_ok & (start >= 0) & (s == 0)  # [Gp]
    first = jnp.maximum(start, 0)  # (the partials are padded: a whole tile from any row fits)
    ms = [plt.load(m_ref.at[pl.ds(first + t * per_split, gp)], mask=ok, other=_M_INIT) for t in range(splits)]
    m = functools.reduce(jnp.maximum, ms)
    o = jnp.zeros((gp, o_ref.shape[-1]), jnp.float32)
    l = jnp.zeros((gp,), jnp.float32)
    for t in range(splits):
        w = jnp.exp2(ms[t] - m)  # 0 for a split with no key (its m is _M_INIT, l 0)
        rows = pl.ds(first + t * per_split, gp)
        o += w[:, None] * plt.load(o_ref.at[rows, :], mask=ok[:, None], other=0.0).astype(jnp.float32)
        l += w * plt.load(l_ref.at[rows], mask=ok, other=0.0)
    return o, m, l


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "num_splits", "pages_per_block", "num_warps",
                     "num_stages", "interpret", "return_lse", "fold_scales", "k_major",
                     "v_transposed", "prefetch"))
def paged_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [B, max_pages] int32
    lengths: jax.Array,  # [B] int32, 0 <= length <= max_pages * S
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    return_lse: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    fold_scales: bool | None = None,
    k_major: bool = False,
    v_transposed: bool = False,
    init: tuple[jax.Array, ...] | None = None,
    prefetch: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, Hq, D], dtype of q (+ lse [B, Hq] fp32)
    """Attention of one query token per sequence over its paged KV cache (see module doc).

    ``return_lse=True`` returns ``(out, lse)``, ``lse [B, Hq] float32`` the natural-log
    log-sum-exp of the scaled logits (``-inf`` where ``lengths[b] == 0``; see item 6).
    Compressed pages (int8 / float8_e4m3fn, ``pallas_kernels/quant.py``): ``k_scale`` / ``v_scale``
    ``[Hkv, P, S]`` float32; a gathered tile is converted to q's dtype and the scales multiply the
    scores and probabilities (``fold_scales=True``, quant.py) or multiply the rows (``False``);
    ``None`` picks per page dtype (``quant.scales_on_rows``: rows for float8_e4m3fn, folded for int8;
    folded with ``v_transposed``), as measured on the H200 (``bench/kernels/kv_dtype.py``).  ``k_major=True`` computes the
    scores as ``k @ q^T`` (K the untransposed row operand, as a 1-byte tile's conversion may prefer; a
    knob to measure, bench/NOTES.md), the same values.  ``v_transposed=True`` takes ``v_pages`` as
    ``[Hkv, P, D, S]`` (each page's V stored token-contiguous, so the PV dot's operand is contiguous along
    its contraction, as K's is) and needs one page per block: a layout experiment for 1-byte pages
    (``bench/kernels/kv_dtype.py`` section v), not the engine's layout.  Where ``S == D`` the two layouts have one
    shape, so the check cannot tell them apart: the caller says which it passes.

    ``init = (row [B] int32, o [Hkv, NI, R, D], m [Hkv, NI, R], l [Hkv, NI, R] fp32)``: the attention
    continues from partial results over *other* keys (the cascade's shared part, already computed):
    request ``b``'s query heads ``h * G .. h * G + G - 1`` are rows ``row[b] .. row[b] + G - 1`` of head
    ``h``'s ``NI`` partials (unnormalised ``o``, base-2 running max ``m``, sum ``l``, as this kernel's own
    split partials; or, equivalently, ``o`` normalised in a 16-bit dtype with ``m`` its base-2 log-sum-exp
    and ``l`` 1, 0 without keys: ``INFERSCALE_SHARED_PARTIALS=q_dtype``); ``row[b] < 0``: none.  ``R >=
    max(row) + Gp`` (padded: a whole query tile is read).
    The result is the attention over both key sets, as if the partials were one more split.

    ``prefetch``: the loop carries the next block's page slots (True) or computes each block's in
    its own iteration (False); None: :func:`pallas_kernels.common.slot_prefetch`.  ``num_stages``
    None: 2, or 3 without the carry (:func:`pallas_kernels.common.stages_for`).  ``pages_per_block``,
    ``num_warps`` (4) and ``num_stages`` left None take ``INFERSCALE_DECODE``'s values where it sets them
    (:func:`pallas_kernels.common.decode_knobs`, an A/B switch for the benchmarks).
    """
    v_usual = v_pages  # what the checks see: V in the usual layout
    if v_transposed:  # validate as the usual layout; the kernel reads the transposed one
        if v_pages.ndim != 4 or v_pages.shape != k_pages.shape[:2] + k_pages.shape[:1:-1]:
            common._fail("v_pages.shape", v_pages.shape, f"[Hkv, P, D, S] = {k_pages.shape[:2] + k_pages.shape[:1:-1]} "
                         "with v_transposed")
        v_usual = jax.ShapeDtypeStruct(k_pages.shape, v_pages.dtype)
    b, hq, hkv, g, p, s, d, max_pages = check_decode_inputs(q, k_pages, v_usual, page_table,
                                                            lengths, k_scale, v_scale)
    quantized = k_scale is not None
    if fold_scales is None:
        fold_scales = v_transposed or not scales_on_rows(k_pages.dtype)
    common.check_power_of_two("page_size", s)
    common.check_power_of_two("head_dim", d, common.MIN_DOT_DIM)
    gp = query_tile_rows(g)
    user = common.decode_knobs()  # (INFERSCALE_DECODE: where the caller left a knob unset)
    if pages_per_block is None and "block_tokens" in user and not v_transposed:
        if user["block_tokens"] < s:
            common._fail("INFERSCALE_DECODE's bk", user["block_tokens"], f">= the page size {s}")
        pages_per_block = user["block_tokens"] // s
    num_warps = user.get("num_warps", 4) if num_warps is None else num_warps
    num_stages = user.get("num_stages") if num_stages is None else num_stages
    if pages_per_block is None:
        pages_per_block = 1 if v_transposed else auto_pages_per_block(s)
    if v_transposed and pages_per_block != 1:
        common._fail("pages_per_block", pages_per_block, "1 with v_transposed (a block is one page)")
    if v_transposed and quantized and not fold_scales:
        common._fail("fold_scales", fold_scales, "True with v_transposed (the rows form scales [BK, D] rows)")
    block_tokens = pages_per_block * s
    common.check_power_of_two("pages_per_block * page_size", block_tokens, common.MIN_DOT_DIM)
    max_blocks = pl.cdiv(max_pages * s, block_tokens)
    if num_splits is None:
        num_splits = auto_num_splits(b, hkv, max_blocks)
    if num_splits < 1:
        common._fail("num_splits", num_splits, ">= 1 (or None for auto)")
    split_tokens = pl.cdiv(max_blocks, num_splits) * block_tokens
    num_splits = pl.cdiv(max_pages * s, split_tokens)  # drop splits that could never hold tokens
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if interpret is None:
        interpret = common.default_interpret()
    prefetch = common.slot_prefetch() if prefetch is None else prefetch
    num_stages = common.stages_for(2, prefetch) if num_stages is None else num_stages

    q4 = q.reshape(b, hkv, g, d)  # [B, Hkv, G, D]
    k2 = k_pages.reshape(hkv, p * s, d)  # [Hkv, P*S, D]
    v2 = v_pages if v_transposed else v_pages.reshape(hkv, p * s, d)
    lengths = lengths.astype(jnp.int32)
    page_table = page_table.astype(jnp.int32)

    in_specs = [
        pl.BlockSpec((b,), lambda i, j, k: (0,)),  # lengths: whole
        pl.BlockSpec((None, max_pages), lambda i, j, k: (i, 0)),  # page-table row
        pl.BlockSpec((None, None, gp, d), lambda i, j, k: (i, j, 0, 0)),  # q group
        pl.BlockSpec((None, p * s, d), lambda i, j, k: (j, 0, 0)),  # all pages of head j
        pl.BlockSpec((None, p, d, s), lambda i, j, k: (j, 0, 0, 0)) if v_transposed
        else pl.BlockSpec((None, p * s, d), lambda i, j, k: (j, 0, 0)),
    ]
    scales = ()
    if quantized:  # each head's [P*S] scales, whole
        in_specs += [pl.BlockSpec((None, p * s), lambda i, j, k: (j, 0))] * 2
        scales = (k_scale.reshape(hkv, p * s), v_scale.reshape(hkv, p * s))
    init_splits, flat_init = common.init_inputs(init, b, hkv, d, "B")
    if init_splits:  # the row index whole, each head's partials whole
        flat = flat_init[1].shape[1]
        in_specs += [pl.BlockSpec((b,), lambda i, j, k: (0,)),
                     pl.BlockSpec((None, flat, d), lambda i, j, k: (j, 0, 0)),
                     pl.BlockSpec((None, flat), lambda i, j, k: (j, 0)),
                     pl.BlockSpec((None, flat), lambda i, j, k: (j, 0))]
        scales += flat_init
    kernel = functools.partial(
        _decode_kernel, quantized=quantized, init_splits=init_splits, fold_scales=fold_scales, k_major=k_major,
        v_transposed=v_transposed, group=g, page_size=s,
        block_tokens=block_tokens, num_splits=num_splits, max_pages=max_pages, scale_log2=float(sm_scale) * _LOG2E,
        prefetch=prefetch)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype)
        out_specs = pl.BlockSpec((None, None, gp, d), lambda i, j, k: (i, j, 0, 0))
        if return_lse:
            out_shape = [out_shape, jax.ShapeDtypeStruct((b, hkv, g), jnp.float32)]  # lse2
            out_specs = [out_specs, pl.BlockSpec((None, None, gp), lambda i, j, k: (i, j, 0))]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((b, hkv, num_splits, g, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32),  # m (log2 units)
            jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32),  # l
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, gp, d), lambda i, j, k: (i, j, k, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, k: (i, j, k, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, k: (i, j, k, 0)),
        ]
    res = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"paged_decode_bk{block_tokens}_sp{num_splits}",
    )(lengths, page_table, q4, k2, v2, *scales)
    if num_splits == 1:
        if return_lse:
            out, lse2 = res  # [B, Hkv, G, D], [B, Hkv, G]
            return out.reshape(b, hq, d), lse2.reshape(b, hq) * _LN2
        return res.reshape(b, hq, d)
    o, m, l = res  # [B, Hkv, NS, G, D], [B, Hkv, NS, G], [B, Hkv, NS, G]
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)  # [B, Hkv, NS, G]
    l_tot = jnp.sum(l * w, axis=2)  # [B, Hkv, G]
    o_tot = jnp.sum(o * w[..., None], axis=2)  # [B, Hkv, G, D]
    out = o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    out = out.reshape(b, hq, d).astype(q.dtype)
    if return_lse:
        m_max = m_max[:, :, 0]  # [B, Hkv, G]
        lse2 = jnp.where(l_tot > 0, m_max + jnp.log2(jnp.where(l_tot > 0, l_tot, 1.0)), -jnp.inf)
        return out, lse2.reshape(b, hq) * _LN2
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_decode_attention_ref(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    page_table: jax.Array,  # [B, max_pages]
    lengths: jax.Array,  # [B]
    *,
    sm_scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:  # [B, Hq, D]
    """Plain-jnp reference: gather the pages (compressed ones dequantized to float32; the kernel
    folds the scales instead, equal up to rounding), mask by length, softmax in fp32."""
    b, hq, hkv, g, p, s, d, max_pages = check_decode_inputs(q, k_pages, v_pages, page_table,
                                                            lengths, k_scale, v_scale)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    hi = lax.Precision.HIGHEST
    k = gather_pages(k_pages, k_scale, page_table).reshape(hkv, b, max_pages * s, d)  # [Hkv,B,T,D] fp32
    v = gather_pages(v_pages, v_scale, page_table).reshape(hkv, b, max_pages * s, d)
    qf = q.reshape(b, hkv, g, d).astype(jnp.float32)
    logits = jnp.einsum("bhgd,hbtd->bhgt", qf, k, precision=hi) * sm_scale  # [B, Hkv, G, T]
    valid = jnp.arange(max_pages * s)[None, :] < lengths[:, None]  # [B, T]
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    v = jnp.where(valid[None, :, :, None], v, 0.0)  # unused slots may hold anything (even NaN)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    wsum = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(wsum > 0, wsum, 1.0)
    out = jnp.einsum("bhgt,hbtd->bhgd", probs, v, precision=hi)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).astype(q.dtype)
