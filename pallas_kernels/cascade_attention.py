"""Shared-prefix (cascade) decode attention: many decoding rows over one shared context.

Problem.  When ``B`` decoding requests share one long context (a 4k-token segment), the paged
decode kernel reads the shared pages once *per request*: ``B`` times per step.  Cascade
attention splits each row's keys into the shared prefix and its own suffix, attends the
prefix for the whole batch at once (each shared K/V tile read once per *row block*), attends
the suffix with the ordinary decode kernel, and merges the two with their log-sum-exps.

Inputs (one layer; page layout as in :mod:`pallas_kernels.common`):

* ``q [B, Hq, D]``: one query token per request.
* ``k_pages, v_pages [Hkv, P, S, D]``.
* ``shared_pages [Ps] int32`` and ``shared_len`` (int32 scalar array, ``0 <= shared_len <=
  Ps * S``): the shared prefix is positions ``0 .. shared_len - 1`` of the page list.
  ``shared_len == 0`` (or ``Ps == 0``) is allowed: the result is plain paged decode.
* ``suffix_table [B, MP] int32`` and ``suffix_lens [B] int32`` (``0 <= suffix_lens[b] <=
  MP * S``, 0 allowed): request ``b``'s own tokens after the prefix.
* ``shared_rows [B] bool`` (optional, default all): the rows that read the prefix.  A row
  outside the group attends to its suffix only (the engine gives it its whole page list), so
  one batch can mix the requests of one shared context with any others.

Semantics.  Row ``b`` attends over the concatenation (shared tokens ``0 .. shared_len - 1``)
+ (its ``suffix_lens[b]`` suffix tokens).  The engine guarantees page alignment: the shared
part is the *full* pages of a chain node, so ``shared_len`` is a multiple of ``S`` and any
partial page belongs to the suffix.  Then the result equals ``paged_decode_attention`` over
the page list ``shared_pages + suffix_table[b]`` with length ``shared_len + suffix_lens[b]``.
(The kernel itself does not need the alignment: for an unaligned ``shared_len`` it still
computes the concatenation above, which is what the reference checks.)  A row with no keys
at all gives zeros.  Unused slots may hold anything, even NaN: masked keys get ``-inf``
scores and zeroed V rows.

Algorithm.

1. Shared part (Pallas, Triton style).  ``q`` is regrouped per KV head as
   ``[Hkv, B * G, D]`` (``G = Hq // Hkv``; row ``r`` = request ``r // G``, head
   ``h * G + r % G``) and padded to a multiple of ``block_rows`` rows (a power of two >= 16,
   default 128; 64 for fp32).  Grid
   ``(row_blocks, Hkv, num_splits)``, row blocks fastest (dim 0 varies fastest on launch), so
   the programs that read the same K/V tile run side by side and share it through L2.
   Program ``(r, h, s)`` loads its ``[block_rows, D]`` query tile once, walks its split of the
   shared range in ``block_kv``-token tiles gathered through ``shared_pages`` (slots
   ``page * S + offset``; the next tile's slots are computed during the current one), full
   tiles unmasked, the one tile crossing ``shared_len`` masked; online softmax in fp32, base 2.
   It writes the unnormalised partial ``o`` and its ``m``/``l`` (fp32).  Each shared K/V tile
   is therefore read ``B * G / block_rows`` times per KV head instead of ``B`` times.
2. A jnp step merges the splits into ``o_shared [B, Hq, D]`` (fp32, normalised) and
   ``lse_shared [B, Hq]`` (natural log, ``-inf`` when ``shared_len == 0``).
3. Suffix part: ``paged_decode_attention(..., return_lse=True)`` on ``suffix_table`` /
   ``suffix_lens`` (natural-log lse, ``-inf`` and zeros for an empty suffix).
4. Merge (jnp, fp32; rows outside ``shared_rows`` get ``lse_sh = -inf``):
   ``out = (e^(lse_sh - M) o_sh + e^(lse_sf - M) o_sf) / (e^(lse_sh - M) + e^(lse_sf - M))`` with ``M = max(lse_sh, lse_sf)``; zeros where both are empty.  Output in
   ``q``'s dtype.  (The suffix output arrives rounded to ``q``'s dtype: a bf16 rounding of
   one merge term, well inside the bf16 tolerance.)

``shared_prefix_decode_attention_ref`` is the pure-jnp reference (per-row gather of the full
token list, mask, fp32 softmax); both call :func:`check_shared_prefix_inputs`.
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
from pallas_kernels.decode_attention import check_decode_inputs, paged_decode_attention
from pallas_kernels.quant import fold_probs, fold_scores, gather_pages, pv_dtype

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30  # finite running-max start: empty programs stay NaN-free
_PREC = lax.Precision.HIGHEST  # fp32: IEEE matmul on Triton (DEFAULT = TF32); no-op for bf16
PROGRAMS_PER_SM = 2  # shared-part programs are matmul tiles, heavier than decode's
MIN_BLOCKS_PER_SPLIT = 4


def check_shared_prefix_inputs(q, k_pages, v_pages, shared_pages, shared_len, suffix_table,
                               suffix_lens, shared_rows=None, k_scale=None, v_scale=None) -> tuple[int, ...]:
    """Validate both functions' inputs; return (B, Hq, Hkv, G, P, S, D, Ps, MP).

    Length *values* are checked too when concrete (eager calls), skipped under jit.
    """
    b, hq, hkv, g, p, s, d, mp = check_decode_inputs(q, k_pages, v_pages, suffix_table,
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
    if common.is_concrete(shared_len, suffix_lens):
        n, lens = int(shared_len), np.asarray(suffix_lens)
        if not 0 <= n <= ps * s:
            common._fail("shared_len", n, f"0 <= shared_len <= Ps * S = {ps} * {s}")
        if ((lens < 0) | (lens > mp * s)).any():
            common._fail("suffix_lens", lens.tolist(),
                         f"values in [0, MP * S = {mp * s}] (widen suffix_table)")
    return b, hq, hkv, g, p, s, d, ps, mp


def auto_num_splits(programs: int, max_blocks: int) -> int:
    """Splits of the shared range so ~PROGRAMS_PER_SM programs per SM, >= 4 tiles per split."""
    if programs >= common.num_sms():
        return 1
    want = pl.cdiv(PROGRAMS_PER_SM * common.num_sms(), programs)
    return int(max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT)))


def _shared_kernel(
    shared_len_ref,  # [1] int32
    pages_ref,  # [Ps] int32
    q_ref,  # [R, D] query rows of one kv head
    k_ref,  # [P*S, D] (head h, all pages)
    v_ref,  # [P*S, D]
    *refs,  # (ks_ref, vs_ref [P*S] fp32 when quantized), o_ref [R, D] fp32 unnormalised partial,
    #         m_ref [R] fp32 running max (log2 units), l_ref [R] fp32 sum
    quantized: bool,
    page_size: int,
    block_kv: int,
    split_tokens: int,
    scale_log2: float,
):
    scale_refs, (o_ref, m_ref, l_ref) = (refs[:2], refs[2:]) if quantized else ((), refs)
    split = pl.program_id(2)
    rows, d = q_ref.shape
    q = q_ref[...]  # [R, D]
    num_shared = pages_ref.shape[0]
    num_pages = k_ref.shape[0] // page_size
    length = jnp.minimum(shared_len_ref[0], num_shared * page_size)
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
        o, m, l, slot = carry  # [R, D], [R], [R] fp32; [BK] slots of tile i
        k = k_ref[slot]  # [BK, D]
        v = v_ref[slot]
        if scale_refs:  # compressed pages: exact convert; the scales fold into scores and probs (quant.py)
            ks, vs = scale_refs[0][slot], scale_refs[1][slot]
            k, v = k.astype(q.dtype), v.astype(pv_dtype(q.dtype))
        next_slot = slots_of(i + 1)  # off the critical path of the next iteration
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
        return o * corr[:, None] + pv, m_new, l_new, next_slot

    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32), slots_of(0))
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    o, m, l, _ = lax.fori_loop(n_full, n_total, functools.partial(body, masked=True), carry)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _shared_part(q, k_pages, v_pages, shared_pages, shared_len, k_scale, v_scale, *, sm_scale, block_rows,
                 block_kv, num_splits, num_warps, num_stages, interpret):
    """(o_shared [B, Hq, D] fp32 normalised, lse_shared [B, Hq] fp32 natural log)."""
    b, hq, d = q.shape
    hkv, p, s, _ = k_pages.shape
    g = hq // hkv
    ps = shared_pages.shape[0]
    n_rows = b * g
    rows_p = pl.cdiv(n_rows, block_rows) * block_rows
    qr = q.reshape(b, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, n_rows, d)  # [Hkv, B*G, D]
    if rows_p != n_rows:
        qr = jnp.pad(qr, ((0, 0), (0, rows_p - n_rows), (0, 0)))  # [Hkv, Rp, D]
    row_blocks = rows_p // block_rows
    max_blocks = pl.cdiv(ps * s, block_kv)
    if num_splits is None:
        num_splits = 1 if interpret else auto_num_splits(row_blocks * hkv, max_blocks)
    if num_splits < 1:
        common._fail("num_splits", num_splits, ">= 1 (or None for auto)")
    split_tokens = pl.cdiv(max_blocks, num_splits) * block_kv
    num_splits = pl.cdiv(ps * s, split_tokens)  # drop splits that could never hold tokens

    quantized = k_scale is not None
    kernel = functools.partial(_shared_kernel, quantized=quantized, page_size=s, block_kv=block_kv,
                               split_tokens=split_tokens, scale_log2=float(sm_scale) * _LOG2E)
    per_head = pl.BlockSpec((None, p * s, d), lambda r, h, t: (h, 0, 0))
    scales, scale_specs = (), []
    if quantized:  # each head's [P*S] scales, whole
        scales = (k_scale.reshape(hkv, p * s), v_scale.reshape(hkv, p * s))
        scale_specs = [pl.BlockSpec((None, p * s), lambda r, h, t: (h, 0))] * 2
    o, m, l = pl.pallas_call(
        kernel,
        grid=(row_blocks, hkv, num_splits),  # row blocks fastest: K/V tiles shared in L2
        in_specs=[
            pl.BlockSpec((1,), lambda r, h, t: (0,)),  # shared_len
            pl.BlockSpec((ps,), lambda r, h, t: (0,)),  # shared page list: whole
            pl.BlockSpec((None, block_rows, d), lambda r, h, t: (h, r, 0)),  # query rows
            per_head, per_head, *scale_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_rows, d), lambda r, h, t: (h, t, r, 0)),
            pl.BlockSpec((None, None, block_rows), lambda r, h, t: (h, t, r)),
            pl.BlockSpec((None, None, block_rows), lambda r, h, t: (h, t, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((hkv, num_splits, rows_p, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((hkv, num_splits, rows_p), jnp.float32),  # m (log2)
            jax.ShapeDtypeStruct((hkv, num_splits, rows_p), jnp.float32),  # l
        ],
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"shared_prefix_decode_r{block_rows}_bk{block_kv}_sp{num_splits}",
    )(jnp.reshape(shared_len, (1,)).astype(jnp.int32), shared_pages.astype(jnp.int32), qr,
      k_pages.reshape(hkv, p * s, d), v_pages.reshape(hkv, p * s, d), *scales)
    m_max = jnp.max(m, axis=1)  # [Hkv, Rp]
    w = jnp.exp2(m - m_max[:, None])  # [Hkv, NS, Rp]
    l_tot = jnp.sum(l * w, axis=1)  # [Hkv, Rp]
    o_tot = jnp.sum(o * w[..., None], axis=1)  # [Hkv, Rp, D]
    has = l_tot > 0
    o_sh = o_tot / jnp.where(has, l_tot, 1.0)[..., None]
    lse = jnp.where(has, (m_max + jnp.log2(jnp.where(has, l_tot, 1.0))) * _LN2, -jnp.inf)

    def per_row(x):  # [Hkv, Rp, ...] -> [B, Hq, ...]
        x = x[:, :n_rows].reshape(hkv, b, g, *x.shape[2:])
        return jnp.swapaxes(x, 0, 1).reshape(b, hq, *x.shape[3:])
    return per_row(o_sh), per_row(lse)


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
    "sm_scale", "block_rows", "block_kv", "num_splits", "suffix_num_splits", "num_warps",
    "num_stages", "interpret"))
def _cascade(q, k_pages, v_pages, shared_pages, shared_len, suffix_table, suffix_lens,
             shared_rows, k_scale, v_scale, *, sm_scale, block_rows, block_kv, num_splits, suffix_num_splits,
             num_warps, num_stages, interpret):
    o_sf, lse_sf = paged_decode_attention(q, k_pages, v_pages, suffix_table, suffix_lens,
                                          sm_scale=sm_scale, num_splits=suffix_num_splits,
                                          interpret=interpret, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    if shared_pages.shape[0] == 0:  # no shared prefix at all: plain decode
        return o_sf
    o_sh, lse_sh = _shared_part(q, k_pages, v_pages, shared_pages, shared_len, k_scale, v_scale,
                                sm_scale=sm_scale, block_rows=block_rows, block_kv=block_kv,
                                num_splits=num_splits, num_warps=num_warps,
                                num_stages=num_stages, interpret=interpret)
    if shared_rows is not None:  # rows outside the group: their suffix is their whole context
        lse_sh = jnp.where(shared_rows.astype(bool)[:, None], lse_sh, -jnp.inf)
    out, _ = merge_lse(o_sh, lse_sh, o_sf, lse_sf)
    return out.astype(q.dtype)


def shared_prefix_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    shared_pages: jax.Array,  # [Ps] int32
    shared_len: jax.Array,  # [] int32, 0 <= shared_len <= Ps * S (engine: a multiple of S)
    suffix_table: jax.Array,  # [B, MP] int32
    suffix_lens: jax.Array,  # [B] int32, 0 <= suffix_lens <= MP * S
    shared_rows: jax.Array | None = None,  # [B] bool: rows that read the prefix (None: all)
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
) -> jax.Array:  # [B, Hq, D], dtype of q
    """Decode attention over a shared prefix + per-row suffixes (see the module docstring).
    Compressed pages: ``k_scale`` / ``v_scale [Hkv, P, S]`` float32, tiles converted to q's dtype,
    the scales folded into scores and probabilities (quant.py).

    Knobs of the shared part: ``block_rows`` query rows per program (power of two >= 16;
    default 128, 64 for fp32), ``block_kv`` tokens per tile (power of two >= 16, default 64),
    ``num_splits`` of the shared range (None: fill the GPU ~2 programs per SM; 1 in interpret
    mode), ``num_warps`` / ``num_stages`` (default 8 / 3 when one row block holds all
    ``B * Hq/Hkv`` rows, else 4 / 2).  ``suffix_num_splits`` goes to the decode kernel (None: auto).
    Eager calls also check the length values (one host sync); under jit only shapes are.
    """
    b, hq, hkv, g, p, s, d, ps, mp = check_shared_prefix_inputs(
        q, k_pages, v_pages, shared_pages, shared_len, suffix_table, suffix_lens, shared_rows, k_scale, v_scale)
    common.check_power_of_two("page_size", s)
    common.check_power_of_two("head_dim", d, common.MIN_DOT_DIM)
    # defaults from the H200 sweep (bench/NOTES.md, `bench/kernels.py --sections f --tune`):
    # 128-row tiles won at B*G = 32, 128 and 512 (even 3/4 padding: the tile is matmul-bound
    # only at large B*G); 8 warps / 3 stages while one row block covers the batch, else 4 / 2
    if block_rows is None:
        block_rows = 64 if q.dtype.itemsize >= 4 else 128  # fp32: a 128-row tile spills
    common.check_power_of_two("block_rows", block_rows, common.MIN_DOT_DIM)
    block_kv = 64 if block_kv is None else block_kv
    common.check_power_of_two("block_kv", block_kv, common.MIN_DOT_DIM)
    one_block = b * g <= block_rows
    if num_warps is None:
        num_warps = 8 if one_block else 4
    if num_stages is None:
        num_stages = 3 if one_block else 2
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    interpret = common.default_interpret() if interpret is None else interpret
    return _cascade(q, k_pages, v_pages, shared_pages, jnp.asarray(shared_len, jnp.int32),
                    suffix_table, suffix_lens, shared_rows, k_scale, v_scale, sm_scale=sm_scale,
                    block_rows=block_rows,
                    block_kv=block_kv, num_splits=num_splits,
                    suffix_num_splits=suffix_num_splits, num_warps=num_warps,
                    num_stages=num_stages, interpret=interpret)


def shared_prefix_decode_attention_ref(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    shared_pages: jax.Array,  # [Ps] int32
    shared_len: jax.Array,  # [] int32
    suffix_table: jax.Array,  # [B, MP] int32
    suffix_lens: jax.Array,  # [B] int32
    shared_rows: jax.Array | None = None,  # [B] bool
    *,
    sm_scale: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    **unused_knobs,
) -> jax.Array:  # [B, Hq, D]
    """Pure-jnp reference: per row, gather shared + suffix tokens, mask, fp32 softmax (compressed
    pages dequantized to float32 first; the kernel folds the scales instead, equal up to rounding).

    The kernel's tuning arguments are accepted and ignored (one call site for both)."""
    del unused_knobs
    b, hq, hkv, g, p, s, d, ps, mp = check_shared_prefix_inputs(
        q, k_pages, v_pages, shared_pages, shared_len, suffix_table, suffix_lens, shared_rows, k_scale, v_scale)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    hi = lax.Precision.HIGHEST
    shared_ok = jnp.broadcast_to(jnp.arange(ps * s) < jnp.asarray(shared_len), (b, ps * s))
    if shared_rows is not None:
        shared_ok = shared_ok & shared_rows.astype(bool)[:, None]  # [B, Ps*S]
    suffix_ok = jnp.arange(mp * s)[None, :] < suffix_lens[:, None]  # [B, MP*S]
    valid = jnp.concatenate([shared_ok, suffix_ok], axis=1)

    def gather(pages, scale):  # [Hkv, P, S, D] -> [B, Hkv, Ps*S + MP*S, D] fp32, invalid rows 0
        sh = gather_pages(pages, scale, shared_pages).reshape(hkv, 1, ps * s, d)
        sf = gather_pages(pages, scale, suffix_table).reshape(hkv, b, mp * s, d)
        x = jnp.concatenate([jnp.broadcast_to(sh, (hkv, b, ps * s, d)), sf], axis=2)
        x = jnp.swapaxes(x, 0, 1)
        return jnp.where(valid[:, None, :, None], x, 0.0)  # unused slots may hold NaN
    k, v = gather(k_pages, k_scale), gather(v_pages, v_scale)
    qf = q.reshape(b, hkv, g, d).astype(jnp.float32)
    logits = jnp.einsum("bhgd,bhtd->bhgt", qf, k, precision=hi) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    wsum = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhgt,bhtd->bhgd", e / jnp.where(wsum > 0, wsum, 1.0), v, precision=hi)
    return out.reshape(b, hq, d).astype(q.dtype)
