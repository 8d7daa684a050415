"""Multi-group cascade decode attention (CPU, interpret mode).

Every case draws fresh random inputs: G groups, each with its own shared pages scattered in
random order over the pool (never page 0) and its own length, rows assigned to groups (groups of
one row, empty groups, rows in no group), ragged suffixes.  Every slot that holds no real token
is poisoned with NaN (the null page, unused pages, a group's pages past its length, the tail of
each last suffix page).  The kernel is compared with its own jnp reference and, for page-aligned
prefixes (the engine's case), with ``paged_decode_attention_ref`` over each row's concatenated
page list (group pages + suffix pages).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.kernel_cases import assert_close, fill_table, poisoned_pool
from pallas_kernels import (grouped_cascade_decode_attention, grouped_cascade_decode_attention_ref,
                            shared_prefix_decode_attention, shared_prefix_decode_attention_ref)
from pallas_kernels.cascade_attention import num_row_blocks, row_layout
from pallas_kernels.decode_attention import paged_decode_attention_ref


def make_case(seed, group_lens, ps, row_group, suffix_lens, *, hq, hkv, d, s, dtype):
    """Random q and a NaN-poisoned pool with a group table and per-row suffixes.

    group_lens [G] tokens of each group (<= ps * s); row_group [B] (-1: none)."""
    rng = np.random.default_rng(seed)
    g, b = len(group_lens), len(row_group)
    need = [max(1, math.ceil(n / s)) for n in suffix_lens]
    num_pages = 1 + g * ps + sum(need) + 3
    ids = rng.permutation(np.arange(1, num_pages))  # never the null page
    group_pages = ids[:g * ps].reshape(g, ps).astype(np.int32)
    valid = np.zeros((num_pages * s,), bool)  # slots holding real tokens
    for gi, n in enumerate(group_lens):
        for t in range(n):
            valid[group_pages[gi, t // s] * s + t % s] = True
    table = np.zeros((b, max(need)), np.int32)
    used = g * ps
    for i, (n, k) in enumerate(zip(suffix_lens, need)):
        fill_table(table, valid, i, ids[used:used + k], n, s)
        used += k
    q, k_pages, v_pages = poisoned_pool(seed, valid, b=b, hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    return (q, k_pages, v_pages, jnp.asarray(group_pages).reshape(g, ps),
            jnp.asarray(group_lens, jnp.int32), jnp.asarray(row_group, jnp.int32), jnp.asarray(table),
            jnp.asarray(suffix_lens, jnp.int32))


def decode_over_concatenation(args, s):
    """paged_decode_attention_ref over group pages + suffix pages per row (aligned lengths only)."""
    q, kp, vp, gp, glens, rg, table, lens = args
    gp, glens, rg, table = (np.asarray(x) for x in (gp, glens, rg, table))
    assert (glens % s == 0).all(), "only page-aligned prefixes are plain decode over concatenated pages"
    ps = gp.shape[1]
    full = np.zeros((len(rg), ps + table.shape[1]), np.int32)
    full_lens = np.asarray(lens).copy()
    for i, gi in enumerate(rg):
        k = int(glens[gi]) // s if gi >= 0 else 0
        full[i, :k] = gp[gi, :k] if gi >= 0 else []
        full[i, k:k + table.shape[1]] = table[i]
        full_lens[i] += k * s
    return paged_decode_attention_ref(q, kp, vp, jnp.asarray(full), jnp.asarray(full_lens, jnp.int32))


def random_membership(rng, b, g, outside=0.2):
    """Rows spread over the g groups unevenly (some groups of one row, some empty), ~outside of
    them in no group."""
    weights = rng.dirichlet(np.full(g, 0.6)) if g else np.zeros(0)
    rg = rng.choice(g, size=b, p=weights) if g else np.full(b, -1)
    rg[rng.random(b) < outside] = -1
    return rg.astype(np.int32)


def suffix_lens_for(rng, b, s):
    """b suffix lengths covering 0, 1, page multiples, one past a page and random values."""
    base = [1, 0, s, 2 * s, s + 1, 3 * s - 1]
    return [base[i] if i < len(base) else int(rng.integers(0, 4 * s + 1)) for i in range(b)]


CASES = [
    # seed, B, G, Ps, hq, hkv, d, s, dtype, kwargs
    (1, 7, 1, 4, 4, 2, 64, 8, jnp.float32, {}),  # G = 1
    (2, 12, 3, 5, 8, 2, 64, 8, jnp.float32, dict(block_rows=16)),  # groups over several blocks
    (3, 12, 3, 4, 8, 2, 64, 16, jnp.bfloat16, dict(num_splits=2, block_kv=16)),
    (4, 20, 8, 3, 4, 4, 64, 8, jnp.float32, dict(num_splits=3, block_kv=16)),  # G = 8, GQA 1
    (5, 20, 8, 4, 8, 2, 128, 16, jnp.bfloat16, {}),  # G = 8, default (auto) block_rows
    (6, 9, 3, 6, 32, 8, 128, 16, jnp.bfloat16, dict(block_rows=32, suffix_num_splits=2)),  # the bench's heads
    # the unfused merge (shared part normalised and merged by lse in jnp, as before the suffix kernel took
    # the shared partials as its starting state)
    (7, 12, 3, 4, 8, 2, 64, 16, jnp.bfloat16, dict(num_splits=2, block_kv=16, fused_merge=False)),
    (8, 9, 3, 6, 32, 8, 128, 16, jnp.float32, dict(block_rows=32, suffix_num_splits=3, num_splits=2)),
    # each tile's slots computed in its own iteration (both kernels), split and unsplit, both merges
    (9, 12, 3, 5, 8, 2, 64, 8, jnp.float32, dict(prefetch=False, num_splits=2, block_kv=16, suffix_num_splits=2)),
    (10, 20, 8, 4, 8, 2, 128, 16, jnp.bfloat16, dict(prefetch=False)),
    (11, 12, 3, 4, 8, 2, 64, 16, jnp.bfloat16, dict(prefetch=False, fused_merge=False, block_kv=16)),
]


@pytest.mark.parametrize("seed,b,g,ps,hq,hkv,d,s,dtype,kw", CASES)
def test_matches_refs(seed, b, g, ps, hq, hkv, d, s, dtype, kw):
    rng = np.random.default_rng(seed)
    glens = [int(rng.integers(0, ps + 1)) * s for _ in range(g)]  # aligned, some may be 0
    glens[0] = ps * s  # one group fills its whole list
    rg = random_membership(rng, b, g)
    rg[0], rg[1] = 0, -1  # at least one member and one row in no group
    args = make_case(seed, glens, ps, rg, suffix_lens_for(rng, b, s), hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    out = grouped_cascade_decode_attention(*args, **kw)
    assert_close(out, grouped_cascade_decode_attention_ref(*args), dtype)
    assert_close(out, decode_over_concatenation(args, s), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unaligned_lengths_singletons_empty_groups_and_rows_in_no_group(dtype):
    """G = 8: lengths off page boundaries and 0, groups of one row, two empty groups, rows in no
    group (one of them with no tokens at all: zeros, not NaN), ragged suffixes."""
    s, ps = 8, 5
    glens = [40, 21, 0, 8, 9, 33, 17, 40]
    rg = [0, 1, 0, -1, 3, 4, 5, 0, -1, 1, 7, 3, 0, 1]  # groups 2 (length 0) and 6 (no members)
    lens = [3, 0, 16, 0, 1, 9, 8, 24, 5, 17, 0, 2, 31, 7]
    args = make_case(11, glens, ps, rg, lens, hq=8, hkv=2, d=64, s=s, dtype=dtype)
    for kw in ({}, dict(block_rows=16, num_splits=2, block_kv=16)):
        out = np.asarray(grouped_cascade_decode_attention(*args, sm_scale=0.3, **kw), np.float32)
        assert_close(jnp.asarray(out, dtype), grouped_cascade_decode_attention_ref(*args, sm_scale=0.3), dtype)
        np.testing.assert_array_equal(out[3], 0.0)  # no group, no suffix: no keys at all
    # group 6 has no members, group 2 a zero length: row 10 (group 7, no suffix) reads its prefix only
    assert np.isfinite(out).all()


def test_three_groups_equal_three_single_group_calls():
    """Each group's rows get what the single-group kernel gives them with that group alone."""
    s, ps = 8, 4
    rg = np.array([2, 0, 1, 2, -1, 0, 2, 1, 1, 0], np.int32)
    args = make_case(12, [32, 16, 24], ps, rg, [5, 9, 0, 16, 20, 1, 8, 3, 12, 7], hq=4, hkv=2, d=64, s=s,
                     dtype=jnp.float32)
    q, kp, vp, gp, glens, _, table, lens = args
    out = grouped_cascade_decode_attention(*args, block_rows=16)
    for gi in range(3):
        alone = shared_prefix_decode_attention(q, kp, vp, gp[gi], glens[gi], table, lens, jnp.asarray(rg == gi))
        assert_close(out[rg == gi], alone[rg == gi], jnp.float32)
    assert_close(out[rg < 0], shared_prefix_decode_attention_ref(q, kp, vp, gp[0], glens[0], table, lens,
                                                                 jnp.asarray(rg == 0))[rg < 0], jnp.float32)


def test_no_groups_or_no_shared_pages_is_plain_decode():
    s = 8
    args = make_case(13, [16, 8], 2, [0, 1, -1, 0], [3, 0, 17, 8], hq=8, hkv=2, d=64, s=s, dtype=jnp.float32)
    q, kp, vp, gp, glens, rg, table, lens = args
    plain = paged_decode_attention_ref(q, kp, vp, table, lens)
    none = jnp.full((4,), -1, jnp.int32)
    for g_pages, g_lens, rows in ((gp, glens, none), (gp[:0], glens[:0], none),
                                  (gp[:, :0], jnp.zeros((2,), jnp.int32), rg)):
        for fn in (grouped_cascade_decode_attention, grouped_cascade_decode_attention_ref):
            out = fn(q, kp, vp, g_pages, g_lens, rows, table, lens)
            assert_close(out, plain, jnp.float32)


def test_row_layout_packs_each_group_into_blocks_of_its_own():
    """The shared part reads a group's tiles once per row block of its members: every member's
    rows lie in blocks of its group only, and the blocks used are sum_g cdiv(c_g * Gq, BR)."""
    rng = np.random.default_rng(14)
    for g, b, gq, br in ((1, 9, 4, 16), (3, 40, 4, 32), (8, 64, 4, 16), (64, 256, 4, 32), (16, 5, 8, 16)):
        rg = random_membership(rng, b, g)
        glens = rng.integers(1, 100, g).astype(np.int32)
        gp = rng.integers(0, 1000, (g, 3)).astype(np.int32)
        dest, bpages, blens = (np.asarray(x) for x in row_layout(jnp.asarray(rg), jnp.asarray(gp),
                                                                  jnp.asarray(glens), gq=gq, block_rows=br))
        nb = num_row_blocks(b, gq, g, br)
        assert bpages.shape == (nb, 3) and blens.shape == (nb,)
        counts = np.bincount(rg[rg >= 0], minlength=g)
        want_blocks = sum(-(-c * gq // br) for c in counts)
        assert (blens > 0).sum() == want_blocks <= nb
        assert (dest[rg < 0] == nb * br).all()
        rows = dest[rg >= 0][:, None] + np.arange(gq)
        assert len(np.unique(rows)) == rows.size and rows.max() < nb * br  # no two rows share a slot
        for i in np.flatnonzero(rg >= 0):  # each member's rows sit in blocks of its own group
            blocks = (dest[i] + np.arange(gq)) // br
            assert (blens[blocks] == glens[rg[i]]).all() and (bpages[blocks] == gp[rg[i]]).all()


def test_membership_is_data_one_compile_serves_every_step():
    """Group table, lengths and membership are traced: one compilation for every assignment."""
    s = 8
    rng = np.random.default_rng(15)
    fn = jax.jit(functools.partial(grouped_cascade_decode_attention, block_rows=16))
    lens = suffix_lens_for(rng, 10, s)  # (the same shapes every time: pool and table sizes follow them)
    for seed in range(3):
        rg = random_membership(rng, 10, 4)
        glens = [int(rng.integers(0, 4)) * s for _ in range(4)]
        args = make_case(20 + seed, glens, 3, rg, lens, hq=4, hkv=2, d=64, s=s, dtype=jnp.float32)
        assert_close(fn(*args), grouped_cascade_decode_attention_ref(*args), jnp.float32)
    assert fn._cache_size() == 1


def test_single_group_api_is_the_g1_case():
    s = 8
    args = make_case(16, [24], 3, [0, -1, 0, 0], [5, 9, 0, 16], hq=4, hkv=2, d=64, s=s, dtype=jnp.float32)
    q, kp, vp, gp, glens, rg, table, lens = args
    rows = jnp.asarray(np.asarray(rg) == 0)
    got = shared_prefix_decode_attention(q, kp, vp, gp[0], glens[0], table, lens, rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(grouped_cascade_decode_attention(*args)))
    assert_close(shared_prefix_decode_attention_ref(q, kp, vp, gp[0], glens[0], table, lens, rows),
                 grouped_cascade_decode_attention_ref(*args), jnp.float32)


# ---- validation and lowering

@pytest.mark.parametrize("bad,match", [
    (lambda a: {**a, "group_lens": jnp.array([8, 99], jnp.int32)}, "group_lens"),
    (lambda a: {**a, "group_lens": jnp.array([8], jnp.int32)}, "group_lens"),
    (lambda a: {**a, "group_pages": a["group_pages"][0]}, "group_pages"),
    (lambda a: {**a, "row_group": jnp.array([0, 2], jnp.int32)}, "row_group"),
    (lambda a: {**a, "row_group": jnp.array([0, -2], jnp.int32)}, "row_group"),
    (lambda a: {**a, "row_group": jnp.array([0, 1, 1], jnp.int32)}, "row_group"),
    (lambda a: {**a, "row_group": jnp.array([0.0, 1.0], jnp.float32)}, "row_group"),
    (lambda a: {**a, "suffix_lens": jnp.array([5, 99], jnp.int32)}, "suffix_lens"),
])
def test_validation_errors_name_the_value(bad, match):
    q, kp, vp, gp, glens, rg, table, lens = make_case(40, [16, 8], 2, [0, 1], [5, 9], hq=4, hkv=2, d=64, s=8,
                                                      dtype=jnp.float32)
    args = dict(q=q, k_pages=kp, v_pages=vp, group_pages=gp, group_lens=glens, row_group=rg,
                suffix_table=table, suffix_lens=lens)
    for fn in (grouped_cascade_decode_attention, grouped_cascade_decode_attention_ref):
        with pytest.raises(ValueError, match=match):
            fn(**bad(args))


@pytest.mark.parametrize("prefetch", [True, False])
def test_lowers_to_triton(prefetch):
    """The compiled path lowers to Triton calls for CUDA (shared kernel + decode kernel), G = 16."""
    sd = jax.ShapeDtypeStruct
    args = (sd((64, 32, 128), jnp.bfloat16), sd((8, 600, 16, 128), jnp.bfloat16),
            sd((8, 600, 16, 128), jnp.bfloat16), sd((16, 256), jnp.int32), sd((16,), jnp.int32),
            sd((64,), jnp.int32), sd((64, 4), jnp.int32), sd((64,), jnp.int32))
    fn = jax.jit(functools.partial(grouped_cascade_decode_attention, interpret=False, prefetch=prefetch))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") >= 2
    # both kernels: 2 stages with the carried slots, 3 without (indirect loads: common.stages_for)
    assert set(re.findall(r"num_stages = (\d+)", text)) == {"2" if prefetch else "3"}


def test_the_shared_part_gathering_its_own_queries_lowers_to_triton(monkeypatch):
    """``INFERSCALE_SHARED_Q=kernel``: the shared kernel takes the packed rows' sources and every query row (no
    packed copy of q) and still lowers to a Triton call for CUDA."""
    monkeypatch.setenv("INFERSCALE_SHARED_Q", "kernel")
    sd = jax.ShapeDtypeStruct
    args = (sd((64, 32, 128), jnp.bfloat16), sd((8, 600, 16, 128), jnp.bfloat16),
            sd((8, 600, 16, 128), jnp.bfloat16), sd((16, 256), jnp.int32), sd((16,), jnp.int32),
            sd((64,), jnp.int32), sd((64, 4), jnp.int32), sd((64,), jnp.int32))
    fn = jax.jit(functools.partial(grouped_cascade_decode_attention, interpret=False))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") >= 2
    assert re.search(r"cascade_shared_g16_r\d+_bk64_sp\d+_nq_qk", text)
