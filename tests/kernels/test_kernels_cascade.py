"""Shared-prefix (cascade) decode attention and decode's ``return_lse`` (CPU, interpret mode).

Every case draws fresh random inputs, scatters the shared and suffix pages in random order over
the pool (never page 0) and poisons every slot that holds no real token (the null page, unused
pages, the tail of the shared range past ``shared_len``, the tail of each last suffix page)
with NaN.  The kernel is compared with its own jnp reference and, for page-aligned prefixes
(the engine's case), with ``paged_decode_attention_ref`` over the concatenated page lists.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.kernel_cases import assert_close, fill_table, poisoned_pool
from pallas_kernels import shared_prefix_decode_attention, shared_prefix_decode_attention_ref
from pallas_kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

def make_case(seed, shared_len, num_shared, suffix_lens, *, hq, hkv, d, s, dtype,
              extra_cols=0):
    """Random q and a NaN-poisoned pool with a shared prefix and per-row suffixes."""
    rng = np.random.default_rng(seed)
    b = len(suffix_lens)
    need = [max(1, math.ceil(n / s)) for n in suffix_lens]
    mp = max(need) + extra_cols
    num_pages = 1 + num_shared + sum(need) + 3
    ids = rng.permutation(np.arange(1, num_pages))  # never the null page
    shared = ids[:num_shared].astype(np.int32)
    valid = np.zeros((num_pages * s,), bool)  # slots holding real tokens
    for t in range(shared_len):
        valid[shared[t // s] * s + t % s] = True
    table = np.zeros((b, mp), np.int32)
    used = num_shared
    for i, (n, k) in enumerate(zip(suffix_lens, need)):
        fill_table(table, valid, i, ids[used:used + k], n, s)
        used += k
    q, k_pages, v_pages = poisoned_pool(seed, valid, b=b, hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    return (q, k_pages, v_pages, jnp.asarray(shared), jnp.asarray(shared_len, jnp.int32),
            jnp.asarray(table), jnp.asarray(suffix_lens, jnp.int32))


def concat_tables(shared, shared_len, table, lens, s):
    """Page list shared_pages[:shared_len / S] + suffix_table[b] (needs aligned shared_len)."""
    n = int(shared_len)
    assert n % s == 0, "only a page-aligned prefix is plain decode over concatenated pages"
    full = np.concatenate([np.broadcast_to(np.asarray(shared)[:n // s], (len(lens), n // s)),
                           np.asarray(table)], axis=1)
    return jnp.asarray(full, jnp.int32), lens + n


def ragged_lens(rng, b, s):
    """b suffix lengths covering 0, 1, page multiples, one past a page and random values."""
    base = [0, 1, s, 2 * s, s + 1, 3 * s - 1]
    return [base[i] if i < len(base) else int(rng.integers(0, 4 * s + 1)) for i in range(b)]


CASES = [
    # seed, B, shared_len, Ps, hq, hkv, d, s, dtype, kwargs
    (1, 6, 32, 4, 4, 4, 64, 8, jnp.float32, {}),  # GQA 1, B * G < 16 rows
    (2, 9, 48, 3, 8, 2, 128, 16, jnp.float32, dict(num_splits=2)),  # GQA 4, split merge
    (3, 40, 64, 4, 16, 2, 128, 16, jnp.bfloat16, {}),  # GQA 8, 320 rows: 3 row blocks, padded
    (4, 40, 24, 3, 2, 2, 64, 8, jnp.bfloat16, dict(num_splits=3, block_kv=16)),  # B=40, GQA 1
    (5, 1, 128, 8, 8, 1, 64, 16, jnp.float32, dict(block_kv=32, num_splits=4)),  # B=1, GQA 8
    (6, 13, 40, 5, 8, 2, 64, 8, jnp.bfloat16, dict(block_rows=16, suffix_num_splits=2)),
    (7, 7, 96, 6, 32, 8, 128, 16, jnp.bfloat16, dict(num_splits=2)),  # the bench's heads
]


@pytest.mark.parametrize("seed,b,shared_len,ps,hq,hkv,d,s,dtype,kw", CASES)
def test_matches_refs(seed, b, shared_len, ps, hq, hkv, d, s, dtype, kw):
    lens = ragged_lens(np.random.default_rng(seed), b, s)
    args = make_case(seed, shared_len, ps, lens, hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    q, kp, vp, shared, n, table, slens = args
    out = shared_prefix_decode_attention(*args, **kw)
    assert_close(out, shared_prefix_decode_attention_ref(*args), dtype)
    full, full_lens = concat_tables(shared, n, table, slens, s)
    assert_close(out, paged_decode_attention_ref(q, kp, vp, full, full_lens), dtype)


def test_unaligned_prefix_and_partial_shared_pages():
    """shared_len off a page boundary, fewer tokens than Ps * S, padded suffix columns."""
    args = make_case(20, 21, 5, [0, 1, 9, 16, 30], hq=4, hkv=2, d=64, s=8,
                     dtype=jnp.float32, extra_cols=2)
    for kw in ({}, dict(num_splits=3, block_kv=16)):
        out = shared_prefix_decode_attention(*args, sm_scale=0.2, **kw)
        assert_close(out, shared_prefix_decode_attention_ref(*args, sm_scale=0.2), jnp.float32)


def test_shared_len_zero_is_plain_decode():
    q, kp, vp, shared, _, table, lens = make_case(21, 0, 2, [3, 0, 8, 17], hq=8, hkv=2, d=64,
                                                  s=8, dtype=jnp.float32)
    ref = paged_decode_attention_ref(q, kp, vp, table, lens)
    out = np.asarray(shared_prefix_decode_attention(q, kp, vp, shared, jnp.int32(0), table, lens))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)  # no keys at all: zeros, not NaN
    assert_close(jnp.asarray(out), ref, jnp.float32)
    empty = jnp.zeros((0,), jnp.int32)  # no shared pages at all: the decode kernel alone
    out0 = shared_prefix_decode_attention(q, kp, vp, empty, jnp.int32(0), table, lens)
    assert_close(out0, ref, jnp.float32)
    assert_close(out0, shared_prefix_decode_attention_ref(q, kp, vp, empty, 0, table, lens),
                 jnp.float32)


def test_empty_suffixes_attend_the_prefix_only():
    q, kp, vp, shared, n, table, lens = make_case(22, 64, 4, [0, 0, 0], hq=8, hkv=2, d=64,
                                                  s=16, dtype=jnp.bfloat16)
    out = shared_prefix_decode_attention(q, kp, vp, shared, n, table, lens, num_splits=2)
    prefix_only = paged_decode_attention_ref(q, kp, vp, jnp.broadcast_to(shared, (3, 4)),
                                             jnp.full((3,), 64, jnp.int32))
    assert_close(out, prefix_only, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_outside_the_group_attend_their_own_pages_only(dtype):
    """shared_rows: a batch mixing the group of one shared prefix with other requests."""
    mask = np.array([1, 0, 1, 1, 0, 0, 1], bool)
    q, kp, vp, shared, n, table, lens = make_case(24, 32, 4, [9, 0, 0, 8, 3, 16, 25], hq=8,
                                                  hkv=2, d=64, s=8, dtype=dtype)
    rows = jnp.asarray(mask)
    out = shared_prefix_decode_attention(q, kp, vp, shared, n, table, lens, rows, num_splits=2)
    assert_close(out, shared_prefix_decode_attention_ref(q, kp, vp, shared, n, table, lens, rows),
                 dtype)
    full, full_lens = concat_tables(shared, n, table, lens, 8)
    in_group = paged_decode_attention_ref(q, kp, vp, full, full_lens)
    alone = paged_decode_attention_ref(q, kp, vp, table, lens)  # the row's own pages only
    want = jnp.where(rows[:, None, None], in_group, alone)
    assert_close(out, want, dtype)
    empty = ~mask & (np.asarray(lens) == 0)  # row 1: outside the group, no own tokens
    assert empty.sum() == 1
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0)  # zeros, not NaN


def test_traced_shared_len_under_jit():
    """shared_len is data, not a static argument: one compilation serves every length."""
    q, kp, vp, shared, _, table, lens = make_case(23, 48, 6, [5, 16, 0, 9], hq=4, hkv=1, d=64,
                                                  s=8, dtype=jnp.float32)
    fn = jax.jit(shared_prefix_decode_attention)
    for n in (0, 8, 48):
        out = fn(q, kp, vp, shared, jnp.int32(n), table, lens)
        ref = shared_prefix_decode_attention_ref(q, kp, vp, shared, jnp.int32(n), table, lens)
        assert_close(out, ref, jnp.float32)
    assert fn._cache_size() == 1


# ---- decode's return_lse option

def lse_numpy(q, kp, table, lens, sm_scale):
    """Natural-log log-sum-exp of the scaled logits, fp64, -inf for a zero length."""
    q, kp = np.asarray(q, np.float64), np.asarray(kp, np.float64)
    b, hq, d = q.shape
    hkv, _, s, _ = kp.shape
    g = hq // hkv
    out = np.full((b, hq), -np.inf)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        slots = [int(table[i, t // s]) * s + t % s for t in range(n)]
        k = kp.reshape(hkv, -1, d)[:, slots]  # [Hkv, n, D]
        for h in range(hq):
            x = sm_scale * k[h // g] @ q[i, h]
            out[i, h] = x.max() + np.log(np.exp(x - x.max()).sum())
    return out


@pytest.mark.parametrize("num_splits,dtype", [(1, jnp.float32), (3, jnp.float32),
                                              (2, jnp.bfloat16)])
def test_decode_return_lse(num_splits, dtype):
    from tests.kernels.test_kernels_decode import make_case as decode_case
    q, kp, vp, table, lens = decode_case(30 + num_splits, [0, 1, 8, 17, 40], hq=8, hkv=2, d=64,
                                         s=8, dtype=dtype)
    plain = paged_decode_attention(q, kp, vp, table, lens, num_splits=num_splits)
    out, lse = paged_decode_attention(q, kp, vp, table, lens, num_splits=num_splits,
                                      return_lse=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    assert lse.shape == (5, 8) and lse.dtype == jnp.float32
    want = lse_numpy(q, kp, np.asarray(table), np.asarray(lens), 1 / math.sqrt(64))
    lse = np.asarray(lse)
    assert np.isneginf(lse[0]).all() and np.isfinite(lse[1:]).all()
    np.testing.assert_allclose(lse[1:], want[1:], rtol=0, atol=1e-4 if dtype == jnp.float32
                               else 2e-2)


# ---- validation and lowering

@pytest.mark.parametrize("bad,match", [
    (lambda a: {**a, "shared_len": jnp.int32(999)}, "shared_len"),
    (lambda a: {**a, "shared_len": jnp.array([8], jnp.int32)}, "shared_len"),
    (lambda a: {**a, "shared_pages": a["shared_pages"][None]}, "shared_pages"),
    (lambda a: {**a, "suffix_lens": jnp.array([5, 99], jnp.int32)}, "suffix_lens"),
    (lambda a: {**a, "suffix_table": a["suffix_table"][0]}, "page_table.shape"),
    (lambda a: {**a, "q": a["q"].astype(jnp.bfloat16)}, "q.dtype"),
    (lambda a: {**a, "shared_rows": jnp.ones((3,), bool)}, "shared_rows"),
    (lambda a: {**a, "shared_rows": jnp.ones((2,), jnp.float32)}, "shared_rows"),
])
def test_validation_errors_name_the_value(bad, match):
    q, kp, vp, shared, n, table, lens = make_case(40, 16, 2, [5, 9], hq=4, hkv=2, d=64, s=8,
                                                  dtype=jnp.float32)
    args = dict(q=q, k_pages=kp, v_pages=vp, shared_pages=shared, shared_len=n,
                suffix_table=table, suffix_lens=lens)
    for fn in (shared_prefix_decode_attention, shared_prefix_decode_attention_ref):
        with pytest.raises(ValueError, match=match):
            fn(**bad(args))


def test_lowers_to_triton():
    """The compiled path lowers to Triton calls for CUDA (shared kernel + decode kernel)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((32, 32, 128), jnp.bfloat16), sd((8, 600, 16, 128), jnp.bfloat16),
            sd((8, 600, 16, 128), jnp.bfloat16), sd((256,), jnp.int32), sd((), jnp.int32),
            sd((32, 4), jnp.int32), sd((32,), jnp.int32))
    fn = jax.jit(functools.partial(shared_prefix_decode_attention, interpret=False))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") >= 2
