"""Cascade decode attention: many decoding rows over shared contexts, each read once per step.

Problem.  When ``B`` decoding requests share long contexts (segments of a few thousand tokens),
the paged decode kernel reads each shared page once *per request*.  Cascade attention splits
each row's keys into its group's shared prefix and its own suffix, attends every group's prefix
for that group's rows at once (each shared K/V tile read once per *row block of the group's
members*), attends the suffixes with the ordinary decode kernel, and merges the two with their
log-sum-exps.  One step may hold many groups (tenants, segments, prefix-cache hits): all of them
run in the same launch.

Inputs (one layer; page layout as in :mod:`pallas_kernels.common`):

* ``q [B, Hq, D]``: one query token per request.
* ``k_pages, v_pages [Hkv, P, S, D]``.
* The group table: ``group_pages [G, Ps] int32`` (group ``g``'s shared page list, padded with
  anything) and ``group_lens [G] int32`` (``0 <= group_lens[g] <= Ps * S``: group ``g`` shares
  positions ``0 .. group_lens[g] - 1`` of its list).  ``G == 0`` or ``Ps == 0`` is allowed: the
  result is plain paged decode.  A group may have no members, or one.
* ``row_group [B] int32``: request ``b``'s group, ``-1`` for none.  A row outside every group
  attends to its suffix only (the engine gives it its whole page list), so one batch mixes the
  members of many groups with any other requests.
* ``suffix_table [B, MP] int32`` and ``suffix_lens [B] int32`` (``0 <= suffix_lens[b] <=
  MP * S``, 0 allowed): request ``b``'s own tokens after its group's prefix.

Semantics.  Row ``b`` in group ``g`` attends over the concatenation (shared tokens ``0 ..
group_lens[g] - 1`` of ``group_pages[g]``) + (its ``suffix_lens[b]`` suffix tokens).  The engine
guarantees page alignment: a group's shared part is full pages (a chain node's, or prefix-cache
hits), so ``group_lens[g]`` is a multiple of ``S`` and any partial page belongs to the suffix.
Then the result equals ``paged_decode_attention`` over the page list ``group_pages[g] +
suffix_table[b]`` with length ``group_lens[g] + suffix_lens[b]``.  (The kernel itself does not
need the alignment: for an unaligned length it still computes the concatenation above, which is
what the reference checks.)  A row with no keys at all gives zeros.  Unused slots may hold
anything, even NaN: masked keys get ``-inf`` scores and zeroed V rows.

The single-group form ``shared_prefix_decode_attention`` (``shared_pages [Ps]``, ``shared_len``,
``shared_rows [B] bool``) is the case ``G = 1``.

Algorithm.

1. Row layout (jnp, a few small ops).  ``q`` is regrouped per KV head as query rows (``Gq =
   Hq // Hkv`` per request: row = (request, head ``h * Gq + j``)), and the members of each group
   are packed contiguously into row blocks of ``block_rows`` rows (a power of two >= 16), every
   block holding rows of one group only: group ``g`` with ``c_g`` members takes
   ``cdiv(c_g * Gq, block_rows)`` blocks, in group order.  Rows outside every group take none.
   The grid has a static ``NB = floor(B * Gq / block_rows) + min(G, B)`` blocks, enough for any
   membership; the unused ones have length 0.  Each block's page list (``[NB, Ps]``, its group's
   row of the table) and length (``[NB]``) are gathered from the group table.
2. Shared part (Pallas, Triton style).  Grid ``(NB, Hkv, num_splits)``, row blocks fastest
   (dim 0 varies fastest on launch), so the programs of one group that read the same K/V tile run
   side by side and share it through L2.  Program ``(r, h, s)`` loads its ``[block_rows, D]``
   query tile once (from step 1's packed copy; ``INFERSCALE_SHARED_Q=kernel`` gathers the rows from ``q`` itself
   instead, measured slower: bench/NOTES.md run BC), walks its split of block ``r``'s shared range (the block's own length cut into
   ``num_splits`` equal runs of whole tiles, so a short group or a wide padded page list leaves no
   split idle while another does all the work) in ``block_kv``-token tiles
   gathered through the block's page list (slots ``page * S + offset``; the next tile's slots are
   computed during the current one), full tiles unmasked, the one tile crossing the length masked;
   online softmax in fp32, base 2.  A program past its block's length (an unused block, a split
   beyond a short group) does no tile at all.  It writes the unnormalised partial ``o`` and its
   ``m``/``l`` (fp32).  Each shared K/V tile of group ``g`` is therefore read
   ``cdiv(c_g * Gq, block_rows)`` times per KV head instead of ``c_g`` times.
3-5, as the engine's decode steps run them (``fused_merge=True``, the default): the suffix part
   (``paged_decode_attention(..., init=...)``) starts each request's online softmax from its rows'
   shared partials, the splits merged in its prologue, so its normalised output is already the
   whole row's attention: no jnp step between the two kernels (the gather of the partials, the split
   merge, the lse merge: ~0.9 ms of a 32-layer 256-row step before, bench/NOTES.md run AA).  The
   partials are allocated a query tile longer than the packed rows (never written) so the suffix
   kernel reads a whole tile from any member's first row.  ``fused_merge=False``, and
   :func:`grouped_shared_prefix_attention` (whose callers merge with other parts), take steps 3-5
   apart:
3. A jnp step merges the splits and gathers each member's rows back: ``o_shared [B, Hq, D]``
   (fp32, normalised) and ``lse_shared [B, Hq]`` (natural log; ``-inf`` outside every group or for
   an empty prefix).
4. Suffix part: ``paged_decode_attention(..., return_lse=True)`` on ``suffix_table`` /
   ``suffix_lens`` (natural-log lse, ``-inf`` and zeros for an empty suffix).
5. Merge (jnp, fp32): ``out = (e^(lse_sh - M) o_sh + e^(lse_sf - M) o_sf) / (e^(lse_sh - M) +
   e^(lse_sf - M))`` with ``M = max(lse_sh, lse_sf)``; zeros where both are empty.  Output in
   ``q``'s dtype.  (The suffix output arrives rounded to ``q``'s dtype: a bf16 rounding of one
   merge term, well inside the bf16 tolerance.)

``block_rows`` default: 128 (64 for fp32: a 128-row fp32 tile spills) with one group; with
``G > 1``, ``next_pow2(cdiv(B * Gq, G))`` within ``[32, 128]`` (64 for fp32): many small groups
get small blocks, so a block's padding rows cost no matmul work beyond what its members need.

``grouped_cascade_decode_attention_ref`` (and ``shared_prefix_decode_attention_ref``) is the
pure-jnp reference (per-row gather of the full token list, mask, fp32 softmax); kernel and
reference call :func:`check_grouped_inputs` (the single-group pair also
:func:`check_shared_prefix_inputs`).
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
from pallas_kernels.decode_attention import check_decode_inputs, paged_decode_attention, query_tile_rows
from pallas_kernels.quant import fold_probs, fold_scores, gather_pages, pv_dtype

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30  # finite running-max start: empty programs stay NaN-free
_PREC = lax.Precision.HIGHEST  # fp32: IEEE matmul on Triton (DEFAULT = TF32); no-op for bf16
PROGRAMS_PER_SM = 2  # shared-part programs are matmul tiles, heavier than decode's
MIN_BLOCKS_PER_SPLIT = 4
SHARED_BLOCK_KV = 64  # the shared part's default K/V tile (tokens)


def check_grouped_inputs(q, k_pages, v_pages, group_pages, group_lens, row_group, suffix_table,
                         suffix_lens, k_scale=None, v_scale=None) -> tuple[int, ...]:
    """Validate the multi-group functions' inputs; return (B, Hq, Hkv, Gq, P, S, D, G, Ps, MP).

    Length and group *values* are checked too when concrete (eager calls), skipped under jit."""
    b, hq, hkv, gq, p, s, d, mp = check_decode_inputs(q, k_pages, v_pages, suffix_table,
                                                      suffix_lens, k_scale, v_scale)
    if group_pages.ndim != 2 or not jnp.issubdtype(group_pages.dtype, jnp.integer):
        common._fail("group_pages", f"{group_pages.dtype}{list(group_pages.shape)}",
                     "a 2-D int32 group table [G, Ps]")
    g, ps = (int(x) for x in group_pages.shape)
    common.check_int_vector("group_lens", group_lens, g)
    common.check_int_vector("row_group", row_group, b)
    if common.is_concrete(group_lens, row_group, suffix_lens):
        glens, rg, lens = np.asarray(group_lens), np.asarray(row_group), np.asarray(suffix_lens)
        if ((glens < 0) | (glens > ps * s)).any():
            common._fail("group_lens", glens.tolist(), f"values in [0, Ps * S = {ps} * {s}]")
        if ((rg < -1) | (rg >= g)).any():
            common._fail("row_group", rg.tolist(), f"values in [-1, G = {g}) (-1: no group)")
        if ((lens < 0) | (lens > mp * s)).any():
            common._fail("suffix_lens", lens.tolist(),
                         f"values in [0, MP * S = {mp * s}] (widen suffix_table)")
    return b, hq, hkv, gq, p, s, d, g, ps, mp


def check_shared_prefix_inputs(q, k_pages, v_pages, shared_pages, shared_len, suffix_table,
                               suffix_lens, shared_rows=None, k_scale=None, v_scale=None) -> tuple[int, ...]:
    """Validate the single-group functions' inputs; return (B, Hq, Hkv, Gq, P, S, D, Ps, MP).

    Length *values* are checked too when concrete (eager calls), skipped under jit."""
    b, hq, hkv, gq, p, s, d, mp = check_decode_inputs(q, k_pages, v_pages, suffix_table,
                                                      suffix_lens, k_scale, v_scale)
    if shared_pages.ndim != 1 or not jnp.issubdtype(shared_pages.dtype, jnp.integer):
        common._fail("shared_pages", f"{shared_pages.dtype}{list(shared_pages.shape)}",
                     "a 1-D int32 page list [Ps]")
    shared_len = jnp.asarray(shared_len)
    if shared_len.ndim != 0 or not jnp.issubdtype(shared_len.dtype, jnp.integer):
        common._fail("shared_len", f"{shared_len.dtype}{list(shared_len.shape)}",
                     "an int32 scalar (array)")
    if shared_rows is not None and (shared_rows.shape != (b,) or not (
            shared_rows.dtype == jnp.bool_ or jnp.issubdtype(shared_rows.dtype, jnp.integer))):
        common._fail("shared_rows", f"{shared_rows.dtype}{list(shared_rows.shape)}",
                     f"a bool (or 0/1 int) vector [B = {b}]")
    ps = int(shared_pages.shape[0])
    if common.is_concrete(shared_len):
        n = int(shared_len)
        if not 0 <= n <= ps * s:
            common._fail("shared_len", n, f"0 <= shared_len <= Ps * S = {ps} * {s}")
    return b, hq, hkv, gq, p, s, d, ps, mp


def as_group_table(shared_pages, shared_len, shared_rows, b: int):
    """The single-group inputs as a group table of ``G = 1``: (group_pages [1, Ps], group_lens [1],
    row_group [B]) int32."""
    rows = jnp.ones((b,), bool) if shared_rows is None else shared_rows.astype(bool)
    return (jnp.asarray(shared_pages, jnp.int32)[None], jnp.reshape(jnp.asarray(shared_len, jnp.int32), (1,)),
            jnp.where(rows, 0, -1).astype(jnp.int32))


def auto_num_splits(programs: int, max_blocks: int) -> int:
    """Splits of the shared range so ~PROGRAMS_PER_SM programs per SM, >= 4 tiles per split."""
    if programs >= common.num_sms():
        return 1
    want = pl.cdiv(PROGRAMS_PER_SM * common.num_sms(), programs)
    return int(max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT)))


def num_row_blocks(b: int, gq: int, g: int, block_rows: int) -> int:
    """Static row blocks of the shared part: enough for any membership of ``b`` requests (``gq``
    query rows each) in ``g`` groups, each group's rows in whole blocks of its own."""
    return (b * gq) // block_rows + min(g, b)


def default_block_rows(b: int, gq: int, g: int, dtype) -> int:
    """Query rows per shared-part program (module docstring): the cap (128; 64 for fp32) for one
    group, else the average rows of a group rounded up to a power of two, within [32, cap]."""
    cap = 64 if jnp.dtype(dtype).itemsize >= 4 else 128  # fp32: a 128-row tile spills
    if g <= 1:
        return cap
    per_group = pl.cdiv(b * gq, g)
    return int(min(cap, max(32, 1 << max(0, per_group - 1).bit_length())))


def row_layout(row_group, group_pages, group_lens, *, gq: int, block_rows: int):
    """Where each request's query rows go in the shared part's packed row blocks (step 1).

    Returns (dest [B] int32: the first packed row of request b, ``NB * block_rows`` outside every
    group; block_pages [NB, Ps] int32; block_lens [NB] int32: 0 for unused blocks)."""
    g, ps = group_pages.shape
    b = row_group.shape[0]
    nb = num_row_blocks(b, gq, g, block_rows)
    rg = row_group.astype(jnp.int32)  # [B]
    in_group = (rg >= 0) & (rg < g)  # [B]
    member = (rg[:, None] == jnp.arange(g, dtype=jnp.int32)[None, :])  # [B, G] bool
    rank = jnp.cumsum(member, axis=0, dtype=jnp.int32) - 1  # [B, G]: rank among the group's members
    rg_c = jnp.clip(rg, 0, g - 1)
    rank = jnp.take_along_axis(rank, rg_c[:, None], axis=1)[:, 0]  # [B]
    blocks = pl.cdiv(jnp.sum(member, axis=0, dtype=jnp.int32) * gq, block_rows)  # [G] blocks of each group
    ends = jnp.cumsum(blocks, dtype=jnp.int32)  # [G] end block (exclusive) of each group
    first = ends - blocks  # [G]
    dest = jnp.where(in_group, first[rg_c] * block_rows + rank * gq, nb * block_rows)  # [B]
    blk = jnp.arange(nb, dtype=jnp.int32)
    block_group = jnp.searchsorted(ends, blk, side="right").astype(jnp.int32)  # [NB], G past the last
    used = block_group < g
    bg = jnp.clip(block_group, 0, g - 1)
    block_lens = jnp.where(used, group_lens.astype(jnp.int32)[bg], 0)  # [NB]
    block_pages = group_pages.astype(jnp.int32)[bg]  # [NB, Ps]
    return dest.astype(jnp.int32), block_pages, block_lens.astype(jnp.int32)


def _shared_kernel(
    shared_len_ref,  # [1] int32
    pages_ref,  # [Ps] int32
    *refs,  # q_ref [R, D] query rows of one kv head, or with q_source (src_ref [R] int32: each packed row's
    #         query row b * Gq + j, B * Gq for none; q_ref [B * Hq, D] every query row); k_ref, v_ref [P*S, D]
    #         (head h, all pages); (ks_ref, vs_ref [P*S] fp32 when quantized), o_ref [R, D] fp32 unnormalised
    #         partial, m_ref [R] fp32 running max (log2 units), l_ref [R] fp32 sum
    quantized: bool,
    page_size: int,
    block_kv: int,
    num_splits: int,
    scale_log2: float,
    prefetch: bool,
    normalise: bool = False,
    q_source: tuple[int, int] | None = None,
):
    if q_source:  # (Gq, Hq): the block's query rows gathered here from every query row
        src_ref, q_ref, k_ref, v_ref, *refs = refs
        gq, hq = q_source
        src = src_ref[...]  # [R] query row b * Gq + j of each packed row; past the last: none (zeros)
        n_rows = q_ref.shape[0] // hq * gq
        has = src < n_rows
        at = (src // gq) * hq + pl.program_id(1) * gq + src % gq  # [R] row of q [B * Hq, D]
        q = q_ref[jnp.where(has, at, 0)]  # [R, D]
        q = jnp.where(has[:, None], q, jnp.zeros_like(q))
    else:
        q_ref, k_ref, v_ref, *refs = refs
        q = q_ref[...]  # [R, D]
    scale_refs, (o_ref, m_ref, l_ref) = (refs[:2], refs[2:]) if quantized else ((), refs)
    split = pl.program_id(2)
    rows, d = q.shape
    num_shared = pages_ref.shape[0]
    num_pages = k_ref.shape[0] // page_size
    length = jnp.minimum(shared_len_ref[0], num_shared * page_size)
    split_tokens = pl.cdiv(pl.cdiv(length, block_kv), num_splits) * block_kv  # this block's own split size
    tok_start = split * split_tokens
    span = jnp.maximum(jnp.minimum(tok_start + split_tokens, length) - tok_start, 0)
    n_full = span // block_kv  # tiles entirely below shared_len
    n_total = pl.cdiv(span, block_kv)
    offs = jnp.arange(block_kv, dtype=jnp.int32)  # [BK]
    log2_s = page_size.bit_length() - 1

    def slots_of(i):  # [BK] cache slots of tile i of this split (clamped: always in bounds)
        tok = tok_start + i * block_kv + offs
        page_idx = jnp.minimum(lax.shift_right_logical(tok, log2_s), num_shared - 1)
        page = jnp.clip(pages_ref[page_idx], 0, num_pages - 1)
        return lax.shift_left(page, log2_s) + (tok & (page_size - 1))

    def body(i, carry, masked: bool):
        o, m, l, *nxt = carry  # [R, D], [R], [R] fp32; with prefetch [BK] slots of tile i
        slot = nxt[0] if prefetch else slots_of(i)
        k = k_ref[slot]  # [BK, D]
        v = v_ref[slot]
        if scale_refs:  # compressed pages: exact convert; the scales fold into scores and probs (quant.py)
            ks, vs = scale_refs[0][slot], scale_refs[1][slot]
            k, v = k.astype(q.dtype), v.astype(pv_dtype(q.dtype))
        nxt = (slots_of(i + 1),) if prefetch else ()  # off the critical path of the next iteration
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_PREC,
                                 preferred_element_type=jnp.float32)  # [R, BK]
        if scale_refs:
            logits = fold_scores(logits, ks)
        logits = logits * scale_log2
        valid = None
        if masked:
            valid = tok_start + i * block_kv + offs < length  # [BK]
            logits = jnp.where(valid[None, :], logits, -jnp.inf)
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # stale/NaN slots
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        p = jnp.exp2(logits - m_new[:, None])
        corr = jnp.exp2(m - m_new)
        l_new = l * corr + jnp.sum(p, axis=1)
        w = fold_probs(p, vs, valid) if scale_refs else p
        pv = lax.dot_general(w.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_PREC,
                             preferred_element_type=jnp.float32)  # [R, D]
        return o * corr[:, None] + pv, m_new, l_new, *nxt

    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32), *((slots_of(0),) if prefetch else ()))
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    o, m, l = lax.fori_loop(n_full, n_total, functools.partial(body, masked=True), carry)[:3]

    if normalise:  # (o / l in o_ref's dtype, m + log2 l, 1): the same merge weights, half the bytes of o
        has = l > 0
        o = jnp.where(has[:, None], o / jnp.where(has, l, 1.0)[:, None], 0.0)
        m = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), m)
        l = has.astype(jnp.float32)

    @pl.when(shared_len_ref[0] > 0)  # an unused block (or an empty prefix) stores nothing: no reader
    def _():
        o_ref[...] = o.astype(o_ref.dtype)
        m_ref[...] = m
        l_ref[...] = l


def _shared_partials(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, *, sm_scale,
                     block_rows, block_kv, num_splits, num_warps, num_stages, interpret, real_groups=None,
                     real_rows=None, pad_rows=0, prefetch=None, partials="fp32",
                     q_rows="gather"):
    """The shared kernel's launch (algorithm steps 1-2): (o [Hkv, NS, Rp + pad, D], m, l [Hkv, NS,
    Rp + pad] fp32 partials of the packed rows, m in base 2; idx [B * Gq] each query row's packed
    row, Rp outside every group; stored [B * Gq] bool: its block wrote partials).  ``pad_rows``
    more rows at the end (never written) let a reader take a whole tile from any member's row.
    ``partials="q_dtype"`` (``INFERSCALE_SHARED_PARTIALS``, read by the public wrappers) with 16-bit ``q``: ``o``
    normalised in ``q``'s dtype, ``m`` the base-2 lse, ``l`` 1 (0 without keys): the same merge, half of ``o``'s
    bytes (``common.shared_partials``).  ``q_rows="kernel"`` (``INFERSCALE_SHARED_Q``): each program gathers its
    packed rows' queries from ``q`` itself through the packed rows' sources, instead of reading a packed copy of
    ``q`` that a jnp gather wrote first (``"gather"``)."""
    b, hq, d = q.shape
    hkv, p, s, _ = k_pages.shape
    gq = hq // hkv
    g, ps = group_pages.shape
    nb = num_row_blocks(b, gq, g, block_rows)
    rows_p = nb * block_rows
    pad_rows = pl.cdiv(pad_rows, block_rows) * block_rows  # (whole blocks: the outputs' blocks divide them)
    dest, block_pages, block_lens = row_layout(row_group, group_pages, group_lens, gq=gq,
                                               block_rows=block_rows)
    idx = (dest[:, None] + jnp.arange(gq, dtype=jnp.int32)[None, :]).reshape(b * gq)  # [B*Gq] packed rows
    # packed row -> its query row (b * gq: none, a zero row): a small int scatter, then one gather of q
    # (scattering q itself into the packed rows took ~0.35 ms per 32-layer step, bench/NOTES.md run AK)
    src = jnp.full((rows_p,), b * gq, jnp.int32).at[idx].set(jnp.arange(b * gq, dtype=jnp.int32), mode="drop")
    if q_rows == "kernel":  # the kernel gathers each packed row's query from q [B * Hq, D] (a free view)
        q_in, q_specs = (src, q.reshape(b * hq, d)), [
            pl.BlockSpec((block_rows,), lambda r, h, t: (r,)),  # the block's rows' sources
            pl.BlockSpec((b * hq, d), lambda r, h, t: (0, 0))]  # every query row, whole (gathered from)
    elif q_rows == "gather":
        qr = q.reshape(b, hkv, gq, d).transpose(1, 0, 2, 3).reshape(hkv, b * gq, d)  # [Hkv, B*Gq, D]
        qp = jnp.concatenate([qr, jnp.zeros((hkv, 1, d), q.dtype)], axis=1)[:, src]  # [Hkv, Rp, D]
        q_in, q_specs = (qp,), [pl.BlockSpec((None, block_rows, d), lambda r, h, t: (h, r, 0))]  # query rows
    else:
        common._fail("q_rows", q_rows, f"one of {list(common.SHARED_Q_CHOICES)}")
    max_blocks = pl.cdiv(ps * s, block_kv)
    if num_splits is None:  # programs that hold rows: ~ the rows' blocks, at least one per group
        busy = max(pl.cdiv((b if real_rows is None else min(real_rows, b)) * gq, block_rows),
                   min(g if real_groups is None else real_groups, b))
        num_splits = 1 if interpret else auto_num_splits(busy * hkv, max_blocks)
    if num_splits < 1:
        common._fail("num_splits", num_splits, ">= 1 (or None for auto)")
    num_splits = min(num_splits, max_blocks)  # (a split holds at least one tile)

    quantized = k_scale is not None
    prefetch = common.slot_prefetch() if prefetch is None else prefetch
    normalise = partials == "q_dtype" and q.dtype.itemsize == 2
    kernel = functools.partial(_shared_kernel, quantized=quantized, page_size=s, block_kv=block_kv, prefetch=prefetch,
                               num_splits=num_splits, scale_log2=float(sm_scale) * _LOG2E, normalise=normalise,
                               q_source=(gq, hq) if q_rows == "kernel" else None)
    per_head = pl.BlockSpec((None, p * s, d), lambda r, h, t: (h, 0, 0))
    scales, scale_specs = (), []
    if quantized:  # each head's [P*S] scales, whole
        scales = (k_scale.reshape(hkv, p * s), v_scale.reshape(hkv, p * s))
        scale_specs = [pl.BlockSpec((None, p * s), lambda r, h, t: (h, 0))] * 2
    o, m, l = pl.pallas_call(
        kernel,
        grid=(nb, hkv, num_splits),  # row blocks fastest: a group's K/V tiles shared in L2
        in_specs=[
            pl.BlockSpec((1,), lambda r, h, t: (r,)),  # the block's shared length
            pl.BlockSpec((None, ps), lambda r, h, t: (r, 0)),  # the block's shared page list
            *q_specs, per_head, per_head, *scale_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_rows, d), lambda r, h, t: (h, t, r, 0)),
            pl.BlockSpec((None, None, block_rows), lambda r, h, t: (h, t, r)),
            pl.BlockSpec((None, None, block_rows), lambda r, h, t: (h, t, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((hkv, num_splits, rows_p + pad_rows, d), q.dtype if normalise else jnp.float32),
            jax.ShapeDtypeStruct((hkv, num_splits, rows_p + pad_rows), jnp.float32),  # m (log2)
            jax.ShapeDtypeStruct((hkv, num_splits, rows_p + pad_rows), jnp.float32),  # l
        ],
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"cascade_shared_g{g}_r{block_rows}_bk{block_kv}_sp{num_splits}" + ("_nq" if normalise else "")
        + ("_qk" if q_rows == "kernel" else ""),
    )(block_lens, block_pages, *q_in, k_pages.reshape(hkv, p * s, d), v_pages.reshape(hkv, p * s, d), *scales)
    at = jnp.minimum(idx, rows_p - 1)  # [B*Gq] (rows outside every group: masked by `stored`)
    # rows whose block stored its partials (a block of length 0 stores nothing: its rows hold garbage)
    stored = (idx < rows_p) & (block_lens[at // block_rows] > 0)  # [B*Gq]
    return o, m, l, idx, stored


def _shared_part(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, **kw):
    """(o_shared [B, Hq, D] fp32 normalised, lse_shared [B, Hq] fp32 natural log, -inf outside
    every group) of every group's shared prefix, in one launch (algorithm steps 1-3)."""
    o, m, l, idx, stored = _shared_partials(q, k_pages, v_pages, group_pages, group_lens, row_group,
                                            k_scale, v_scale, **kw)
    return merge_partials((first_rows(idx, stored, q.shape[0]), o, m, l), q.shape[1])


def first_rows(idx, stored, b: int):
    """[B] each row's first packed row in the shared partials (its query heads follow), -1 where its block
    stored none (outside every group, or an empty prefix)."""
    return jnp.where(stored.reshape(b, -1)[:, 0], idx.reshape(b, -1)[:, 0], -1)


def merge_partials(init, num_q_heads: int):
    """Split partials ``(row [B], o [Hkv, NS, R, D], m, l [Hkv, NS, R])`` (row ``b``'s query head ``h * Gq + j``
    at packed row ``row[b] + j`` of kv head ``h``, ``row[b] < 0``: none; ``o`` unnormalised fp32, or normalised
    16-bit with ``m`` its base-2 lse and ``l`` 1) merged per row (jnp): (o [B, Hq, D] fp32 normalised, lse [B, Hq]
    natural log; zeros and ``-inf`` for a row without partials or with no key in them)."""
    row, o, m, l = init
    hkv, _, rows, d = o.shape
    b, group = row.shape[0], num_q_heads // hkv
    at = jnp.clip(row.astype(jnp.int32)[:, None] + jnp.arange(group, dtype=jnp.int32)[None, :], 0, rows - 1)
    at = at.reshape(-1)
    o, m, l = o[:, :, at].astype(jnp.float32), m[:, :, at], l[:, :, at]  # [Hkv, NS, B*Gq(, D)]
    top = jnp.max(m, axis=1)
    w = jnp.exp2(m - top[:, None])
    l_tot, o_tot = jnp.sum(l * w, axis=1), jnp.sum(o * w[..., None], axis=1)  # [Hkv, B*Gq(, D)]

    def per_row(x):  # [Hkv, B * Gq, ...] -> [B, Hq, ...]
        x = x.reshape(hkv, b, group, *x.shape[2:])
        return jnp.swapaxes(x, 0, 1).reshape(b, num_q_heads, *x.shape[3:])
    l_tot, top, o_tot = per_row(l_tot), per_row(top), per_row(o_tot)
    has = (row >= 0)[:, None] & (l_tot > 0)  # [B, Hq]
    safe = jnp.where(has, l_tot, 1.0)
    return (jnp.where(has[..., None], o_tot / safe[..., None], 0.0),
            jnp.where(has, (top + jnp.log2(safe)) * _LN2, -jnp.inf))


def merge_lse(o_a, lse_a, o_b, lse_b):
    """Merge two normalised partial attentions by their natural-log lse ([..., D], [...]).

    Returns (o fp32, lse); rows where both are empty (-inf) give zeros and -inf."""
    mx = jnp.maximum(lse_a, lse_b)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    wa, wb = jnp.exp(lse_a - mx), jnp.exp(lse_b - mx)  # 0 for an empty part
    tot = wa + wb
    o = (wa[..., None] * o_a.astype(jnp.float32) + wb[..., None] * o_b.astype(jnp.float32))
    o = o / jnp.where(tot > 0, tot, 1.0)[..., None]
    lse = jnp.where(tot > 0, mx + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    return o, lse


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_rows", "block_kv", "num_splits", "num_warps", "num_stages", "interpret", "real_groups",
    "real_rows", "prefetch", "partials", "q_rows"))
def _shared_only(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, **kw):
    return _shared_part(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, **kw)


def grouped_shared_prefix_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    group_pages: jax.Array,  # [G, Ps] int32
    group_lens: jax.Array,  # [G] int32
    row_group: jax.Array,  # [B] int32, -1: no group
    *,
    sm_scale: float | None = None,
    block_rows: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    real_groups: int | None = None,
    real_rows: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:  # o [B, Hq, D] float32, lse [B, Hq] float32
    """The shared part alone (algorithm steps 1-3): each row's attention over its group's shared
    prefix only, normalised, with its natural-log log-sum-exp; zeros and ``-inf`` for a row outside
    every group or with an empty prefix.  A caller that has the suffix part's output and lse from
    elsewhere merges the two with :func:`merge_lse` (the engine's mixed steps under
    ``INFERSCALE_MIXED_MERGE=jnp``; by default they hand :func:`grouped_shared_prefix_partials` to the ragged
    kernel instead).  Knobs as :func:`grouped_cascade_decode_attention`'s shared part;
    ``real_groups`` (a bound on the groups that hold rows, when the table is padded to a bucket)
    sizes the automatic split count from the groups that exist, not the padding; ``real_rows`` (a
    bound on the rows in groups, when ``B`` counts padding, e.g. a mixed step's flat tokens) likewise."""
    if 0 in group_pages.shape:
        _shared_knobs(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale)  # (the checks)
        return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:2], -jnp.inf, jnp.float32)
    return _shared_call(_shared_only, q, k_pages, v_pages, group_pages, group_lens, row_group, sm_scale=sm_scale,
                        block_rows=block_rows, block_kv=block_kv, num_splits=num_splits, num_warps=num_warps,
                        num_stages=num_stages, interpret=interpret, real_groups=real_groups, real_rows=real_rows,
                        k_scale=k_scale, v_scale=v_scale)


def _shared_knobs(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, *, sm_scale=None,
                  block_rows=None, block_kv=None, num_warps=None, num_stages=None, interpret=None) -> dict:
    """Check the shared part's inputs and fill its knobs' defaults (module docstring)."""
    b, hq, hkv, gq, p, s, d, g, ps, mp = check_grouped_inputs(
        q, k_pages, v_pages, group_pages, group_lens, row_group, jnp.zeros((q.shape[0], 1), jnp.int32),
        jnp.zeros((q.shape[0],), jnp.int32), k_scale, v_scale)
    common.check_power_of_two("page_size", s)
    common.check_power_of_two("head_dim", d, common.MIN_DOT_DIM)
    block_rows = default_block_rows(b, gq, g, q.dtype) if block_rows is None else block_rows
    common.check_power_of_two("block_rows", block_rows, common.MIN_DOT_DIM)
    block_kv = SHARED_BLOCK_KV if block_kv is None else block_kv
    common.check_power_of_two("block_kv", block_kv, common.MIN_DOT_DIM)
    one_block = g <= 1 and b * gq <= block_rows
    num_warps = (8 if one_block else 4) if num_warps is None else num_warps
    num_stages = common.stages_for(3 if one_block else 2, common.slot_prefetch()) if num_stages is None else num_stages
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    interpret = common.default_interpret() if interpret is None else interpret
    return dict(sm_scale=sm_scale, block_rows=block_rows, block_kv=block_kv, num_warps=num_warps,
                num_stages=num_stages, interpret=interpret, prefetch=common.slot_prefetch(),
                partials=common.shared_partials(), q_rows=common.shared_q_rows())  # (the switches as static
    # arguments: they key the jits)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_rows", "block_kv", "num_splits", "num_warps", "num_stages", "interpret", "real_groups",
    "real_rows", "prefetch", "partials", "q_rows"))
def _partials_only(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, **kw):
    o, m, l, idx, stored = _shared_partials(q, k_pages, v_pages, group_pages, group_lens, row_group,
                                            k_scale, v_scale, **kw)
    return first_rows(idx, stored, q.shape[0]), o, m, l


def grouped_shared_prefix_partials(q, k_pages, v_pages, group_pages, group_lens, row_group, **knobs):
    """The shared part's raw split partials (algorithm steps 1-2), for a kernel that continues each row's
    attention from them (``ragged_paged_attention``'s ``init``; the decode kernel's ``init`` takes the same
    form, but reads a whole query tile from each row and so needs the buffers padded past the last row, which
    :func:`grouped_cascade_decode_attention` does itself): ``(row [B] int32, o [Hkv, NS, R, D], m [Hkv, NS, R],
    l [Hkv, NS, R] fp32)``, row ``b``'s query head ``h * Gq + j`` at packed row ``row[b] + j`` of kv head
    ``h``; ``o`` unnormalised, ``m`` the base-2 running max of the scaled scores (or, under
    ``INFERSCALE_SHARED_PARTIALS=q_dtype`` with 16-bit ``q``, ``o`` normalised in ``q``'s dtype, ``m`` its base-2
    lse, ``l`` 1); ``row[b] = -1`` outside every group or for an empty prefix.  Inputs and keyword knobs as
    :func:`grouped_shared_prefix_attention`; the group table must not be empty."""
    if 0 in group_pages.shape:
        common._fail("group_pages.shape", tuple(group_pages.shape), "[G >= 1, Ps >= 1] (no group: call the "
                     "suffix kernel without init)")
    return _shared_call(_partials_only, q, k_pages, v_pages, group_pages, group_lens, row_group, **knobs)


def _shared_call(fn, q, k_pages, v_pages, group_pages, group_lens, row_group, *, num_splits=None, real_groups=None,
                 real_rows=None, k_scale=None, v_scale=None, **knobs):
    """``fn`` (a jitted launch of the shared part) with the inputs checked and the knobs' defaults filled."""
    knobs = _shared_knobs(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, **knobs)
    return fn(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, num_splits=num_splits,
              real_groups=real_groups, real_rows=real_rows, **knobs)


def grouped_shared_prefix_attention_ref(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    group_pages: jax.Array,  # [G, Ps] int32
    group_lens: jax.Array,  # [G] int32
    row_group: jax.Array,  # [B] int32, -1: no group
    *,
    sm_scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    **unused_knobs,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`grouped_shared_prefix_attention`: per row, gather its group's
    shared tokens, mask, fp32 softmax; (o [B, Hq, D] float32, lse [B, Hq] natural log)."""
    del unused_knobs
    b, hq, hkv, gq, p, s, d, g, ps, _ = check_grouped_inputs(
        q, k_pages, v_pages, group_pages, group_lens, row_group, jnp.zeros((q.shape[0], 1), jnp.int32),
        jnp.zeros((q.shape[0],), jnp.int32), k_scale, v_scale)
    if 0 in group_pages.shape:
        return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:2], -jnp.inf, jnp.float32)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    hi = lax.Precision.HIGHEST
    rg = row_group.astype(jnp.int32)
    in_group = (rg >= 0) & (rg < g)
    rg_c = jnp.clip(rg, 0, g - 1)
    n = jnp.where(in_group, group_lens.astype(jnp.int32)[rg_c], 0)  # [B]
    valid = jnp.arange(ps * s)[None, :] < n[:, None]  # [B, Ps*S]

    def gather(pages, scale):  # [B, Hkv, Ps*S, D] fp32, invalid rows 0 (unused slots may hold NaN)
        x = gather_pages(pages, scale, group_pages.astype(jnp.int32)[rg_c]).reshape(hkv, b, ps * s, d)
        return jnp.where(valid[:, None, :, None], jnp.swapaxes(x, 0, 1), 0.0)
    k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
    logits = jnp.einsum("bhgd,bhtd->bhgt", q.reshape(b, hkv, gq, d).astype(jnp.float32), k, precision=hi) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    mx = jnp.max(logits, axis=-1, keepdims=True, initial=-1e30)
    e = jnp.exp(logits - mx)
    tot = jnp.sum(e, axis=-1, keepdims=True)
    has = tot > 0
    o = jnp.einsum("bhgt,bhtd->bhgd", e / jnp.where(has, tot, 1.0), v, precision=hi)
    lse = jnp.where(has, mx + jnp.log(jnp.where(has, tot, 1.0)), -jnp.inf)
    return o.reshape(b, hq, d), lse.reshape(b, hq)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_rows", "block_kv", "num_splits", "suffix_num_splits", "num_warps",
    "num_stages", "interpret", "fused_merge", "prefetch", "real_groups", "partials", "q_rows"))
def _cascade(q, k_pages, v_pages, group_pages, group_lens, row_group, suffix_table, suffix_lens,
             k_scale, v_scale, *, sm_scale, block_rows, block_kv, num_splits, suffix_num_splits,
             num_warps, num_stages, interpret, fused_merge, prefetch, real_groups=None, partials="fp32",
             q_rows="gather"):
    if 0 in group_pages.shape:  # no group or no shared page at all: plain decode
        return paged_decode_attention(q, k_pages, v_pages, suffix_table, suffix_lens, sm_scale=sm_scale,
                                      num_splits=suffix_num_splits, interpret=interpret, k_scale=k_scale,
                                      v_scale=v_scale, prefetch=prefetch)
    knobs = dict(sm_scale=sm_scale, block_rows=block_rows, block_kv=block_kv, num_splits=num_splits,
                 num_warps=num_warps, num_stages=num_stages, interpret=interpret, prefetch=prefetch,
                 real_groups=real_groups, partials=partials, q_rows=q_rows)
    if fused_merge:  # steps 3-5 in the suffix kernel: it starts from each row's shared partials
        gq = q.shape[1] // k_pages.shape[0]
        o, m, l, idx, stored = _shared_partials(q, k_pages, v_pages, group_pages, group_lens, row_group,
                                                k_scale, v_scale, pad_rows=query_tile_rows(gq), **knobs)
        row = first_rows(idx, stored, q.shape[0])
        return paged_decode_attention(q, k_pages, v_pages, suffix_table, suffix_lens, sm_scale=sm_scale,
                                      num_splits=suffix_num_splits, interpret=interpret, k_scale=k_scale,
                                      v_scale=v_scale, init=(row, o, m, l), prefetch=prefetch)
    o_sf, lse_sf = paged_decode_attention(q, k_pages, v_pages, suffix_table, suffix_lens,
                                          sm_scale=sm_scale, num_splits=suffix_num_splits,
                                          interpret=interpret, return_lse=True, k_scale=k_scale, v_scale=v_scale,
                                          prefetch=prefetch)
    o_sh, lse_sh = _shared_part(q, k_pages, v_pages, group_pages, group_lens, row_group, k_scale, v_scale, **knobs)
    out, _ = merge_lse(o_sh, lse_sh, o_sf, lse_sf)
    return out.astype(q.dtype)


def grouped_cascade_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    group_pages: jax.Array,  # [G, Ps] int32: each group's shared page list
    group_lens: jax.Array,  # [G] int32, 0 <= group_lens <= Ps * S (engine: multiples of S)
    row_group: jax.Array,  # [B] int32: each row's group, -1 for none
    suffix_table: jax.Array,  # [B, MP] int32
    suffix_lens: jax.Array,  # [B] int32, 0 <= suffix_lens <= MP * S
    *,
    sm_scale: float | None = None,
    block_rows: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    suffix_num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    fused_merge: bool = True,
    prefetch: bool | None = None,
    real_groups: int | None = None,
) -> jax.Array:  # [B, Hq, D], dtype of q
    """Decode attention over each row's group prefix + its own suffix (see the module docstring).
    Compressed pages: ``k_scale`` / ``v_scale [Hkv, P, S]`` float32, tiles converted to q's dtype,
    the scales folded into scores and probabilities (quant.py).

    Knobs of the shared part: ``block_rows`` query rows per program (power of two >= 16; default
    :func:`default_block_rows`), ``block_kv`` tokens per tile (power of two >= 16, default 64),
    ``num_splits`` of the shared range (None: fill the GPU ~2 programs per SM; 1 in interpret
    mode), ``num_warps`` / ``num_stages`` (default 8 / 3 when one row block holds all
    ``B * Hq/Hkv`` rows of a single group, else 4 / 2).  ``suffix_num_splits`` goes to the decode
    kernel (None: auto).  ``real_groups`` (a bound on the groups that hold rows, when the group
    table is padded to a bucket) sizes the automatic split count from them, as in
    :func:`grouped_shared_prefix_attention`.  ``prefetch`` (both kernels): each loop carries its
    next tile's page slots (True) or computes a tile's slots in its own iteration (False); None:
    :func:`pallas_kernels.common.slot_prefetch`.  Eager calls also check the length and group
    values (one host sync); under jit only shapes are."""
    b, hq, hkv, gq, p, s, d, g, ps, mp = check_grouped_inputs(
        q, k_pages, v_pages, group_pages, group_lens, row_group, suffix_table, suffix_lens, k_scale, v_scale)
    common.check_power_of_two("page_size", s)
    common.check_power_of_two("head_dim", d, common.MIN_DOT_DIM)
    # single-group defaults from the H200 sweep (bench/NOTES.md, `bench/kernels/kernels.py --sections f
    # --tune`): 128-row tiles won at B*Gq = 32, 128 and 512 (even 3/4 padding: the tile is
    # matmul-bound only at large B*Gq); 8 warps / 3 stages while one row block covers the batch
    if block_rows is None:
        block_rows = default_block_rows(b, gq, g, q.dtype)
    common.check_power_of_two("block_rows", block_rows, common.MIN_DOT_DIM)
    block_kv = SHARED_BLOCK_KV if block_kv is None else block_kv
    common.check_power_of_two("block_kv", block_kv, common.MIN_DOT_DIM)
    one_block = g <= 1 and b * gq <= block_rows
    if num_warps is None:
        num_warps = 8 if one_block else 4
    prefetch = common.slot_prefetch() if prefetch is None else prefetch
    if num_stages is None:  # (without the carry: at least 3, common.stages_for)
        num_stages = common.stages_for(3 if one_block else 2, prefetch)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    interpret = common.default_interpret() if interpret is None else interpret
    return _cascade(q, k_pages, v_pages, group_pages, group_lens, row_group, suffix_table, suffix_lens,
                    k_scale, v_scale, sm_scale=sm_scale, block_rows=block_rows, block_kv=block_kv,
                    num_splits=num_splits, suffix_num_splits=suffix_num_splits, num_warps=num_warps,
                    num_stages=num_stages, interpret=interpret, fused_merge=fused_merge, prefetch=prefetch,
                    real_groups=real_groups, partials=common.shared_partials(), q_rows=common.shared_q_rows())


def grouped_cascade_decode_attention_ref(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    group_pages: jax.Array,  # [G, Ps] int32
    group_lens: jax.Array,  # [G] int32
    row_group: jax.Array,  # [B] int32, -1: no group
    suffix_table: jax.Array,  # [B, MP] int32
    suffix_lens: jax.Array,  # [B] int32
    *,
    sm_scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    **unused_knobs,
) -> jax.Array:  # [B, Hq, D]
    """Pure-jnp reference: per row, gather its group's shared tokens + its suffix, mask, fp32
    softmax (compressed pages dequantized to float32 first; the kernel folds the scales instead,
    equal up to rounding).  The kernel's tuning arguments are accepted and ignored."""
    del unused_knobs
    b, hq, hkv, gq, p, s, d, g, ps, mp = check_grouped_inputs(
        q, k_pages, v_pages, group_pages, group_lens, row_group, suffix_table, suffix_lens, k_scale, v_scale)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    hi = lax.Precision.HIGHEST
    rg = row_group.astype(jnp.int32)
    in_group = (rg >= 0) & (rg < g)  # [B]
    if g == 0:  # (no table rows to gather from)
        group_pages, group_lens = jnp.zeros((1, ps), jnp.int32), jnp.zeros((1,), jnp.int32)
    rg_c = jnp.clip(rg, 0, max(g, 1) - 1)
    row_pages = group_pages.astype(jnp.int32)[rg_c]  # [B, Ps]
    row_shared = jnp.where(in_group, group_lens.astype(jnp.int32)[rg_c], 0)  # [B]
    shared_ok = jnp.arange(ps * s)[None, :] < row_shared[:, None]  # [B, Ps*S]
    suffix_ok = jnp.arange(mp * s)[None, :] < suffix_lens[:, None]  # [B, MP*S]
    valid = jnp.concatenate([shared_ok, suffix_ok], axis=1)

    def gather(pages, scale):  # [Hkv, P, S, D] -> [B, Hkv, Ps*S + MP*S, D] fp32, invalid rows 0
        sh = gather_pages(pages, scale, row_pages).reshape(hkv, b, ps * s, d)
        sf = gather_pages(pages, scale, suffix_table).reshape(hkv, b, mp * s, d)
        x = jnp.swapaxes(jnp.concatenate([sh, sf], axis=2), 0, 1)
        return jnp.where(valid[:, None, :, None], x, 0.0)  # unused slots may hold NaN
    k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
    qf = q.reshape(b, hkv, gq, d).astype(jnp.float32)
    logits = jnp.einsum("bhgd,bhtd->bhgt", qf, k, precision=hi) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    wsum = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhgt,bhtd->bhgd", e / jnp.where(wsum > 0, wsum, 1.0), v, precision=hi)
    return out.reshape(b, hq, d).astype(q.dtype)


def shared_prefix_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    shared_pages: jax.Array,  # [Ps] int32
    shared_len: jax.Array,  # [] int32, 0 <= shared_len <= Ps * S (engine: a multiple of S)
    suffix_table: jax.Array,  # [B, MP] int32
    suffix_lens: jax.Array,  # [B] int32, 0 <= suffix_lens <= MP * S
    shared_rows: jax.Array | None = None,  # [B] bool: rows that read the prefix (None: all)
    **knobs,
) -> jax.Array:  # [B, Hq, D], dtype of q
    """One shared prefix: :func:`grouped_cascade_decode_attention` with ``G = 1`` (its knobs;
    ``k_scale`` / ``v_scale`` for compressed pages)."""
    b = check_shared_prefix_inputs(q, k_pages, v_pages, shared_pages, shared_len, suffix_table, suffix_lens,
                                   shared_rows, knobs.get("k_scale"), knobs.get("v_scale"))[0]
    return grouped_cascade_decode_attention(q, k_pages, v_pages,
                                            *as_group_table(shared_pages, shared_len, shared_rows, b),
                                            suffix_table, suffix_lens, **knobs)


def shared_prefix_decode_attention_ref(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    shared_pages: jax.Array,  # [Ps] int32
    shared_len: jax.Array,  # [] int32
    suffix_table: jax.Array,  # [B, MP] int32
    suffix_lens: jax.Array,  # [B] int32
    shared_rows: jax.Array | None = None,  # [B] bool
    **knobs,
) -> jax.Array:  # [B, Hq, D]
    """The reference of :func:`shared_prefix_decode_attention`: the grouped reference, ``G = 1``."""
    b = check_shared_prefix_inputs(q, k_pages, v_pages, shared_pages, shared_len, suffix_table, suffix_lens,
                                   shared_rows, knobs.get("k_scale"), knobs.get("v_scale"))[0]
    return grouped_cascade_decode_attention_ref(q, k_pages, v_pages,
                                                *as_group_table(shared_pages, shared_len, shared_rows, b),
                                                suffix_table, suffix_lens, **knobs)
