"""Ragged paged attention (flat token batch, per-row query lengths): the Pallas kernel
(interpret mode on CPU) against its jnp reference, the reference against an independent
float64 numpy dense attention and against the padded prefill / decode references.

Every case draws fresh random inputs from its own seed.  The page pool is poisoned: every slot
that does not hold a valid token (the null page 0, spare pages, the tail of each row's last
page) is NaN, and so are the padding tokens of ``q`` (index >= cu_q_lens[R]); a kernel that
reads any of them unmasked, or leaves an output row unwritten (interpret mode fills unwritten
outputs with NaN: see test_kernels_prefill.test_interpret_mode_poisons_unwritten_outputs),
produces NaN and fails.  Padding tokens must come out as exact zeros.
"""

from __future__ import annotations

import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.decode_attention import paged_decode_attention_ref
from pallas_kernels.prefill_attention import _choose_blocks, paged_prefill_attention_ref
from pallas_kernels.ragged_attention import (
    _auto_kv_splits, _default_kv_splits,
    _block_bound,
    _split_plan,
    _block_meta,
    _META,
    _small_tile,
    check_ragged_inputs,
    ragged_paged_attention,
    ragged_paged_attention_ref,
)

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
_seeds = itertools.count(2000)


def make_case(*, q_lens, cached, pad=0, Hq, Hkv, D, S, dtype, spare_pages=3, extra_cols=1,
              seed=None):
    """Random ragged step over a shuffled, NaN-poisoned page pool.

    Rows ``r`` get ``q_lens[r]`` new tokens over ``cached[r]`` cached ones; ``pad`` padding
    tokens follow the last row.  Returns (kernel args, float64 copies: q [N, Hq, D] and per
    row K/V [Hkv, kv_len, D])."""
    rng = np.random.default_rng(next(_seeds) if seed is None else seed)
    q_lens, cached = np.asarray(q_lens, np.int32), np.asarray(cached, np.int32)
    kv_lens = cached + q_lens
    R = len(q_lens)
    need = -(-kv_lens // S)  # pages per row
    max_pages = int(need.max(initial=0)) + extra_cols  # padded entries point at the null page
    P = 1 + int(need.sum()) + spare_pages
    ids = rng.permutation(np.arange(1, P))  # scattered, never the null page 0
    table = np.zeros((R, max_pages), np.int32)
    off = 0
    for r in range(R):
        table[r, : need[r]] = ids[off : off + need[r]]
        off += need[r]

    def rounded(x):  # values exactly representable in dtype, as float64
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)

    k_seq = [rounded(rng.standard_normal((Hkv, L, D))) for L in kv_lens]
    v_seq = [rounded(rng.standard_normal((Hkv, L, D))) for L in kv_lens]
    k_pages = np.full((Hkv, P, S, D), np.nan, np.float32)
    v_pages = np.full((Hkv, P, S, D), np.nan, np.float32)
    for r, L in enumerate(kv_lens):
        pos = np.arange(L)
        k_pages[:, table[r, pos // S], pos % S] = k_seq[r]
        v_pages[:, table[r, pos // S], pos % S] = v_seq[r]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    N = int(cu[-1]) + pad
    q = rounded(rng.standard_normal((N, Hq, D)))
    q[cu[-1]:] = np.nan  # padding tokens: must not matter
    args = (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(table), jnp.asarray(cu), jnp.asarray(kv_lens))
    return args, (q, k_seq, v_seq)


def dense_attention_f64(q, k_seq, v_seq, cu, sm_scale):
    """Per row: causal attention of its tokens over [cached + new] keys, numpy float64."""
    N, Hq, D = q.shape
    out = np.zeros((N, Hq, D))
    for r in range(len(cu) - 1):
        a, b = int(cu[r]), int(cu[r + 1])
        n, L = b - a, k_seq[r].shape[1]
        if n == 0:
            continue
        G = Hq // k_seq[r].shape[0]
        k = np.repeat(k_seq[r], G, axis=0)  # [Hq, L, D]: q head j uses kv head j // G
        v = np.repeat(v_seq[r], G, axis=0)
        s = np.einsum("nhd,hld->hnl", q[a:b], k) * sm_scale
        visible = np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None]  # [n, L]
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[a:b] = np.einsum("hnl,hld->nhd", p, v)
    return out


def check_output(out, args, dtype, **kw):
    """Shape, dtype, every element finite, padding tokens exact zeros, close to the ref."""
    q, *_, cu, _ = args
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "unwritten or NaN-contaminated output"
    assert (out[int(cu[-1]):] == 0).all(), "padding tokens are not zero"
    ref = np.asarray(ragged_paged_attention_ref(*args, **kw).astype(jnp.float32))
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    return out


# ---------------------------------------------------------------- the reference

@pytest.mark.parametrize("Hq,Hkv,S", [(4, 4, 8), (8, 2, 16), (6, 2, 8), (8, 1, 32)])
def test_ref_matches_float64_dense_attention(Hq, Hkv, S):
    """The reference against attention computed independently (numpy float64, no pages)."""
    q_lens, cached = [10, 1, 0, 7, 4, 1], [0, 2 * S, 5, S + 1, 3, 0]
    args, (q, k_seq, v_seq) = make_case(q_lens=q_lens, cached=cached, pad=3, Hq=Hq, Hkv=Hkv,
                                        D=32, S=S, dtype=jnp.float32)
    cu = np.asarray(args[4])
    ref = np.asarray(ragged_paged_attention_ref(*args))
    np.testing.assert_allclose(ref, dense_attention_f64(q, k_seq, v_seq, cu, 1 / math.sqrt(32)),
                               atol=1e-5, rtol=1e-5)
    scaled = np.asarray(ragged_paged_attention_ref(*args, sm_scale=0.3))
    np.testing.assert_allclose(scaled, dense_attention_f64(q, k_seq, v_seq, cu, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_ref_and_kernel_match_padded_prefill_ref():
    """Same data laid out padded [R, T, Hq, D]: the existing prefill reference agrees."""
    q_lens, cached = [5, 0, 12, 1, 3], [9, 4, 16, 30, 0]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=2, Hq=8, Hkv=2, D=32, S=8,
                        dtype=jnp.float32)
    q, kp, vp, table, cu, kv_lens = args
    T = max(q_lens)
    rows = np.zeros((len(q_lens), T), np.int32)  # flat token of (row, i); padding -> token 0
    for r, n in enumerate(q_lens):
        rows[r, :n] = np.arange(cu[r], cu[r] + n)
    q_pad = jnp.where(jnp.asarray(np.arange(T)[None] < np.array(q_lens)[:, None])[..., None, None],
                      q[rows], 0.0)  # [R, T, Hq, D]
    pre = np.asarray(paged_prefill_attention_ref(q_pad, kp, vp, table, jnp.asarray(q_lens),
                                                 kv_lens))
    expect = np.zeros(q.shape, np.float32)
    for r, n in enumerate(q_lens):
        expect[cu[r]:cu[r] + n] = pre[r, :n]
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_ref(*args)), expect,
                               atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ragged_paged_attention(*args)), expect,
                               atol=1e-5, rtol=1e-5)


def test_ref_and_kernel_match_decode_ref():
    """All rows q_len 1: the existing decode reference agrees (q rows are the decode batch)."""
    args, _ = make_case(q_lens=[1] * 6, cached=[0, 7, 8, 40, 15, 100], Hq=8, Hkv=2, D=64, S=16,
                        dtype=jnp.float32)
    q, kp, vp, table, cu, kv_lens = args
    expect = np.asarray(paged_decode_attention_ref(q, kp, vp, table, kv_lens))
    np.testing.assert_allclose(np.asarray(ragged_paged_attention_ref(*args)), expect,
                               atol=1e-6, rtol=1e-6)
    for kw in ({}, dict(kv_splits=3), dict(kv_splits=3, split_longest=False)):
        np.testing.assert_allclose(np.asarray(ragged_paged_attention(*args, **kw)), expect,
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the kernel

def test_kernel_matches_float64_dense_attention():
    q_lens, cached = [16, 1, 9, 0, 2], [0, 17, 16, 3, 40]
    args, (q, k_seq, v_seq) = make_case(q_lens=q_lens, cached=cached, pad=5, Hq=8, Hkv=2, D=64,
                                        S=16, dtype=jnp.float32)
    out = np.asarray(ragged_paged_attention(*args, block_kv=16))
    np.testing.assert_allclose(out, dense_attention_f64(q, k_seq, v_seq, np.asarray(args[4]),
                                                        0.125), atol=1e-5, rtol=1e-5)


# (dtype, Hq, Hkv, D, S, q_lens, cached, pad, kernel kwargs).  With G = Hq // Hkv, blocks of
# at most max(1, 16 // G) tokens take the small tile, longer ones the big tile (block_q tokens).
CASES = [
    # decode rows, chunks crossing pages / block_q, empty rows, padding tokens; both dtypes
    (jnp.bfloat16, 8, 2, 64, 16, [1, 37, 0, 1, 5, 1, 19], [40, 0, 9, 15, 17, 100, 33], 6, {}),
    (jnp.float32, 8, 2, 64, 16, [1, 37, 0, 1, 5, 1, 19], [40, 0, 9, 15, 17, 100, 33], 6, {}),
    # GQA 1 (small tile = 16 tokens), page 8, head_dim 128, no padding
    (jnp.bfloat16, 2, 2, 128, 8, [1, 20, 3, 16, 17], [8, 9, 0, 31, 2], 0, {}),
    # GQA 3 (non power of two: duplicated tile rows), GQA 8 and 16
    (jnp.float32, 6, 2, 64, 16, [1, 16, 6, 5], [40, 16, 3, 0], 3, dict(block_q=8, block_kv=16)),
    (jnp.float32, 8, 1, 32, 8, [2, 9, 1, 24], [64, 31, 0, 8], 1, {}),
    (jnp.bfloat16, 16, 1, 64, 32, [1, 12, 1], [70, 33, 0], 4, {}),
    # non-default blocks: block_kv below the page size / over several pages, tiny block_q
    (jnp.float32, 8, 2, 64, 32, [24, 3, 13, 1], [5, 64, 32, 0], 2, dict(block_q=4, block_kv=16)),
    (jnp.bfloat16, 4, 4, 64, 8, [40, 1, 17], [7, 3, 48], 0, dict(block_q=16, block_kv=32)),
    # split-KV forced: 2..4 splits, including splits with no keys for short rows
    (jnp.bfloat16, 8, 2, 64, 16, [16, 1, 6, 0, 1], [80, 100, 0, 4, 1], 3,
     dict(kv_splits=3, block_kv=16)),
    (jnp.float32, 8, 1, 64, 8, [8, 5, 1], [150, 9, 70], 2, dict(kv_splits=4, block_kv=32)),
    (jnp.float32, 4, 2, 32, 16, [1, 1, 30], [33, 0, 2], 0, dict(kv_splits=2)),
    # tiny N: only the (decode-sized) single tile is compiled
    (jnp.float32, 8, 2, 64, 16, [1, 1], [33, 70], 0, {}),
    # every row empty: all tokens are padding
    (jnp.bfloat16, 8, 2, 64, 16, [0, 0, 0], [5, 0, 17], 7, {}),
    # the small tile's own keys per step (small_block_kv, not its default: bf16 128, fp32 32): several of its
    # blocks per decode row, masked tails, beside a chunk on the big tile; and with split-KV
    # (appended last: tests elsewhere pick the cases above by index)
    (jnp.bfloat16, 8, 2, 64, 16, [1, 1, 37, 1, 0, 1], [100, 7, 20, 64, 3, 31], 5, dict(small_block_kv=16)),
    (jnp.float32, 8, 2, 64, 16, [1, 24, 1, 1], [150, 40, 0, 33], 2, dict(small_block_kv=64, kv_splits=2)),
]


@pytest.mark.parametrize("dtype,Hq,Hkv,D,S,q_lens,cached,pad,kw", CASES)
def test_kernel_matches_ref(dtype, Hq, Hkv, D, S, q_lens, cached, pad, kw):
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=Hq, Hkv=Hkv, D=D, S=S,
                        dtype=dtype)
    out = check_output(ragged_paged_attention(*args, **kw), args, dtype)
    if sum(q_lens) == 0:
        assert (out == 0).all()


@pytest.mark.parametrize("index,kw", [
    (0, {}), (1, {}), (3, dict(return_lse=True)), (8, dict(kv_splits=3, block_kv=16, split_longest=False)),
    (len(CASES) - 2, dict(small_block_kv=16)), (len(CASES) - 3, {}), (len(CASES) - 4, {}),
], ids=["mixed_f32", "mixed_bf16", "lse", "every_block_split", "small_block_kv", "all_padding", "one_tile"])
def test_separate_tile_launches_match_ref(index, kw):
    """``separate_tiles=True``: the big tile's blocks in one launch, the small tile's in a second one writing
    into the first's output; every token (padding ones: zeros) as the reference, the lse too.  (``one_tile``: a
    step so small that only one tile is compiled; the flag changes nothing there.)"""
    dtype, Hq, Hkv, D, S, q_lens, cached, pad, case_kw = CASES[index]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=Hq, Hkv=Hkv, D=D, S=S, dtype=dtype)
    kw = {**case_kw, **kw}
    lse = kw.pop("return_lse", False)
    got = ragged_paged_attention(*args, separate_tiles=True, return_lse=lse, **kw)
    one = ragged_paged_attention(*args, return_lse=lse, **kw)  # one launch
    if lse:
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(one[1]), rtol=1e-5, atol=1e-5)
        got, one = got[0], one[0]
    out = check_output(got, args, dtype)
    np.testing.assert_allclose(out, np.asarray(one, np.float32), rtol=1e-5, atol=1e-5)


def dense_lse_f64(q, k_seq, cu, sm_scale):
    """Per token and q head: the natural-log log-sum-exp of its visible scaled scores (numpy
    float64; -inf for padding tokens)."""
    N, Hq, _ = q.shape
    lse = np.full((N, Hq), -np.inf)
    for r in range(len(cu) - 1):
        a, b = int(cu[r]), int(cu[r + 1])
        n, L = b - a, k_seq[r].shape[1]
        if n == 0:
            continue
        k = np.repeat(k_seq[r], Hq // k_seq[r].shape[0], axis=0)
        s = np.einsum("nhd,hld->hnl", q[a:b], k) * sm_scale
        visible = np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None]
        s = np.where(visible[None], s, -np.inf)
        mx = s.max(-1, keepdims=True)
        lse[a:b] = (mx + np.log(np.exp(s - mx).sum(-1, keepdims=True)))[..., 0].T
    return lse


def test_ref_lse_matches_float64_dense():
    """return_lse: the reference's log-sum-exps against numpy float64; its output is unchanged."""
    args, (q, k_seq, _) = make_case(q_lens=[10, 1, 0, 7, 1], cached=[0, 40, 5, 17, 0], pad=3, Hq=8, Hkv=2,
                                    D=32, S=16, dtype=jnp.float32)
    out, lse = ragged_paged_attention_ref(*args, sm_scale=0.3, return_lse=True)
    assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), dense_lse_f64(q, k_seq, np.asarray(args[4]), 0.3),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ragged_paged_attention_ref(*args, sm_scale=0.3)))


@pytest.mark.parametrize("case", [0, 1, 3, 8, 9, 12])  # both dtypes, GQA 3, forced splits, all padding
def test_kernel_lse_matches_ref(case):
    """return_lse=True (unsplit and split-KV): the kernel's log-sum-exps equal the reference's,
    -inf for padding tokens, and its output equals the plain call's."""
    dtype, Hq, Hkv, D, S, q_lens, cached, pad, kw = CASES[case]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=Hq, Hkv=Hkv, D=D, S=S, dtype=dtype)
    out, lse = ragged_paged_attention(*args, return_lse=True, **kw)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(ragged_paged_attention(*args, **kw).astype(jnp.float32)))
    check_output(out, args, dtype)
    _, ref = ragged_paged_attention_ref(*args, return_lse=True)
    lse, ref = np.asarray(lse), np.asarray(ref)
    n = int(np.asarray(args[4])[-1])
    assert (lse[n:] == -np.inf).all() and np.isfinite(lse[:n]).all()
    np.testing.assert_allclose(lse[:n], ref[:n], atol=1e-4 if dtype == jnp.float32 else 2e-2, rtol=1e-5)


# split_longest: rows long enough to be split (> _LONG_KEYS keys) beside short ones; more long blocks
# than split slots (the rest run whole); a long chunk over many blocks; a long decode row in the small tile
LONG_CASES = [
    (jnp.float32, 8, 2, 32, 16, [1, 40, 1, 3, 1], [700, 600, 20, 900, 5], 3, dict(kv_splits=3, block_kv=16)),
    (jnp.bfloat16, 8, 2, 64, 16, [1] * 9 + [6], [600 + 37 * i for i in range(9)] + [550], 2,
     dict(kv_splits=4, block_q=8, block_kv=32)),
    (jnp.float32, 4, 1, 32, 8, [70, 1], [530, 0], 0, dict(kv_splits=2, block_q=16, block_kv=16)),
    (jnp.bfloat16, 6, 2, 64, 16, [1, 16, 6, 5], [800, 16, 3, 700], 3, dict(kv_splits=3, block_q=8, block_kv=16)),
]


def split_blocks(args, group, D, dtype, kw, *, long_keys) -> int:
    """How many blocks ``split_longest`` splits in the step ``args`` with knobs ``kw`` (its plan, rebuilt)."""
    N, R, S = args[0].shape[0], args[3].shape[0], args[1].shape[2]
    block_q = kw.get("block_q") or _choose_blocks(N, group, D, jnp.dtype(dtype).itemsize, None, None, None, None,
                                                  True)[0]
    nb = _block_bound(N, R, block_q)
    meta = _block_meta(args[4], args[5], num_tokens=N, num_blocks=nb, block_q=block_q,
                       max_pages=args[3].shape[1], capacity=args[3].shape[1] * S)
    slots = min(nb, -(-N // block_q) + 1)
    _, route, words = _split_plan(meta, num_blocks=nb, slots=slots, num_splits=kw["kv_splits"], long_keys=long_keys)
    assert ((np.asarray(route).reshape(-1, 2)[:, 1] >= 0).any()) == (np.asarray(words).reshape(-1, _META)[:, 1] > 0).any()
    return int((np.asarray(words).reshape(-1, _META)[:, 1] > 0).sum())


def kernel_names(fn, *args) -> set[str]:
    """The Pallas kernels ``fn(*args)`` launches, by name (from its jaxpr)."""
    return set(re.findall(r"(ragged_\w+)", str(jax.make_jaxpr(fn)(*args))))


# (the CASES with split_longest past 16 keys, so their blocks split there too, and with every block split)
@pytest.mark.parametrize("case,longest", [(("cases", i), sl) for i in (0, 1, 3, 8, 9, 10, 11, 12) for sl in (True, False)]
                         + [(("long", i), sl) for i in range(len(LONG_CASES)) for sl in (True, False)])
def test_split_forms_match_ref(case, longest):
    """split_longest=True (the default): the blocks that see the most keys split (their partials merged in
    place by the merge kernel), the others whole; False: every block split-KV, merged in jnp.  Output and
    log-sum-exps equal the reference's, every token written (unwritten rows are NaN in interpret mode),
    padding tokens zeros; the long cases really split, in the kernels of the form asked for."""
    table, i = case
    dtype, Hq, Hkv, D, S, q_lens, cached, pad, kw = (CASES if table == "cases" else LONG_CASES)[i]
    kw = {**kw, "kv_splits": kw.get("kv_splits", 2), "split_longest": longest}
    if table == "cases" and longest:
        kw["long_keys"] = 16
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=Hq, Hkv=Hkv, D=D, S=S, dtype=dtype)
    out, lse = ragged_paged_attention(*args, return_lse=True, **kw)
    check_output(out, args, dtype)
    _, ref = ragged_paged_attention_ref(*args, return_lse=True)
    n = int(np.asarray(args[4])[-1])
    lse = np.asarray(lse)
    assert (lse[n:] == -np.inf).all() and np.isfinite(lse[:n]).all()
    np.testing.assert_allclose(lse[:n], np.asarray(ref)[:n], atol=1e-4 if dtype == jnp.float32 else 2e-2, rtol=1e-5)
    plain = ragged_paged_attention(*args, **kw)
    np.testing.assert_array_equal(np.asarray(plain.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))
    names = kernel_names(functools.partial(ragged_paged_attention, **kw), *args)
    longest = any(x.endswith("_sl") for x in names) and any(x.startswith("ragged_merge") for x in names)
    assert longest == kw["split_longest"], names
    if table == "long" or longest and n > 0:  # the case exercises the split blocks (all-padding: none to split)
        assert split_blocks(args, Hq // Hkv, D, dtype, kw, long_keys=kw.get("long_keys", 512)) > 0


def test_split_longest_threshold():
    """long_keys: a row of 300 keys is split with long_keys=200 (the split kernels run and agree with the
    reference) and not with the default 512; a negative threshold is refused by name."""
    args, _ = make_case(q_lens=[1, 20, 1], cached=[300, 5, 40], Hq=8, Hkv=2, D=32, S=16, dtype=jnp.float32)
    kw = dict(kv_splits=3)
    assert split_blocks(args, 4, 32, jnp.float32, kw, long_keys=200) == 1
    assert split_blocks(args, 4, 32, jnp.float32, kw, long_keys=512) == 0
    for long_keys in (200, None):
        out = ragged_paged_attention(*args, kv_splits=3, split_longest=True, long_keys=long_keys)
        check_output(out, args, jnp.float32)
    with pytest.raises(ValueError, match="long_keys"):
        ragged_paged_attention(*args, kv_splits=3, split_longest=True, long_keys=-1)


def test_split_plan_picks_the_blocks_that_see_the_most_keys():
    """The split blocks are the ``slots`` blocks of the most visible keys past long_keys, each once and
    emptied in the whole-block part of the work list; each gets ``num_splits`` programs (splits 0 .. S-1)
    at the end; the other blocks keep their words and route (0, -1)."""
    cu = jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32)  # five decode rows
    kv = jnp.asarray([100, 2000, 600, 513, 3000], jnp.int32)
    meta = _block_meta(cu, kv, num_tokens=8, num_blocks=9, block_q=4, max_pages=256, capacity=4096)
    work, route, words = _split_plan(meta, num_blocks=9, slots=3, num_splits=3, long_keys=512)
    words, route, work = (np.asarray(x).reshape(-1, k) for x, k in ((words, _META), (route, 2), (work, _META)))
    blocks = np.asarray(meta).reshape(-1, _META)
    assert sorted(words[:, 3].tolist()) == [600, 2000, 3000]  # the three longest past 512 (not 513's 4th)
    assert work.shape == (9 + 3 * 3, _META) and (route[:9] == [0, -1]).all()
    split = np.isin(blocks[:, 3], [600, 2000, 3000]) & (blocks[:, 1] > 0)
    assert (work[:9][split, 1] == 0).all() and (work[:9][~split] == blocks[~split]).all()
    assert route[9:, 0].tolist() == [0, 1, 2] * 3 and route[9:, 1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert (work[9:] == np.repeat(words, 3, axis=0)).all()
    kv_short = jnp.asarray([100, 200, 300, 400, 512], jnp.int32)  # none past 512: nothing split
    meta = _block_meta(cu, kv_short, num_tokens=8, num_blocks=9, block_q=4, max_pages=256, capacity=4096)
    work, route, words = _split_plan(meta, num_blocks=9, slots=3, num_splits=3, long_keys=512)
    assert (np.asarray(route).reshape(-1, 2)[:, 1] == -1).all() and (np.asarray(words) == 0).all()
    assert (np.asarray(work).reshape(-1, _META)[:9] == np.asarray(meta).reshape(-1, _META)).all()


def test_split_kv_equals_unsplit_and_custom_scale():
    args, _ = make_case(q_lens=[16, 1, 2, 0], cached=[90, 31, 200, 3], pad=2, Hq=4, Hkv=1, D=64,
                        S=16, dtype=jnp.float32)
    whole = check_output(ragged_paged_attention(*args, kv_splits=1, sm_scale=0.2), args,
                         jnp.float32, sm_scale=0.2)
    for splits, longest in itertools.product((2, 4), (True, False)):
        split = check_output(ragged_paged_attention(*args, kv_splits=splits, sm_scale=0.2, split_longest=longest,
                                                    long_keys=64), args, jnp.float32, sm_scale=0.2)
        np.testing.assert_allclose(split, whole, atol=1e-5, rtol=1e-5)


def test_jit_with_traced_lengths():
    """One compiled step serves different length values of the same shapes (lengths are
    traced, not baked in), and each result is right."""
    traces = []

    def fn(*a):
        traces.append(1)  # runs once per trace, not per call
        return ragged_paged_attention(*a)

    step = jax.jit(fn)
    shape = dict(Hq=8, Hkv=2, D=32, S=8, dtype=jnp.bfloat16)
    a1, _ = make_case(q_lens=[1, 20, 0, 3], cached=[30, 4, 0, 8], pad=4, **shape)
    a2, _ = make_case(q_lens=[9, 1, 1, 16], cached=[0, 12, 40, 2], pad=1, **shape)
    # same array shapes: pad the pools / tables of the smaller case to the larger
    def fit(a, b):
        P = max(a[1].shape[1], b[1].shape[1])
        MP = max(a[3].shape[1], b[3].shape[1])
        grow = lambda x: jnp.pad(x, ((0, 0), (0, P - x.shape[1]), (0, 0), (0, 0)),
                                 constant_values=jnp.nan)
        return (a[0], grow(a[1]), grow(a[2]), jnp.pad(a[3], ((0, 0), (0, MP - a[3].shape[1]))),
                a[4], a[5])
    a1, a2 = fit(a1, a2), fit(a2, a1)
    assert all(x.shape == y.shape for x, y in zip(a1, a2))
    for a in (a1, a2):
        check_output(step(*a), a, jnp.bfloat16)
    assert len(traces) == 1


def test_block_meta_covers_every_token_once():
    """The work list: the static bound suffices for adversarial lengths, every token [0, N)
    is in exactly one block, blocks do not cross rows, positions and offsets are right."""
    rng = np.random.default_rng(7)
    N = 64
    for R, block_q in itertools.product((1, 6), (1, 4, 8, 16)):
        nb = _block_bound(N, R, block_q)
        meta_fn = jax.jit(lambda cu, kv: _block_meta(
            cu, kv, num_tokens=N, num_blocks=nb, block_q=block_q, max_pages=9, capacity=10_000))
        for _ in range(6):
            q_lens = rng.choice([0, 1, 3, block_q, block_q + 1, 2 * block_q - 1], size=R)
            while q_lens.sum() > N:
                q_lens[rng.integers(R)] //= 2
            pad = N - int(q_lens.sum())
            cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            kv = (q_lens + rng.integers(0, 50, size=R)).astype(np.int32)
            assert nb >= sum(-(-n // block_q) for n in q_lens) + -(-pad // block_q)
            meta = np.asarray(meta_fn(jnp.asarray(cu), jnp.asarray(kv))).reshape(nb, _META)
            hits = np.zeros(N, int)
            for tok0, cnt, pos0, kvl, pt_off in meta:
                if cnt == 0:
                    continue
                assert 1 <= cnt <= block_q
                hits[tok0:tok0 + cnt] += 1
                r = int(np.searchsorted(cu, tok0, side="right")) - 1
                if tok0 < cu[R]:  # a real row: inside it, right positions and table row
                    assert tok0 + cnt <= cu[r + 1]
                    assert pos0 == kv[r] - q_lens[r] + (tok0 - cu[r]) and kvl == kv[r]
                    assert pt_off == r * 9
                else:  # padding tokens: no keys
                    assert kvl == 0
            assert (hits == 1).all(), (q_lens, pad, hits)


def test_small_tile_shapes_and_cases_use_both_tiles():
    """Small tile sizes, and the premise of CASES: with the default block sizes the first
    case has blocks for both tiles (decode rows / tails: small; chunk blocks: big)."""
    assert _small_tile(4) == (16, 4) and _small_tile(3) == (16, 5)
    assert _small_tile(32) == (32, 1) and _small_tile(1) == (16, 16)
    dtype, Hq, Hkv, D, S, q_lens, cached, pad, _ = CASES[0]
    N, R = sum(q_lens) + pad, len(q_lens)
    block_q = _choose_blocks(N, Hq // Hkv, D, 2, None, None, None, None, True)[0]
    small_q = _small_tile(Hq // Hkv)[1]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    nb = _block_bound(N, R, block_q)
    meta = np.asarray(_block_meta(cu, jnp.asarray(np.add(q_lens, cached), jnp.int32),
                                  num_tokens=N, num_blocks=nb, block_q=block_q, max_pages=9,
                                  capacity=10_000)).reshape(nb, _META)
    real = meta[(meta[:, 1] > 0) & (meta[:, 3] > 0)]  # blocks of real rows
    assert small_q < block_q
    assert (real[:, 1] <= small_q).any() and (real[:, 1] > small_q).any()


def test_default_kv_splits_fill_the_gpu_only_when_needed():
    sms = common.num_sms()  # 132 off the GPU
    assert _auto_kv_splits(sms, capacity=1 << 20, partial_bytes_per_split=1) == 1
    assert _auto_kv_splits(8, capacity=4096, partial_bytes_per_split=1) == 16  # one decode row
    assert _auto_kv_splits(8, capacity=1 << 20, partial_bytes_per_split=1) == -(-2 * sms // 8)
    assert _auto_kv_splits(8, capacity=300, partial_bytes_per_split=1) == 1  # too short
    assert _auto_kv_splits(8, capacity=1 << 20, partial_bytes_per_split=1 << 21) == 4  # memory (8 MiB)
    assert _auto_kv_splits(8, capacity=1 << 20, partial_bytes_per_split=1 << 26) == 1


def test_default_kv_splits_count_the_real_work_not_the_static_grid():
    sms = common.num_sms()
    per_tok = 32 * 128 * 4  # fp32 partials of 32 q heads, d=128
    # one 64-token question (2 blocks of 32 tokens) in the engine's 64-token, 64-row bucket, 8 kv
    # heads, a 32k-token table: the static grid has 8 * 66 programs, the real work 16: split, as far
    # as the 8 MiB partial budget allows
    assert _default_kv_splits(64, 8, 32, 32768, per_tok) == min(-(-2 * sms // 16), (8 << 20) // (64 * per_tok))
    assert _default_kv_splits(64, 8, 32, 32768, per_tok) > 1
    # a 2048-token chunk is 64 blocks x 8 heads = 512 programs: no split
    assert _default_kv_splits(2048, 8, 32, 32768, per_tok) == 1
    # a short table cannot be split below _MIN_SPLIT_KEYS keys per split
    assert _default_kv_splits(64, 8, 32, 256, per_tok) == 1


# ---------------------------------------------------------------- validation

def _small_args():
    args, _ = make_case(q_lens=[4, 2], cached=[3, 8], pad=1, Hq=4, Hkv=2, D=16, S=8,
                        dtype=jnp.float32)
    return list(args)


@pytest.mark.parametrize("fn", [ragged_paged_attention, ragged_paged_attention_ref])
@pytest.mark.parametrize("change,match", [
    (lambda a: a.__setitem__(4, jnp.array([1, 5, 6], jnp.int32)), "cu_q_lens"),  # cu[0] != 0
    (lambda a: a.__setitem__(4, jnp.array([0, 5, 4], jnp.int32)), "cu_q_lens"),  # decreasing
    (lambda a: a.__setitem__(4, jnp.array([0, 4, 9], jnp.int32)), "cu_q_lens"),  # > N
    (lambda a: a.__setitem__(4, jnp.array([0, 4], jnp.int32)), "cu_q_lens.shape"),
    (lambda a: a.__setitem__(5, jnp.array([3, 10], jnp.int32)), "kv_lens"),  # < q_len
    (lambda a: a.__setitem__(5, jnp.array([7, 99], jnp.int32)), "max_pages"),
    (lambda a: a.__setitem__(0, a[0][:, :3]), "num_q_heads"),
    (lambda a: a.__setitem__(0, a[0][None]), "q.shape"),
    (lambda a: a.__setitem__(0, a[0].astype(jnp.bfloat16)), "q.dtype"),
    (lambda a: a.__setitem__(2, a[2][:, :-1]), "v_pages.shape"),
    (lambda a: a.__setitem__(3, a[3][:1]), "page_table.shape"),
    (lambda a: a.__setitem__(5, a[5].astype(jnp.float32)), "kv_lens.dtype"),
])
def test_validation_errors(fn, change, match):
    a = _small_args()
    change(a)
    with pytest.raises(ValueError, match=match):
        fn(*a)


@pytest.mark.parametrize("kw,match", [
    (dict(block_q=2), "block_q"),  # 2 * G=2 < 16 rows
    (dict(block_kv=48), "block_kv"),
    (dict(kv_splits=0), "kv_splits"),
    (dict(small_block_kv=24), "small_block_kv"),
    (dict(small_block_kv=8), "small_block_kv"),
    (dict(small_block_kv=64.0), "small_block_kv"),
])
def test_block_size_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*_small_args(), **kw)


def test_validator_returns_dims():
    args = _small_args()
    dims = check_ragged_inputs(*args)
    assert dims[4] == args[1].shape[1]  # P: the pool's pages
    assert dims == (7, 2, 4, 2, dims[4], 8, 16)


@pytest.mark.parametrize("kw", [
    dict(),  # auto split-KV from the step's work
    dict(kv_splits=1),
    dict(kv_splits=4, split_longest=False),
    dict(kv_splits=4, split_longest=True),
    dict(kv_splits=4, split_longest=True, return_lse=True, pages=jnp.int8),
    dict(kv_splits=4, split_longest=True, pages=jnp.float8_e4m3fn),
    dict(small_block_kv=64),
    dict(kv_splits=1, separate_tiles=True),
], ids=["auto", "unsplit", "every_block_split", "split_longest", "split_longest_int8_lse", "split_longest_fp8",
        "small_block_kv", "separate_tiles"])
def test_lowers_to_triton(kw):
    """The compiled (non-interpret) path lowers to Triton for CUDA, even on a CPU host: interpret mode
    does not run the Triton lowering, and that lowering refuses things interpret mode accepts (a
    ``jnp.where(bool, int, int)`` scalar, typed i1 there, failed split_longest on the GPU in run AU).
    A mixed step's shape: 61 decode rows and a 64-token chunk, Llama-3-8B heads, 16-token pages."""
    kw = dict(kw)
    pages = kw.pop("pages", jnp.bfloat16)
    sd = jax.ShapeDtypeStruct
    N, R, P, M = 128, 62, 600, 300
    args = (sd((N, 32, 128), jnp.bfloat16), sd((8, P, 16, 128), pages), sd((8, P, 16, 128), pages),
            sd((R, M), jnp.int32), sd((R + 1,), jnp.int32), sd((R,), jnp.int32))
    if pages != jnp.bfloat16:  # the per-slot scales, traced arguments too
        args += (sd((8, P, 16), jnp.float32), sd((8, P, 16), jnp.float32))

    def fn(*a):
        scales = dict(zip(("k_scale", "v_scale"), a[6:]))
        return ragged_paged_attention(*a[:6], interpret=False, **scales, **kw)

    fn = jax.jit(fn)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    names = set(re.findall(r'name = "(ragged_\w+)"', text))
    longest = kw.get("split_longest", True) and kw.get("kv_splits") != 1  # (the CPU host counts as 132 SMs: auto splits)
    assert any(n.startswith("ragged_paged_attention") for n in names), names
    assert any(n.startswith("ragged_merge") for n in names) == bool(longest), names
    assert any(n.endswith("_sl") for n in names) == bool(longest), names
    assert any("_sk64" in n for n in names) == ("small_block_kv" in kw), names  # (the small tile's keys, when set)
    # separate_tiles: two launches named for their tile, each with one tile's code
    assert {n.endswith("_big") for n in names} | {n.endswith("_small") for n in names} == (
        {True, False} if kw.get("separate_tiles") else {False}), names
