"""Paged prefill attention: the Pallas kernel (interpret mode on CPU) against its jnp reference,
and the reference against an independent float64 numpy dense causal attention.

Every case draws fresh random inputs from its own seed.  The page pool is poisoned: every slot
that does not hold a valid token (the null page 0, spare pages, the tail of each sequence's
last page) is NaN, and so are the padding rows of ``q``; a kernel that reads any of them
unmasked, or forgets to zero padding rows, produces NaN and fails.  Interpret mode fills
unwritten outputs with NaN (checked below), so an all-finite output proves every element
was written.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.prefill_attention import (
    _default_kv_splits,
    check_prefill_inputs,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
_seeds = itertools.count(1000)


def make_case(*, q_lens, cached, T, Hq, Hkv, D, S, dtype, spare_pages=3, seed=None):
    """Random ragged batch written into a shuffled, NaN-poisoned page pool.

    Returns (args for the kernel, dense float64 copies for the independent check).
    """
    rng = np.random.default_rng(next(_seeds) if seed is None else seed)
    q_lens, cached = np.asarray(q_lens, np.int32), np.asarray(cached, np.int32)
    kv_lens = cached + q_lens
    B = len(q_lens)
    need = -(-kv_lens // S)  # pages per sequence
    max_pages = int(need.max()) + 1  # >= 1 padding entry (null page) per row
    P = 1 + int(need.sum()) + spare_pages
    ids = rng.permutation(np.arange(1, P))  # scattered, never the null page 0
    table = np.zeros((B, max_pages), np.int32)
    off = 0
    for b in range(B):
        table[b, : need[b]] = ids[off : off + need[b]]
        off += need[b]

    def rounded(x):  # values exactly representable in dtype, as float64
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)

    k_seq = [rounded(rng.standard_normal((Hkv, L, D))) for L in kv_lens]  # [Hkv, L, D]
    v_seq = [rounded(rng.standard_normal((Hkv, L, D))) for L in kv_lens]
    k_pages = np.full((Hkv, P, S, D), np.nan, np.float32)  # [Hkv, P, S, D]
    v_pages = np.full((Hkv, P, S, D), np.nan, np.float32)
    for b, L in enumerate(kv_lens):
        pos = np.arange(L)
        k_pages[:, table[b, pos // S], pos % S] = k_seq[b]
        v_pages[:, table[b, pos // S], pos % S] = v_seq[b]
    q = rounded(rng.standard_normal((B, T, Hq, D)))  # [B, T, Hq, D]
    for b in range(B):
        q[b, q_lens[b] :] = np.nan  # padding rows: must not matter
    args = (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(table), jnp.asarray(q_lens), jnp.asarray(kv_lens))
    return args, (q, k_seq, v_seq)


def dense_attention_f64(q, k_seq, v_seq, q_lens, sm_scale):
    """Causal attention of each chunk over its concatenated [cached + chunk] sequence, float64."""
    B, T, Hq, D = q.shape
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        n, L = int(q_lens[b]), k_seq[b].shape[1]
        if n == 0:
            continue
        G = Hq // k_seq[b].shape[0]
        k = np.repeat(k_seq[b], G, axis=0)  # [Hq, L, D]: q head j uses kv head j // G
        v = np.repeat(v_seq[b], G, axis=0)
        s = np.einsum("nhd,hld->hnl", q[b, :n], k) * sm_scale
        visible = np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None]  # [n, L]
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[b, :n] = np.einsum("hnl,hld->nhd", p, v)
    return out


def check_output(out, args, dtype, **kw):
    q, *_, q_lens, _ = args
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "unwritten or NaN-contaminated output"
    for b, n in enumerate(np.asarray(q_lens)):
        assert (out[b, n:] == 0).all(), f"padding rows of sequence {b} are not zero"
    ref = np.asarray(paged_prefill_attention_ref(*args, **kw).astype(jnp.float32))
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    return out


def test_interpret_mode_poisons_unwritten_outputs():
    """Premise of the finiteness checks: an element the kernel never writes reads NaN."""
    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 8), :] = x_ref[pl.ds(0, 8), :]
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                         interpret=True)(jnp.ones((16, 16), jnp.float32))
    assert np.isfinite(out[:8]).all() and np.isnan(out[8:]).all()


def test_case_builder_poisons_pool():
    (q, k, v, table, q_lens, kv_lens), _ = make_case(
        q_lens=[3, 1], cached=[5, 0], T=4, Hq=2, Hkv=1, D=8, S=4, dtype=jnp.float32)
    k = np.asarray(k)
    assert np.isnan(k[:, 0]).all()  # null page
    used = np.zeros(k.shape[1:3], bool)
    for b, L in enumerate(np.asarray(kv_lens)):
        used[np.asarray(table)[b, np.arange(L) // 4], np.arange(L) % 4] = True
    assert np.isnan(k[:, ~used]).all() and np.isfinite(k[:, used]).all()
    assert np.isnan(np.asarray(q)[0, 3:]).all() and np.isnan(np.asarray(q)[1, 1:]).all()


@pytest.mark.parametrize("Hq,Hkv,S", [(4, 4, 8), (8, 2, 16), (8, 1, 32)])
def test_ref_matches_float64_dense_attention(Hq, Hkv, S):
    """The reference against attention computed independently (numpy float64, no pages)."""
    T, D = 10, 32
    q_lens, cached = [10, 1, 7, 4], [0, 2 * S, S + 1, 3]
    args, (q, k_seq, v_seq) = make_case(q_lens=q_lens, cached=cached, T=T, Hq=Hq, Hkv=Hkv,
                                        D=D, S=S, dtype=jnp.float32)
    expect = dense_attention_f64(q, k_seq, v_seq, q_lens, 1 / math.sqrt(D))
    ref = np.asarray(paged_prefill_attention_ref(*args))
    np.testing.assert_allclose(ref, expect, atol=1e-5, rtol=1e-5)
    scaled = np.asarray(paged_prefill_attention_ref(*args, sm_scale=0.3))
    np.testing.assert_allclose(scaled, dense_attention_f64(q, k_seq, v_seq, q_lens, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_kernel_matches_float64_dense_attention():
    q_lens, cached = [16, 1, 9], [0, 17, 16]
    args, (q, k_seq, v_seq) = make_case(q_lens=q_lens, cached=cached, T=16, Hq=8, Hkv=2, D=64,
                                        S=16, dtype=jnp.float32)
    out = np.asarray(paged_prefill_attention(*args, block_kv=16))
    np.testing.assert_allclose(out, dense_attention_f64(q, k_seq, v_seq, q_lens, 0.125),
                               atol=1e-5, rtol=1e-5)


# (dtype, Hq, Hkv, D, S, T, q_lens, cached, kernel kwargs)
CASES = [
    # defaults; cached 0, exact page multiple, one past; q_len 1 and T
    (jnp.bfloat16, 8, 2, 64, 16, 16, [16, 1, 5, 16], [0, 32, 17, 3], {}),
    (jnp.float32, 8, 2, 64, 16, 16, [16, 1, 5, 16], [0, 32, 17, 3], {}),
    # GQA 1 / 8, page sizes 8 / 32, head_dim 128
    (jnp.bfloat16, 2, 2, 128, 8, 16, [3, 16], [8, 9], {}),
    (jnp.float32, 8, 1, 64, 32, 8, [8, 2, 1], [64, 31, 0], {}),
    (jnp.bfloat16, 16, 2, 128, 32, 12, [12, 7], [33, 0], {}),
    # non-default blocks: block_kv below the page size, several pages per block,
    # T not a multiple of block_q (wrapper pads), many query blocks past q_len
    (jnp.float32, 8, 2, 64, 32, 24, [24, 3, 13], [5, 64, 32], dict(block_q=4, block_kv=16)),
    (jnp.bfloat16, 4, 4, 64, 8, 40, [40, 17], [7, 48], dict(block_q=16, block_kv=32)),
    (jnp.float32, 8, 1, 32, 8, 20, [20, 9, 1], [0, 8, 41], dict(block_q=2, block_kv=64)),
    # G = 3 (not a power of two: padded tile rows), split-KV paths
    (jnp.float32, 6, 2, 64, 16, 16, [16, 4], [40, 16], dict(block_q=8, block_kv=16)),
    (jnp.bfloat16, 8, 2, 64, 16, 16, [16, 1, 6], [80, 100, 0], dict(kv_splits=3, block_kv=16)),
    (jnp.float32, 8, 1, 64, 8, 8, [8, 5], [150, 9], dict(kv_splits=4, block_kv=32)),
]


@pytest.mark.parametrize("dtype,Hq,Hkv,D,S,T,q_lens,cached,kw", CASES)
def test_kernel_matches_ref(dtype, Hq, Hkv, D, S, T, q_lens, cached, kw):
    args, _ = make_case(q_lens=q_lens, cached=cached, T=T, Hq=Hq, Hkv=Hkv, D=D, S=S,
                        dtype=dtype)
    check_output(paged_prefill_attention(*args, **kw), args, dtype)


def test_split_kv_equals_unsplit_and_custom_scale():
    args, _ = make_case(q_lens=[16, 2], cached=[90, 31], T=16, Hq=4, Hkv=1, D=64, S=16,
                        dtype=jnp.float32)
    whole = check_output(paged_prefill_attention(*args, kv_splits=1, sm_scale=0.2), args,
                         jnp.float32, sm_scale=0.2)
    split = check_output(paged_prefill_attention(*args, kv_splits=5, sm_scale=0.2), args,
                         jnp.float32, sm_scale=0.2)
    np.testing.assert_allclose(split, whole, atol=1e-5, rtol=1e-5)


def test_empty_batch_slot_and_jit():
    """q_len 0 (a padded batch slot) gives zero rows; works under jit (values traced)."""
    args, _ = make_case(q_lens=[0, 9], cached=[0, 20], T=16, Hq=4, Hkv=2, D=64, S=8,
                        dtype=jnp.bfloat16)
    out = jax.jit(paged_prefill_attention)(*args)
    check_output(out, args, jnp.bfloat16)
    assert (np.asarray(out[0], np.float32) == 0).all()


def _small_args(**over):
    args, _ = make_case(q_lens=[4, 2], cached=[3, 8], T=4, Hq=4, Hkv=2, D=16, S=8,
                        dtype=jnp.float32)
    names = ("q", "k_pages", "v_pages", "page_table", "q_lens", "kv_lens")
    d = dict(zip(names, args))
    d.update(over)
    return [d[n] for n in names]


@pytest.mark.parametrize("fn", [paged_prefill_attention, paged_prefill_attention_ref])
@pytest.mark.parametrize("change,match", [
    (lambda a: a.__setitem__(4, jnp.array([5, 2], jnp.int32)), "q_lens"),
    (lambda a: a.__setitem__(5, jnp.array([4, 1], jnp.int32)), "kv_lens"),
    (lambda a: a.__setitem__(5, jnp.array([4, 99], jnp.int32)), "max_pages"),
    (lambda a: a.__setitem__(0, a[0][:, :, :3]), "num_q_heads"),
    (lambda a: a.__setitem__(0, a[0].astype(jnp.bfloat16)), "q.dtype"),
    (lambda a: a.__setitem__(2, a[2][:, :-1]), "v_pages.shape"),
    (lambda a: a.__setitem__(3, a[3][:1]), "page_table.shape"),
    (lambda a: a.__setitem__(4, a[4].astype(jnp.float32)), "q_lens.dtype"),
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
])
def test_block_size_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(*_small_args(), **kw)


def test_validator_returns_dims():
    args = _small_args()
    dims = check_prefill_inputs(*args)
    assert dims[4] == args[1].shape[1]  # P: the pool's pages
    assert dims == (2, 4, 4, 2, dims[4], 8, 16)


def test_default_kv_splits_fill_the_gpu_only_when_needed():
    # 132 SMs (the fallback off the GPU): chunk 64 x 8 kv heads at block_q 32 -> 16 programs
    assert _default_kv_splits(16, capacity=4160, block_kv=64) == 8  # 520 keys per split
    assert _default_kv_splits(16, capacity=16448, block_kv=64) == 8
    assert _default_kv_splits(16, capacity=600, block_kv=64) == 1  # too short to split
    assert _default_kv_splits(128, capacity=16448, block_kv=64) == 1  # chunk 512: one wave
