"""A mixed step's cascade rows: the grouped kernel's shared part alone, then the ragged kernel
continuing each group token from its partials (``inferscale_jax/kv_cache.py``'s ``_mixed``; with
``INFERSCALE_MIXED_MERGE=jnp`` the two merged by log-sum-exps after it), CPU, interpret mode.

The shared part alone (``grouped_shared_prefix_attention``) is checked against its reference and
float64 numpy (output and log-sum-exp, rows outside every group and empty prefixes included), and
the whole mixed step against the ragged reference over each row's concatenated page list (group
pages + suffix pages): decode rows in groups, decode rows in none, prefill chunks, page
boundaries, a padded group table (groups of length 0, groups without members) and padding
tokens.  Every slot that holds no real token is NaN.  The same with ``INFERSCALE_MIXED_DECODE=cascade``
(the one-token rows through the decode step's cascade kernel), on bf16 and on compressed pages.
"""

from __future__ import annotations

import functools

import math

import jax.numpy as jnp
import numpy as np
import pytest

from inferscale_jax import kv_cache
from pallas_kernels import (grouped_cascade_decode_attention_ref, grouped_shared_prefix_attention,
                            grouped_shared_prefix_attention_ref)
from tests.support.kernel_cases import assert_close, fill_table, poisoned_pool


def shared_case(seed, glens, ps, rg, *, hq=8, hkv=2, d=64, s=8, dtype=jnp.float32):
    """q [B, Hq, D], a NaN-poisoned pool holding each group's ``glens[g]`` shared tokens, the group
    table and ``rg`` (each row's group, -1: none)."""
    rng = np.random.default_rng(seed)
    g = len(glens)
    num_pages = 1 + g * ps + 2
    ids = rng.permutation(np.arange(1, num_pages))
    gp = ids[:g * ps].reshape(g, ps).astype(np.int32)
    valid = np.zeros((num_pages * s,), bool)
    for gi, n in enumerate(glens):
        fill_table(gp, valid, gi, gp[gi], n, s)
    q, kp, vp = poisoned_pool(seed, valid, b=len(rg), hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    return q, kp, vp, jnp.asarray(gp), jnp.asarray(glens, jnp.int32), jnp.asarray(rg, jnp.int32)


def f64_shared(q, kp, vp, gp, glens, rg, sm_scale):
    """numpy float64: each row's attention over its group's shared tokens, and its log-sum-exp."""
    q, kp, vp = (np.asarray(x, np.float64) for x in (q, kp, vp))
    b, hq, d = q.shape
    hkv, _, s, _ = kp.shape
    out, lse = np.zeros((b, hq, d)), np.full((b, hq), -np.inf)
    for i, gi in enumerate(np.asarray(rg)):
        n = int(glens[gi]) if gi >= 0 else 0
        if n == 0:
            continue
        pos = np.arange(n)
        slots = np.asarray(gp)[gi, pos // s] * s + pos % s
        k = kp.reshape(hkv, -1, d)[:, slots].repeat(hq // hkv, axis=0)  # [Hq, n, D]
        v = vp.reshape(hkv, -1, d)[:, slots].repeat(hq // hkv, axis=0)
        sc = np.einsum("hd,hnd->hn", q[i], k) * sm_scale
        mx = sc.max(-1, keepdims=True)
        e = np.exp(sc - mx)
        out[i] = np.einsum("hn,hnd->hd", e / e.sum(-1, keepdims=True), v)
        lse[i] = mx[:, 0] + np.log(e.sum(-1))
    return out, lse


@pytest.mark.parametrize("dtype,kw", [(jnp.float32, {}), (jnp.float32, dict(block_rows=16, num_splits=3, block_kv=16)),
                                      (jnp.bfloat16, dict(real_groups=2))])
def test_shared_part_alone_matches_refs(dtype, kw):
    """Output and lse against the reference and float64; rows outside every group or with an empty
    prefix: zeros and -inf (a padded table: group 2 has length 0, group 4 no members)."""
    glens, rg = [40, 21, 0, 16, 8], [0, 1, 2, -1, 3, 0, 1, -1, 0, 3, 2]
    args = shared_case(5, glens, 5, rg, dtype=dtype)
    o, lse = grouped_shared_prefix_attention(*args, sm_scale=0.3, **kw)
    o_ref, lse_ref = grouped_shared_prefix_attention_ref(*args, sm_scale=0.3)
    assert o.dtype == lse.dtype == jnp.float32 and o.shape == args[0].shape and lse.shape == args[0].shape[:2]
    o64, lse64 = f64_shared(*args, 0.3)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(o_ref), o64, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse_ref), lse64, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(o), o64, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), lse64, atol=tol, rtol=tol)
    none = np.isin(np.asarray(rg), [-1, 2])
    assert (np.asarray(o)[none] == 0).all() and (np.asarray(lse)[none] == -np.inf).all()
    assert np.isfinite(np.asarray(o)).all()


def test_shared_part_is_the_cascade_with_empty_suffixes():
    """With no suffix, the full cascade (reference) gives what the shared part alone gives."""
    glens, rg = [24, 16], [0, 1, 1, 0, 0]
    q, kp, vp, gp, gl, rgj = shared_case(6, glens, 3, rg)
    o, _ = grouped_shared_prefix_attention(q, kp, vp, gp, gl, rgj)
    full = grouped_cascade_decode_attention_ref(q, kp, vp, gp, gl, rgj, jnp.zeros((5, 1), jnp.int32),
                                                jnp.zeros((5,), jnp.int32))
    assert_close(o.astype(jnp.float32), full.astype(jnp.float32), jnp.float32)


def mixed_case(seed, *, s=8, dtype=jnp.float32, hq=8, hkv=2, d=64, chunk_groups=(-1, -1),
               q_lens=(1, 1, 1, 1, 1, 1, 5, 12)):
    """A mixed step: 6 decode rows (4 in groups 0 / 1 of a 4-group padded table, 2 in none), then
    2 prefill chunks (in the groups ``chunk_groups``; -1: none); 3 padding tokens.  ``q_lens`` may
    make any row a chunk, a 1-token chunk or an empty row.  Returns (q [N, Hq, D], pages, the cascade
    meta (group rows' tables hold their suffix only), the plain meta (every row's whole page list))."""
    rng = np.random.default_rng(seed)
    ps = 4
    glens = [32, 24, 0, 0]  # page-aligned (the engine's guarantee); groups 2 and 3 are bucket padding
    rg = [0, 1, -1, 0, 1, -1, *chunk_groups]
    # tokens in each row's own pages (a group row's suffix holds its new token: >= 1); chunks' q_len
    own = [1, 9, 20, s, s + 1, 2 * s, 13, 30]
    assert all(0 <= n <= o for n, o in zip(q_lens, own))
    need = [math.ceil(n / s) for n in own]
    num_pages = 1 + len(glens) * ps + sum(need) + 2
    ids = rng.permutation(np.arange(1, num_pages))
    gp = ids[:len(glens) * ps].reshape(len(glens), ps).astype(np.int32)
    valid = np.zeros((num_pages * s,), bool)
    for gi, n in enumerate(glens):
        fill_table(gp, valid, gi, gp[gi], n, s)
    width = max(need) + ps
    suf = np.zeros((len(rg), width), np.int32)
    full = np.zeros((len(rg), width), np.int32)
    used = len(glens) * ps
    for r, (n, k) in enumerate(zip(own, need)):
        fill_table(suf, valid, r, ids[used:used + k], n, s)
        used += k
        sh = glens[rg[r]] // s if rg[r] >= 0 else 0
        full[r, :sh] = gp[rg[r], :sh] if sh else []
        full[r, sh:sh + k] = suf[r, :k]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n_tok = int(cu[-1]) + 3
    q, kp, vp = poisoned_pool(seed, valid, b=n_tok, hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    q = q.at[int(cu[-1]):].set(jnp.nan)  # padding tokens must not matter
    shared = np.asarray([glens[g] if g >= 0 else 0 for g in rg])
    plain = kv_cache.AttnMeta(slots=None, page_table=jnp.asarray(full), q_lens=None, cu_q_lens=jnp.asarray(cu),
                              kv_lens=jnp.asarray(np.asarray(own) + shared, jnp.int32), ragged=True)
    casc = kv_cache.AttnMeta(slots=None, page_table=jnp.asarray(suf), q_lens=None, cu_q_lens=jnp.asarray(cu),
                             kv_lens=jnp.asarray(own, jnp.int32), ragged=True, group_pages=jnp.asarray(gp),
                             group_lens=jnp.asarray(glens, jnp.int32), row_group=jnp.asarray(rg, jnp.int32))
    return q, kp, vp, casc, plain, int(cu[-1])


@pytest.mark.parametrize("impl,dtype,merge", [("pallas", jnp.float32, "kernel"), ("pallas", jnp.bfloat16, "kernel"),
                                             ("pallas", jnp.float32, "jnp"), ("pallas", jnp.bfloat16, "jnp"),
                                             ("ref", jnp.float32, "kernel")])
def test_mixed_step_with_groups_equals_ragged_over_whole_page_lists(monkeypatch, impl, dtype, merge):
    """Both forms of the merge (``INFERSCALE_MIXED_MERGE``): the ragged kernel continuing from the shared part's
    partials (the default), and the two merged by log-sum-exps after it; each launches its own form."""
    q, kp, vp, casc, plain, n = mixed_case(7, dtype=dtype)
    monkeypatch.setenv("INFERSCALE_MIXED_MERGE", merge)
    forms: list = []
    shared_launches(monkeypatch, forms)
    out = kv_cache._attend(q[None], kp, vp, None, casc, impl)[0]
    assert forms == ({"kernel": ["partials"], "jnp": ["merged"]}[merge] if impl == "pallas" else [])
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out[:n], want[:n], dtype)
    assert (np.asarray(out[n:], np.float32) == 0).all()  # padding tokens


def test_mixed_step_without_group_rows_is_the_ragged_kernel():
    """An empty group table (no shared pages) leaves the ragged kernel's result as it is."""
    q, kp, vp, casc, plain, n = mixed_case(8)
    empty = kv_cache.AttnMeta(slots=None, page_table=plain.page_table, q_lens=None, cu_q_lens=plain.cu_q_lens,
                              kv_lens=plain.kv_lens, ragged=True, group_pages=jnp.zeros((4, 0), jnp.int32),
                              group_lens=jnp.zeros((4,), jnp.int32), row_group=jnp.full((8,), -1, jnp.int32))
    for impl in ("pallas", "ref"):
        out = kv_cache._attend(q[None], kp, vp, None, empty, impl)[0]
        assert_close(out[:n], kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0][:n], jnp.float32)


@pytest.mark.parametrize("impl,dtype,chunk_groups", [("pallas", jnp.float32, (0, 1)), ("pallas", jnp.bfloat16, (1, -1)),
                                                     ("ref", jnp.float32, (-1, 0))])
def test_mixed_step_with_chunks_in_groups_equals_ragged_over_whole_page_lists(impl, dtype, chunk_groups):
    """Prefill chunks in a group (a question over a shared segment, with private tokens cached before the
    chunk and a chunk crossing pages): every token of the chunk attends the group's shared pages in
    the shared part and its own causally in the ragged kernel, merged; as the ragged kernel over each
    row's whole page list."""
    q, kp, vp, casc, plain, n = mixed_case(9, dtype=dtype, chunk_groups=chunk_groups)
    out = kv_cache._attend(q[None], kp, vp, None, casc, impl)[0]
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out[:n], want[:n], dtype)
    assert (np.asarray(out[n:], np.float32) == 0).all()  # padding tokens
    # the groups did change the chunk rows' inputs: their suffix tables alone miss the shared keys
    alone = kv_cache.AttnMeta(slots=None, page_table=casc.page_table, q_lens=None, cu_q_lens=casc.cu_q_lens,
                              kv_lens=casc.kv_lens, ragged=True)
    suffix_only = kv_cache._attend(q[None], kp, vp, None, alone, "ref")[0]
    first = 6 if chunk_groups[0] >= 0 else 11  # a grouped chunk's first token (rows 0-5 are one token each)
    assert not np.allclose(np.asarray(suffix_only[first], np.float32), np.asarray(want[first], np.float32), atol=1e-3)


@pytest.mark.parametrize("impl,dtype,chunk_groups,q_lens", [
    ("pallas", jnp.float32, (0, 1), (1, 1, 1, 1, 1, 1, 5, 12)),
    ("pallas", jnp.bfloat16, (1, -1), (1, 3, 0, 1, 1, 1, 1, 12)),  # a chunk in a group, an empty row, a 1-token chunk
    ("pallas", jnp.float32, (-1, 0), (1, 9, 1, 0, 1, 9, 1, 1)),  # chunks between one-token rows
    ("ref", jnp.float32, (-1, 0), (1, 3, 0, 1, 1, 1, 1, 12))])
def test_mixed_step_one_token_rows_through_the_decode_cascade(monkeypatch, impl, dtype, chunk_groups, q_lens):
    """``INFERSCALE_MIXED_DECODE=cascade``: a mixed step's one-token rows run through the decode step's
    cascade kernel, the longer rows through the ragged kernel and shared part over a compacted batch;
    every token as the ragged kernel over each row's whole page list, padding tokens zeros.  The
    switch does change the program (the decode kernel is launched) and the store's key."""
    import re

    import jax

    from pallas_kernels import common
    q, kp, vp, casc, plain, n = mixed_case(10, dtype=dtype, chunk_groups=chunk_groups, q_lens=q_lens)
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]

    def decode_kernels():
        jaxpr = jax.make_jaxpr(lambda q, k, v: kv_cache._attend(q[None], k, v, None, casc, "pallas"))(q, kp, vp)
        return re.findall(r"paged_decode_\w+", str(jaxpr))
    monkeypatch.delenv("INFERSCALE_MIXED_DECODE", raising=False)
    base = common.switches()
    assert not decode_kernels()
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", "cascade")
    assert common.switches() != base and decode_kernels()
    out = kv_cache._attend(q[None], kp, vp, None, casc, impl)[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out[:n], want[:n], dtype)
    assert (np.asarray(out[n:], np.float32) == 0).all()  # padding tokens


@pytest.mark.parametrize("kv", [jnp.int8, jnp.float8_e4m3fn])
def test_mixed_step_split_on_compressed_pages(monkeypatch, kv):
    """The split path on compressed pages (a float32 scale per token and kv head): both kernels get
    the scales; as the ragged reference over whole page lists on the same codes."""
    from pallas_kernels.quant import quantize_kv
    q, kp, vp, casc, plain, n = mixed_case(11, dtype=jnp.bfloat16, chunk_groups=(0, -1),
                                           q_lens=(1, 3, 0, 1, 1, 1, 5, 1))
    (kq, ks), (vq, vs) = (quantize_kv(jnp.nan_to_num(x.astype(jnp.float32)), kv) for x in (kp, vp))
    want = kv_cache._attend(q[None], kq, vq, None, plain, "ref", (ks, vs))[0]
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", "cascade")
    out = kv_cache._attend(q[None], kq, vq, None, casc, "pallas", (ks, vs))[0]
    assert_close(out[:n], want[:n], jnp.bfloat16)
    assert (np.asarray(out[n:], np.float32) == 0).all()


def test_a_bad_mixed_decode_switch_is_refused_with_its_value(monkeypatch):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", "decode")
    with pytest.raises(ValueError, match="INFERSCALE_MIXED_DECODE='decode'.*'ragged', 'cascade'"):
        common.mixed_decode()


def mixed_step_kernels(q, kp, vp, casc, pattern: str) -> set[str]:
    """What ``pattern`` captures in the names of the kernels the mixed step's attention launches (its jaxpr)."""
    import re

    import jax
    jaxpr = jax.make_jaxpr(lambda q, k, v: kv_cache._attend(q[None], k, v, None, casc, "pallas"))(q, kp, vp)
    return set(re.findall(pattern, str(jaxpr)))


@pytest.mark.parametrize("spec,kernel", [("sp=2,bk=16", "r64_bk16_sp2"), ("br=32,sp=2,bk=16", "r32_bk16_sp2"),
                                         ("w=8,st=3,sp=2,bk=16", "r64_bk16_sp2"), ("br=16", "r16_bk64_sp1")])
def test_the_mixed_shared_switch_keeps_the_result(monkeypatch, spec, kernel):
    """``INFERSCALE_MIXED_SHARED`` (the benchmarks' A/B switch of the shared part's knobs in mixed steps)
    changes how the kernel runs (the launched kernel's name says its tiles and splits), never what it
    computes; the executable store's key follows it."""
    from pallas_kernels import common
    q, kp, vp, casc, plain, n = mixed_case(9, chunk_groups=(0, 1))
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    base = common.switches()
    kernels = functools.partial(mixed_step_kernels, q, kp, vp, casc, r"cascade_shared_g\d+_(\w+?)\b")
    assert kernels() == {"r64_bk64_sp1"}  # (the defaults; interpret mode runs one split, and a split holds
    # at least one tile: the case's shared prefixes are one 64-token tile, so more splits need bk=16)
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", spec)
    assert common.switches() != base and kernels() == {kernel}
    out = kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0]
    assert_close(out[:n], want[:n], jnp.float32)


@pytest.mark.parametrize("spec,kernel", [("br=16,w=8,sp=2,bk=16", "r16_bk16_sp2"), ("br=32,bk=16,st=2", "r32_bk16_sp1"),
                                         ("sp=2,bk=16", "r32_bk16_sp2")])
def test_the_decode_shared_switch_keeps_the_decode_steps(monkeypatch, spec, kernel):
    """``INFERSCALE_DECODE_SHARED`` (the A/B switch of the shared part's knobs in decode steps) changes how the
    decode step's cascade runs (the launched kernel's name), never what it computes (against the references, the
    decode step over the mixed case's one-token rows); the mixed steps keep their own knobs; the executable key
    follows it."""
    import re

    import jax
    from pallas_kernels import common
    q, kp, vp, casc, plain, n = mixed_case(17, chunk_groups=(0, 1))
    rows = np.flatnonzero(np.diff(np.asarray(casc.cu_q_lens)) == 1)  # the one-token rows as a decode step
    tok = np.asarray(casc.cu_q_lens)[rows]
    dec = kv_cache.AttnMeta(slots=None, page_table=casc.page_table[rows], q_lens=None, kv_lens=casc.kv_lens[rows],
                            group_pages=casc.group_pages, group_lens=casc.group_lens, row_group=casc.row_group[rows])
    qd = q[tok][None]

    def kernels():
        jaxpr = str(jax.make_jaxpr(lambda q, k, v: kv_cache._attend(q, k, v, None, dec, "pallas"))(qd, kp, vp))
        return set(re.findall(r"cascade_shared_g\d+_(r\d+_bk\d+_sp\d+)", jaxpr))

    base, before, mixed = common.switches(), kernels(), mixed_step_kernels(q, kp, vp, casc, r"(cascade_shared_\w+)")
    want = kv_cache._attend(qd, kp, vp, None, dec, "ref")[0]
    monkeypatch.setenv("INFERSCALE_DECODE_SHARED", spec)
    assert common.switches() != base and kernels() == {kernel} != before
    assert mixed_step_kernels(q, kp, vp, casc, r"(cascade_shared_\w+)") == mixed
    assert_close(kv_cache._attend(qd, kp, vp, None, dec, "pallas")[0], want, jnp.float32)


def test_a_bad_decode_shared_switch_is_refused_with_its_value(monkeypatch):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_DECODE_SHARED", "w=8,bk=24")
    with pytest.raises(ValueError, match="INFERSCALE_DECODE_SHARED='w=8,bk=24': 'bk=24' is invalid"):
        common.decode_shared_knobs()


def shared_launches(monkeypatch, forms: list | None = None) -> list:
    """The mixed step's shared-part launches from now on, each as (block_rows, num_warps, num_splits, row_group);
    ``forms`` (when given) gets each launch's form: ``"partials"`` (the ragged kernel continues from them) or
    ``"merged"`` (normalised, merged after the ragged kernel)."""
    seen = []
    for name, form in (("grouped_shared_prefix_attention", "merged"), ("grouped_shared_prefix_partials", "partials")):
        def spy(*args, real=getattr(kv_cache, name), form=form, **kw):
            seen.append((kw.get("block_rows"), kw.get("num_warps"), kw.get("num_splits"), np.asarray(args[5])))
            if forms is not None:
                forms.append(form)
            return real(*args, **kw)
        monkeypatch.setattr(kv_cache, name, spy)
    return seen


@pytest.mark.parametrize("q_lens", [(1, 1, 1, 1, 1, 1, 5, 12), (1, 3, 0, 1, 1, 1, 1, 12)])
def test_the_mixed_shared_chunk_launch_routes_each_token_and_keeps_the_result(monkeypatch, q_lens):
    """``INFERSCALE_MIXED_SHARED``'s ``cb=N`` (``cw=W``, ``cs=S``): the prefill chunks' tokens go through a
    shared-part launch of their own with N-row blocks (W warps, S splits), the one-token rows' (a decode row, a
    1-token chunk) through the other; each launch sees exactly its tokens' groups (an empty row has none), and
    the step computes what it computed before; the executable store's key follows the switch."""
    from pallas_kernels import common
    q, kp, vp, casc, plain, n = mixed_case(9, chunk_groups=(0, 1), q_lens=q_lens)
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    seen = shared_launches(monkeypatch)
    base = common.switches()
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "cb=32,cw=8,cs=3,sp=2,bk=16")
    assert common.switches() != base
    out = kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0]
    assert_close(out[:n], want[:n], jnp.float32)
    lens = np.asarray(q_lens)
    group = np.concatenate([np.repeat([0, 1, -1, 0, 1, -1, 0, 1], lens), [-1] * 3])  # each token's (3 padding)
    one = np.concatenate([np.repeat(lens == 1, lens), [False] * 3])
    (rows_a, warps_a, splits_a, g_a), (rows_b, warps_b, splits_b, g_b) = seen
    assert (rows_a, warps_a, splits_a) == (kv_cache.MIXED_BLOCK_ROWS, None, 2) and (rows_b, warps_b, splits_b) == (
        32, 8, 3)
    np.testing.assert_array_equal(g_a, np.where(one, group, -1))
    np.testing.assert_array_equal(g_b, np.where(one, -1, group))
    seen.clear()
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "sp=2,bk=16")  # (without cb: one launch of every token)
    kv_cache._attend(q[None], kp, vp, None, casc, "pallas")
    assert len(seen) == 1 and (seen[0][3] == group).all()


def test_the_chunk_launch_is_one_launch_beside_the_decode_cascade(monkeypatch):
    """With ``INFERSCALE_MIXED_DECODE=cascade`` the one-token rows leave the mixed path (the decode step's
    cascade kernel takes them), so with ``cb`` the chunks' shared part is one launch with the chunks' row
    blocks: no empty second launch; the result is unchanged."""
    q, kp, vp, casc, plain, n = mixed_case(9, chunk_groups=(0, 1))
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    seen = shared_launches(monkeypatch)
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", "cascade")
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "cb=32,sp=2,bk=16")
    out = kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0]
    assert_close(out[:n], want[:n], jnp.float32)
    assert [launch[0] for launch in seen] == [32]


@pytest.mark.parametrize("spec", ["cw=8", "cs=2,sp=2", "br=32,cw=4,cs=1"])
def test_the_chunk_knobs_without_cb_are_refused(monkeypatch, spec):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", spec)
    with pytest.raises(ValueError, match="INFERSCALE_MIXED_SHARED=.*add cb=N"):
        common.mixed_shared_knobs()


@pytest.mark.parametrize("spec", ["br=0", "sp=two", "rows=4", "br", "br=48", "bk=8", "sp=\u00b2", "cb=24"])
def test_a_bad_mixed_shared_switch_is_refused_with_its_value(monkeypatch, spec):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", spec)
    with pytest.raises(ValueError, match="INFERSCALE_MIXED_SHARED=.*NAME=N"):
        common.mixed_shared_knobs()


@pytest.mark.parametrize("spec,want", [("sp=3,sl=0", {"ragged_paged_attention_bq16_bkv16_g4_s3_i1"}),
                                       ("sp=2,lk=4", {"ragged_paged_attention_bq16_bkv16_g4_s2_i1_sl",
                                                      "ragged_merge_s2"}),
                                       ("sp=2,sl=1,lk=4", {"ragged_paged_attention_bq16_bkv16_g4_s2_i1_sl",
                                                           "ragged_merge_s2"}),
                                       ("tl=1", {"ragged_paged_attention_bq16_bkv16_g4_s1_i1_big",
                                                 "ragged_paged_attention_bq16_bkv16_g4_s1_i1_small"})])
def test_the_mixed_ragged_switch_keeps_the_result(monkeypatch, spec, want):
    """``INFERSCALE_MIXED_RAGGED`` (the benchmarks' A/B switch of the ragged kernel's knobs in mixed steps):
    forced splits, split-KV for the longest blocks only (the default, ``sl=1``; ``lk``: past how many keys)
    or for every block (``sl=0``), the two tiles in launches of their own (``tl=1``), change
    the kernels a mixed step launches, never what it computes; the executable store's key follows it."""
    from pallas_kernels import common
    q, kp, vp, casc, plain, n = mixed_case(9, chunk_groups=(0, 1))
    want_out = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    base = common.switches()
    kernels = functools.partial(mixed_step_kernels, q, kp, vp, casc, r"(ragged_\w+)")
    # (fp32: 16-key tiles; interpret mode: one split, started from the shared part's one split: _i1)
    assert kernels() == {"ragged_paged_attention_bq16_bkv16_g4_s1_i1"}
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", spec)
    assert common.switches() != base and kernels() == want
    out = kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0]
    assert_close(out[:n], want_out[:n], jnp.float32)


@pytest.mark.parametrize("spec,match", [("sl=2", "sl: 0 or 1"), ("sp=0", "NAME=N"), ("bq=3", "NAME=N"),
                                        ("tl=2", "NAME=N"), ("lk=x", "NAME=N"), ("sk=24", "sk: a power of two")])
def test_a_bad_mixed_ragged_switch_is_refused_with_its_value(monkeypatch, spec, match):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", spec)
    with pytest.raises(ValueError, match=f"INFERSCALE_MIXED_RAGGED.*{match}"):
        common.mixed_ragged_knobs()


def test_the_mixed_ragged_switch_parses_to_the_kernels_arguments(monkeypatch):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", "sl=1,lk=300,sp=4,w=8")
    assert common.mixed_ragged_knobs() == dict(split_longest=True, long_keys=300, kv_splits=4, num_warps=8)
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", "sl=0")
    assert common.mixed_ragged_knobs() == dict(split_longest=False)
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", "sk=64,st=2")
    assert common.mixed_ragged_knobs() == dict(small_block_kv=64, num_stages=2)
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", "")
    assert common.mixed_ragged_knobs() == {}


@pytest.mark.parametrize("chunk_groups", [(-1, -1), (0, 1)])
def test_normalised_shared_partials_keep_the_mixed_and_decode_steps(monkeypatch, chunk_groups):
    """``INFERSCALE_SHARED_PARTIALS=q_dtype`` (the default): the shared part stores bf16 normalised partials (its
    kernel's name ends in ``_nq``) and both readers - the mixed step's ragged kernel and the decode step's suffix
    kernel - still give the reference's result; fp32 pages keep fp32 partials; ``fp32`` turns it off; the
    executable key follows the switch."""
    from pallas_kernels import common, grouped_cascade_decode_attention
    q, kp, vp, casc, plain, n = mixed_case(11, dtype=jnp.bfloat16, chunk_groups=chunk_groups)
    want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
    monkeypatch.delenv("INFERSCALE_SHARED_PARTIALS", raising=False)
    base = common.switches()
    monkeypatch.setenv("INFERSCALE_SHARED_PARTIALS", "fp32")
    assert common.switches() != base
    assert not any(k.endswith("_nq") for k in mixed_step_kernels(q, kp, vp, casc, r"(cascade_shared_\w+)"))
    assert_close(kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0][:n], want[:n], jnp.bfloat16)
    monkeypatch.delenv("INFERSCALE_SHARED_PARTIALS")
    assert any(k.endswith("_nq") for k in mixed_step_kernels(q, kp, vp, casc, r"(cascade_shared_\w+)"))
    out = kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0]
    assert_close(out[:n], want[:n], jnp.bfloat16)
    rows = np.flatnonzero(np.diff(np.asarray(casc.cu_q_lens)) == 1)  # the one-token rows as a decode step
    tok = np.asarray(casc.cu_q_lens)[rows]
    args = (q[tok], kp, vp, casc.group_pages, casc.group_lens, casc.row_group[rows], casc.page_table[rows],
            casc.kv_lens[rows])
    assert_close(grouped_cascade_decode_attention(*args), grouped_cascade_decode_attention_ref(*args), jnp.bfloat16)
    q32, kp32, vp32, casc32, _, _ = mixed_case(11, chunk_groups=chunk_groups)  # fp32 pages: fp32 partials
    assert not any(k.endswith("_nq") for k in mixed_step_kernels(q32, kp32, vp32, casc32, r"(cascade_shared_\w+)"))


def test_a_bad_shared_partials_switch_is_refused_with_its_value(monkeypatch):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_SHARED_PARTIALS", "bf16")
    with pytest.raises(ValueError, match="INFERSCALE_SHARED_PARTIALS='bf16'.*'q_dtype', 'fp32'"):
        common.shared_partials()


@pytest.mark.parametrize("chunk_groups", [(-1, -1), (0, 1)])
def test_the_shared_part_gathering_its_own_queries_keeps_the_mixed_and_decode_steps(monkeypatch, chunk_groups):
    """``INFERSCALE_SHARED_Q=kernel``: the shared part's programs gather their packed rows' queries from ``q`` (no
    packed copy; padding tokens' NaN queries must not reach a packed row); the mixed step and the decode step's
    cascade still give the reference's result, in bf16 and fp32; the executable key follows the switch."""
    from pallas_kernels import common, grouped_cascade_decode_attention
    monkeypatch.delenv("INFERSCALE_SHARED_Q", raising=False)
    base = common.switches()
    monkeypatch.setenv("INFERSCALE_SHARED_Q", "kernel")
    assert common.switches() != base
    for dtype in (jnp.bfloat16, jnp.float32):
        q, kp, vp, casc, plain, n = mixed_case(12, dtype=dtype, chunk_groups=chunk_groups)
        want = kv_cache._attend(q[None], kp, vp, None, plain, "ref")[0]
        out = kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0]
        assert_close(out[:n], want[:n], dtype)
        launched = mixed_step_kernels(q, kp, vp, casc, r"(cascade_shared_\w+)")
        assert launched and all(k.endswith("_qk") for k in launched)
        rows = np.flatnonzero(np.diff(np.asarray(casc.cu_q_lens)) == 1)  # the one-token rows as a decode step
        tok = np.asarray(casc.cu_q_lens)[rows]
        args = (q[tok], kp, vp, casc.group_pages, casc.group_lens, casc.row_group[rows], casc.page_table[rows],
                casc.kv_lens[rows])
        for kw in ({}, dict(block_rows=16, num_splits=2, block_kv=16)):
            got = grouped_cascade_decode_attention(*args, **kw)
            assert_close(got, grouped_cascade_decode_attention_ref(*args), dtype)
    # the same kernel output as the packed copy's, bit for bit (the same rows, the same tiles)
    q, kp, vp, casc, plain, n = mixed_case(13, dtype=jnp.bfloat16, chunk_groups=chunk_groups)
    own = np.asarray(kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0][:n], np.float32)
    monkeypatch.setenv("INFERSCALE_SHARED_Q", "gather")
    assert not any(k.endswith("_qk") for k in mixed_step_kernels(q, kp, vp, casc, r"(cascade_shared_\w+)"))
    np.testing.assert_array_equal(own, np.asarray(kv_cache._attend(q[None], kp, vp, None, casc, "pallas")[0][:n],
                                                  np.float32))


def test_a_bad_shared_q_switch_is_refused_with_its_value(monkeypatch):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_SHARED_Q", "tma")
    with pytest.raises(ValueError, match="INFERSCALE_SHARED_Q='tma'.*'gather', 'kernel'"):
        common.shared_q_rows()


def test_the_decode_steps_shared_part_takes_8_warps_on_small_row_blocks(monkeypatch):
    """Run BF: 8 warps on the decode steps' shared part where its row blocks are 32 rows or fewer (64 rows over 8
    segments: -1.8% a step); 64-row blocks (256 rows) and one group keep the kernel's own; the switch overrides.
    Checked where the engine decides it, and in the launch it lowers to for CUDA."""
    import re

    import jax
    from pallas_kernels import common
    monkeypatch.delenv("INFERSCALE_DECODE_SHARED", raising=False)
    kp = jax.ShapeDtypeStruct((8, 600, 16, 128), jnp.bfloat16)
    knobs = functools.partial(kv_cache._decode_shared_knobs, head_dim=128, k_pages=kp, q_heads=32, dtype=jnp.bfloat16)
    assert knobs(64, groups=16)["num_warps"] == 8  # 64 x 4 rows over 16 groups: 32-row blocks
    assert knobs(128, groups=16)["num_warps"] == 8
    assert "num_warps" not in knobs(256, groups=16)  # 64-row blocks
    assert "num_warps" not in knobs(64, groups=1)  # one group: the kernel's own choice
    monkeypatch.setenv("INFERSCALE_DECODE_SHARED", "w=4")
    assert knobs(64, groups=16)["num_warps"] == 4
    monkeypatch.setenv("INFERSCALE_DECODE_SHARED", "br=64")
    assert "num_warps" not in knobs(64, groups=16)
    monkeypatch.delenv("INFERSCALE_DECODE_SHARED")
    sd = jax.ShapeDtypeStruct
    monkeypatch.setattr(common, "default_interpret", lambda: False)  # (the compiled path, as on a GPU)
    for rows, warps in ((64, "8"), (256, "4")):
        meta = kv_cache.AttnMeta(slots=None, page_table=sd((rows, 8), jnp.int32), q_lens=None,
                                 kv_lens=sd((rows,), jnp.int32), group_pages=sd((16, 256), jnp.int32),
                                 group_lens=sd((16,), jnp.int32), row_group=sd((rows,), jnp.int32))
        fn = jax.jit(lambda q, k, v, meta: kv_cache._attend(q, k, v, None, meta, "pallas"))
        text = fn.trace(sd((1, rows, 32, 128), jnp.bfloat16), kp, kp, meta).lower(
            lowering_platforms=("cuda",)).as_text()
        shared = re.search(r'name = "cascade_shared_[^"]*", num_stages = \d+ : i32, num_warps = (\d+)', text)
        assert shared and shared.group(1) == warps, (rows, shared and shared.group(0))
