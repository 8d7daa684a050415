"""The ragged kernel started from partials over other keys (``init``: the engine's mixed steps hand it
the cascade shared part's split partials, so its output needs no merge after it), CPU, interpret mode.

The kernel against its reference on the ragged cases of ``test_kernels_ragged`` (decode rows, chunks
over page boundaries, empty rows, padding tokens, GQA 1-16, forced split-KV in both forms and the
long blocks ``split_longest`` splits), with random partials of 1-3 splits: tokens without partials,
splits without keys (the shared kernel's finite floor and ``l = 0``), and every packed row no token
points at poisoned with NaN, so a kernel that multiplies a row it should not read fails.  The
reference's merge (``merge_partials``) is checked against the shared part's own normalised reference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (grouped_shared_prefix_attention_ref, grouped_shared_prefix_partials,
                            ragged_paged_attention, ragged_paged_attention_ref)
from pallas_kernels.cascade_attention import merge_partials
from pallas_kernels.quant import quantize_kv
from tests.kernels.test_kernels_mixed_cascade import shared_case
from tests.kernels.test_kernels_ragged import CASES, LONG_CASES, TOL, make_case

_FLOOR = -1e30  # the shared kernel's running-max start: a split that saw no key keeps it, with l = 0


def random_init(seed, n, hq, hkv, d, splits, *, absent=0.3):
    """(row [N], o [Hkv, NS, R, D], m, l [Hkv, NS, R]): about ``absent`` of the tokens without partials
    (row -1); each other token's G heads at a random packed slot; one split of some tokens empty; rows
    no token points at are NaN."""
    rng = np.random.default_rng(seed)
    g = hq // hkv
    slots = n + 3
    rows = slots * g  # (slot 0 is never given: a token without partials reads its NaN rows, clamped there)
    row = np.where(rng.random(n) < absent, -1, (1 + rng.permutation(slots - 1)[:n]) * g).astype(np.int32)
    o = np.full((hkv, splits, rows, d), np.nan, np.float32)
    m = np.full((hkv, splits, rows), np.nan, np.float32)
    l = np.full((hkv, splits, rows), np.nan, np.float32)
    for tok in np.flatnonzero(row >= 0):
        at = slice(row[tok], row[tok] + g)
        l[:, :, at] = rng.uniform(0.5, 30.0, (hkv, splits, g))
        m[:, :, at] = rng.uniform(-3.0, 8.0, (hkv, splits, g))
        o[:, :, at] = rng.standard_normal((hkv, splits, g, d)) * l[:, :, at, None]  # (unnormalised: ~ l)
        if splits > 1 and tok % 3 == 0:  # a split past a short prefix: no key
            o[:, 1, at], m[:, 1, at], l[:, 1, at] = 0.0, _FLOOR, 0.0
    return tuple(jnp.asarray(x) for x in (row, o, m, l))


def check_init_case(args, dtype, init, kw):
    """The kernel with ``init`` against the reference with it: output (finite everywhere) and lse."""
    out, lse = ragged_paged_attention(*args, init=init, return_lse=True, **kw)
    want, want_lse = ragged_paged_attention_ref(*args, init=init, return_lse=True)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "a NaN partial row or pool slot leaked into the output"
    np.testing.assert_allclose(out, np.asarray(want.astype(jnp.float32)), **TOL[dtype])
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    ok = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[ok], want_lse[ok], atol=1e-4 if dtype == jnp.float32 else 2e-2, rtol=1e-5)
    # the plain call is unchanged by the new argument's absence
    plain = ragged_paged_attention(*args, **kw)
    np.testing.assert_allclose(np.asarray(plain.astype(jnp.float32)),
                               np.asarray(ragged_paged_attention_ref(*args).astype(jnp.float32)), **TOL[dtype])


@pytest.mark.parametrize("case,splits", [(0, 2), (1, 1), (2, 3), (3, 2), (5, 2), (8, 3), (9, 1), (10, 2), (11, 2),
                                         (12, 2)])
def test_kernel_with_init_matches_ref(case, splits):
    """Both tiles (decode rows and chunks), GQA 1-16, split-KV (every block split) and the tiny-N single
    tile, started from 1-3 splits' partials (case 12: all padding)."""
    dtype, hq, hkv, d, s, q_lens, cached, pad, kw = CASES[case]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=hq, Hkv=hkv, D=d, S=s, dtype=dtype)
    init = random_init(case, args[0].shape[0], hq, hkv, d, splits)
    check_init_case(args, dtype, init, {**kw, "split_longest": False} if kw.get("kv_splits", 1) > 1 else kw)


@pytest.mark.parametrize("case", range(len(LONG_CASES)))
@pytest.mark.parametrize("longest", [True, False])
def test_split_blocks_start_from_init_once(case, longest):
    """A split block starts only its first split from the partials (split_longest's compact partials and
    merge kernel; every block split, merged in jnp): counted once, the result equals the reference."""
    dtype, hq, hkv, d, s, q_lens, cached, pad, kw = LONG_CASES[case]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=hq, Hkv=hkv, D=d, S=s, dtype=dtype)
    init = random_init(100 + case, args[0].shape[0], hq, hkv, d, 2, absent=0.2)
    check_init_case(args, dtype, init, {**kw, "split_longest": longest, "long_keys": 16})


@pytest.mark.parametrize("kv", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("longest", [True, False])
def test_init_on_compressed_pages(kv, longest):
    """Compressed pages (the scale refs come before the init refs): the kernel with init against the reference,
    split blocks both ways."""
    dtype, hq, hkv, d, s, q_lens, cached, pad, kw = LONG_CASES[0]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=hq, Hkv=hkv, D=d, S=s, dtype=jnp.bfloat16)
    q, kp, vp, *rest = args
    (kq, ks), (vq, vs) = quantize_kv(jnp.nan_to_num(kp), kv), quantize_kv(jnp.nan_to_num(vp), kv)
    init = random_init(300, q.shape[0], hq, hkv, d, 2)
    args = (q, kq, vq, *rest)
    out = ragged_paged_attention(*args, k_scale=ks, v_scale=vs, init=init, **{**kw, "split_longest": longest,
                                                                              "long_keys": 16})
    want = ragged_paged_attention_ref(*args, k_scale=ks, v_scale=vs, init=init)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(want.astype(jnp.float32)), **TOL[jnp.bfloat16])


def test_reference_merge_of_shared_partials_is_the_shared_reference():
    """``merge_partials`` of the shared kernel's partials (several splits, rows outside every group, an empty
    prefix) is the shared part's normalised output and natural-log lse."""
    glens, rg = [40, 21, 0, 16, 8], [0, 1, 2, -1, 3, 0, 1, -1, 0, 3, 2]
    args = shared_case(5, glens, 5, rg, dtype=jnp.float32)
    init = grouped_shared_prefix_partials(*args, sm_scale=0.3, block_rows=16, num_splits=3, block_kv=16)
    assert init[1].shape[1] == 3 and (np.asarray(init[0])[np.asarray(rg) < 0] == -1).all()
    assert (np.asarray(init[0])[np.asarray(rg) == 2] == -1).all()  # (group 2: an empty prefix)
    o, lse = merge_partials(init, args[0].shape[1])
    o_ref, lse_ref = grouped_shared_prefix_attention_ref(*args, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(lse_ref)))
    ok = np.isfinite(np.asarray(lse_ref))
    np.testing.assert_allclose(np.asarray(lse)[ok], np.asarray(lse_ref)[ok], atol=1e-5, rtol=1e-5)


def test_partials_need_a_group_table():
    glens, rg = [16], [0, -1]
    q, kp, vp, gp, gl, row = shared_case(1, glens, 2, rg)
    with pytest.raises(ValueError, match=r"group_pages.shape.*\[G >= 1, Ps >= 1\]"):
        grouped_shared_prefix_partials(q, kp, vp, gp[:0], gl[:0], row)


@pytest.mark.parametrize("fn", [ragged_paged_attention, ragged_paged_attention_ref])
@pytest.mark.parametrize("change", ["rows", "heads", "stats", "tuple"])
def test_bad_init_is_refused_with_its_shapes(fn, change):
    dtype, hq, hkv, d, s, q_lens, cached, pad, _ = CASES[1]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=hq, Hkv=hkv, D=d, S=s, dtype=dtype)
    row, o, m, l = random_init(7, args[0].shape[0], hq, hkv, d, 2)
    bad = {"rows": (row[:-1], o, m, l), "heads": (row, o[:1], m[:1], l[:1]), "stats": (row, o, m[:, :1], l),
           "tuple": (row, o, m)}[change]
    with pytest.raises(ValueError, match=r"init.*\(row \[N="):
        fn(*args, init=bad)


def normalised(init, dtype):
    """``init``'s partials in the shared part's ``q_dtype`` form: (o / l in ``dtype``, m + log2 l, 1; a split
    without keys keeps its m, l 0, o 0)."""
    row, o, m, l = init
    has = np.asarray(l) > 0
    safe = np.where(has, np.asarray(l), 1.0)
    o_n = np.where(has[..., None], np.asarray(o) / safe[..., None], 0.0)
    return (row, jnp.asarray(o_n, dtype), jnp.asarray(np.where(has, np.asarray(m) + np.log2(safe), np.asarray(m))),
            jnp.asarray(has.astype(np.float32)))


@pytest.mark.parametrize("table,case,longest", [("cases", 0, True), ("cases", 1, False), ("long", 0, True)])
def test_normalised_16_bit_partials_are_the_same_merge(table, case, longest):
    """The ``q_dtype`` form of the partials (normalised ``o`` in bf16, ``m`` the base-2 lse, ``l`` 1) gives the
    kernel and the reference the result of the fp32 form, within bf16's rounding of ``o``."""
    dtype, hq, hkv, d, s, q_lens, cached, pad, kw = {"cases": CASES, "long": LONG_CASES}[table][case]
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=hq, Hkv=hkv, D=d, S=s, dtype=dtype)
    init = random_init(200 + case, args[0].shape[0], hq, hkv, d, 2)
    half = normalised(init, jnp.bfloat16)
    assert half[1].dtype == jnp.bfloat16
    want = np.asarray(ragged_paged_attention_ref(*args, init=init).astype(jnp.float32))
    ref = np.asarray(ragged_paged_attention_ref(*args, init=half).astype(jnp.float32))
    out = np.asarray(ragged_paged_attention(*args, init=half, **{**kw, "split_longest": longest}).astype(jnp.float32))
    np.testing.assert_allclose(ref, want, **TOL[jnp.bfloat16])
    np.testing.assert_allclose(out, want, **TOL[jnp.bfloat16])
    assert np.isfinite(out).all()
