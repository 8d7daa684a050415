"""KV splice with RoPE shift, and the KV write, against their references (interpret mode)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import paged_decode_attention
from pallas_kernels.kv_write import write_kv, write_kv_pallas, write_kv_ref
from pallas_kernels.splice import rope_rotate_ref, splice_kv, splice_kv_ref


def inv_freq(d, theta=10000.0):
    return (1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)).astype(jnp.float32)


def bits(x):
    """Bit pattern of an array (so -0.0 != 0.0 and NaN == NaN)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def random_pages(seed, shape, dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(k1, shape, jnp.float32).astype(dtype),
            jax.random.normal(k2, shape, jnp.float32).astype(dtype))


def disjoint_slots(seed, n, num_slots, first=0):
    perm = np.random.default_rng(seed).permutation(np.arange(first, num_slots))
    return jnp.asarray(perm[:n], jnp.int32), jnp.asarray(perm[n:2 * n], jnp.int32)


def rows(pages, slots):
    """[..., N, D] rows of `slots` from [..., P, S, D] pages."""
    *lead, p, s, d = pages.shape
    return np.asarray(pages.reshape(*lead, p * s, d))[..., np.asarray(slots), :]


def untouched(pages, dst):
    mask = np.ones(pages.shape[-3] * pages.shape[-2], bool)
    mask[np.asarray(dst)[np.asarray(dst) >= 0]] = False
    *lead, p, s, d = pages.shape
    return bits(pages.reshape(*lead, p * s, d))[..., mask, :]


@pytest.mark.parametrize("dtype,d,s", [(jnp.float32, 64, 8), (jnp.bfloat16, 128, 16)])
def test_shift_zero_is_bit_exact_copy(dtype, d, s):
    kp, vp = random_pages(20, (2, 12, s, d), dtype)
    # Signed zeros and NaNs in the first two sources must survive the copy bit for bit.
    kp = kp.at[:, 1, 0, :4].set(-0.0).at[:, 1, 1, :2].set(jnp.nan)
    src, dst = disjoint_slots(21, 40, 12 * s, first=s + 2)
    src = src.at[0].set(s).at[1].set(s + 1)
    shift = jnp.zeros((40,), jnp.int32)
    k2, v2 = splice_kv(kp, vp, src, dst, shift, inv_freq(d))
    np.testing.assert_array_equal(bits(rows(k2, dst)), bits(rows(kp, src)))
    np.testing.assert_array_equal(bits(rows(v2, dst)), bits(rows(vp, src)))
    np.testing.assert_array_equal(untouched(k2, dst), untouched(kp, dst))
    np.testing.assert_array_equal(untouched(v2, dst), untouched(vp, dst))


@pytest.mark.parametrize("dtype,d,s,n", [(jnp.float32, 64, 8, 45), (jnp.float32, 128, 16, 70),
                                         (jnp.bfloat16, 64, 32, 33)])
def test_shift_rotates_k_and_copies_v(dtype, d, s, n):
    p = 2 + 2 * n // s
    kp, vp = random_pages(30 + d, (2, p, s, d), dtype)
    src, dst = disjoint_slots(31 + n, n, p * s, first=s)
    shift = jax.random.randint(jax.random.PRNGKey(32 + n), (n,), -300, 300).at[:3].set(0)
    k2, v2 = splice_kv(kp, vp, src, dst, shift, inv_freq(d))
    want = rope_rotate_ref(jnp.asarray(rows(kp, src)), shift, inv_freq(d))  # [Hkv, N, D] fp32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(rows(k2, dst), np.float32), np.asarray(want),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(bits(rows(v2, dst)), bits(rows(vp, src)))
    np.testing.assert_array_equal(untouched(k2, dst), untouched(kp, dst))
    np.testing.assert_array_equal(untouched(v2, dst), untouched(vp, dst))
    kr, vr = splice_kv_ref(kp, vp, src, dst, shift, inv_freq(d))
    np.testing.assert_allclose(np.asarray(k2, np.float32), np.asarray(kr, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(bits(v2), bits(vr))


def test_multi_layer_with_padding_entries_and_explicit_blocking():
    """[L, Hkv, P, S, D] pages in one call; dst < 0 entries are skipped."""
    kp, vp = random_pages(40, (3, 4, 10, 8, 64), jnp.bfloat16)
    src, dst = disjoint_slots(41, 29, 80, first=8)
    dst = dst.at[jnp.array([3, 17, 28])].set(-1)
    src = src.at[17].set(0)  # padding convention: src 0, dst -1
    shift = jax.random.randint(jax.random.PRNGKey(42), (29,), 0, 50)
    k2, v2 = splice_kv(kp, vp, src, dst, shift, inv_freq(64), block_tokens=16,
                       heads_per_program=2)
    kr, vr = splice_kv_ref(kp, vp, src, dst, shift, inv_freq(64))
    np.testing.assert_array_equal(bits(v2), bits(vr))
    np.testing.assert_allclose(np.asarray(k2, np.float32), np.asarray(kr, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(untouched(k2, dst), untouched(kp, dst))


def test_splice_inside_jit_with_donated_pages():
    """The engine's path: traced slots (host checks skipped) and donated, aliased pages."""
    kp, vp = random_pages(45, (2, 6, 16, 64), jnp.float32)
    src, dst = disjoint_slots(46, 20, 96, first=16)
    shift = jax.random.randint(jax.random.PRNGKey(47), (20,), -9, 9)
    want = splice_kv_ref(kp, vp, src, dst, shift, inv_freq(64))
    step = jax.jit(splice_kv, donate_argnames=("k_pages", "v_pages"))
    k2, v2 = step(jnp.copy(kp), jnp.copy(vp), src, dst, shift, inv_freq(64))
    np.testing.assert_allclose(np.asarray(k2), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bits(v2), bits(want[1]))


def test_rotation_composes_attention_at_new_positions():
    """Keys cached at positions p, spliced with shift d, attend like keys rotated at p + d."""
    hq, hkv, d, s, t = 8, 2, 64, 8, 21
    freqs = inv_freq(d, theta=500000.0)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(50), 3)
    k_raw = jax.random.normal(kk, (hkv, t, d), jnp.float32)  # un-rotated keys of the segment
    v_raw = jax.random.normal(kv, (hkv, t, d), jnp.float32)
    old_pos = 37 + jnp.arange(t, dtype=jnp.int32)  # where the segment was computed
    new_pos = 5 + jnp.arange(t, dtype=jnp.int32)  # where it is injected
    q_pos = jnp.array([new_pos[-1] + 1], jnp.int32)  # the query right after the segment
    q = rope_rotate_ref(jax.random.normal(kq, (1, hq, d), jnp.float32).transpose(1, 0, 2),
                        q_pos, freqs).transpose(1, 0, 2)  # [1, Hq, D]

    # Cache: segment at pages 5.. (rotated at old positions), destination pages 1..3.
    num_pages = 9
    kp = jnp.full((hkv, num_pages * s, d), jnp.nan, jnp.float32)
    vp = jnp.full((hkv, num_pages * s, d), jnp.nan, jnp.float32)
    src = 5 * s + jnp.arange(t, dtype=jnp.int32)
    dst = 1 * s + jnp.arange(t, dtype=jnp.int32)
    kp = kp.at[:, src].set(rope_rotate_ref(k_raw, old_pos, freqs)).reshape(hkv, num_pages, s, d)
    vp = vp.at[:, src].set(v_raw).reshape(hkv, num_pages, s, d)
    k2, v2 = splice_kv(kp, vp, src, dst, new_pos - old_pos, freqs)

    table = jnp.array([[1, 2, 3]], jnp.int32)
    out = paged_decode_attention(q, k2, v2, table, jnp.array([t], jnp.int32), num_splits=2)

    k_direct = rope_rotate_ref(k_raw, new_pos, freqs)  # [Hkv, T, D]
    g = hq // hkv
    logits = jnp.einsum("hgd,htd->hgt", q[0].reshape(hkv, g, d), k_direct,
                        precision="highest") / np.sqrt(d)
    want = jnp.einsum("hgt,htd->hgd", jax.nn.softmax(logits, -1), v_raw, precision="highest")
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want.reshape(hq, d)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["overlap", "duplicate", "range"])
def test_splice_rejects_bad_slots(case):
    kp, vp = random_pages(60, (2, 6, 8, 64), jnp.float32)
    src = jnp.array([8, 9, 10], jnp.int32)
    dst = {"overlap": [11, 9, 12], "duplicate": [11, 11, 12], "range": [11, 12, 48]}[case]
    with pytest.raises(ValueError, match="slots"):
        splice_kv(kp, vp, src, jnp.array(dst, jnp.int32), jnp.zeros(3, jnp.int32),
                  inv_freq(64))


def test_splice_lowers_to_triton():
    sd = jax.ShapeDtypeStruct
    pages = sd((2, 8, 64, 16, 128), jnp.bfloat16)
    vec = sd((100,), jnp.int32)
    fn = jax.jit(functools.partial(splice_kv, interpret=False))
    text = fn.trace(pages, pages, vec, vec, vec, sd((64,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


# ---- KV write ----

@pytest.mark.parametrize("impl", [write_kv, write_kv_pallas])
@pytest.mark.parametrize("dtype,d,s,n", [(jnp.float32, 64, 8, 37), (jnp.bfloat16, 128, 16, 64)])
def test_write_kv_matches_ref_exactly(impl, dtype, d, s, n):
    hkv, p = 2, 12
    kp, vp = random_pages(70 + n, (hkv, p, s, d), dtype)
    k_new, v_new = random_pages(71 + n, (n, hkv, d), dtype)
    slots = np.random.default_rng(72 + n).permutation(np.arange(s, p * s))[:n]
    slots[-3:] = [0, 3, 3]  # padding tokens land in the null page (duplicates allowed)
    slots = jnp.asarray(slots, jnp.int32)
    k2, v2 = impl(kp, vp, k_new, v_new, slots)
    kr, vr = write_kv_ref(kp, vp, k_new, v_new, slots)
    # Page 0 holds whichever padding token won; every other page must match bit for bit.
    np.testing.assert_array_equal(bits(k2[:, 1:]), bits(kr[:, 1:]))
    np.testing.assert_array_equal(bits(v2[:, 1:]), bits(vr[:, 1:]))
    assert not np.array_equal(bits(k2[:, 1:]), bits(kp[:, 1:]))  # something was written
    np.testing.assert_array_equal(rows(k2, slots[:-3]), np.asarray(jnp.swapaxes(k_new, 0, 1))[:, :-3])


def test_write_kv_pallas_lowers_to_triton():
    sd = jax.ShapeDtypeStruct
    pages, new = sd((8, 64, 16, 128), jnp.bfloat16), sd((100, 8, 128), jnp.bfloat16)
    fn = jax.jit(functools.partial(write_kv_pallas, interpret=False))
    text = fn.trace(pages, pages, new, new, sd((100,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
