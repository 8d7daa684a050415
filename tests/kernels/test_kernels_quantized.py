"""The Pallas kernels on compressed pages (int8 / float8_e4m3fn with a float32 scale per token and
kv head, pallas_kernels/quant.py), in interpret mode, against their references: decode (direct and
split), ragged (prefill chunks and decode rows, ragged lengths over page boundaries, split), and
cascade (shared prefix + suffixes, a row outside the group).  Also the scales' validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cascade_attention import shared_prefix_decode_attention, shared_prefix_decode_attention_ref
from pallas_kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.kv_write import write_kv_quantized, write_kv_quantized_pallas
from pallas_kernels.quant import quantize_kv, scales_on_rows
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_ref

KV = [jnp.int8, jnp.float8_e4m3fn]
S, D, P = 8, 16, 24


def pages(hkv, key=0, outliers=True):
    """Random K/V pages with a few channels 20x larger (as a real K has), quantized."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    big = jnp.where(jnp.arange(D) < 2, 20.0, 1.0) if outliers else 1.0
    k = jax.random.normal(k1, (hkv, P, S, D)) * big
    v = jax.random.normal(k2, (hkv, P, S, D))
    return k, v


def close(out, ref, dtype):
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    assert np.max(np.abs(out - ref)) <= tol * max(1.0, float(np.max(np.abs(ref)))), np.max(np.abs(out - ref))


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("qdtype,hq,hkv,splits,fold,k_major", [
    (jnp.bfloat16, 8, 2, 1, True, False), (jnp.float32, 4, 4, 3, True, False), (jnp.bfloat16, 7, 1, 2, True, False),
    (jnp.float32, 8, 2, 2, False, False), (jnp.bfloat16, 8, 2, 2, True, True)])
def test_decode_on_compressed_pages(kv, qdtype, hq, hkv, splits, fold, k_major):
    k, v = pages(hkv)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    q = jax.random.normal(jax.random.PRNGKey(3), (3, hq, D)).astype(qdtype)
    table = jnp.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 12]], jnp.int32)
    lens = jnp.array([33, 9, 40], jnp.int32)  # across page boundaries, a partial last page
    out = paged_decode_attention(q, kq, vq, table, lens, k_scale=ks, v_scale=vs, num_splits=splits,
                                 fold_scales=fold, k_major=k_major, interpret=True)
    close(out, paged_decode_attention_ref(q, kq, vq, table, lens, k_scale=ks, v_scale=vs), qdtype)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("qdtype,splits,v_rows", [(jnp.bfloat16, 1, False), (jnp.float32, 2, False),
                                                  (jnp.bfloat16, 2, True)])
def test_ragged_on_compressed_pages(kv, qdtype, splits, v_rows):
    hq, hkv = 8, 2
    k, v = pages(hkv, key=1)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    # a 9-token chunk over 15 cached, a decode row, a 4-token chunk over nothing, then 2 padding tokens
    cu = jnp.array([0, 9, 10, 14], jnp.int32)
    kvl = jnp.array([24, 31, 4], jnp.int32)
    table = jnp.array([[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0]], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(4), (16, hq, D)).astype(qdtype)
    out = ragged_paged_attention(q, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, kv_splits=splits, v_rows=v_rows,
                                 interpret=True, split_longest=False)  # (every block split-KV: sl=0's form)
    ref = ragged_paged_attention_ref(q, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs)
    close(out[:14], ref[:14], qdtype)
    if splits > 1:  # split_longest: the two rows past 10 keys split, their partials merged; the scales go along
        out = ragged_paged_attention(q, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, kv_splits=splits,
                                     v_rows=v_rows, interpret=True, split_longest=True, long_keys=10)
        close(out[:14], ref[:14], qdtype)


@pytest.mark.parametrize("kv", KV)
def test_default_scale_form_follows_the_page_dtype(kv):
    """The kernels' default form is ``quant.scales_on_rows``: rows for float8_e4m3fn (decode K and V, ragged
    V), folded for int8 - bit-identical to the explicit knob; float16 queries through it stay close to the
    reference (the rows form dequantizes into q's dtype)."""
    rows = scales_on_rows(jnp.dtype(kv))
    assert rows == (jnp.dtype(kv) == jnp.dtype(jnp.float8_e4m3fn))
    k, v = pages(2, key=11)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    table = jnp.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 12]], jnp.int32)
    lens = jnp.array([33, 9, 40], jnp.int32)
    cu, kvl = jnp.array([0, 4, 5, 9], jnp.int32), jnp.array([33, 9, 40], jnp.int32)
    for qdtype in (jnp.bfloat16, jnp.float16):
        q = jax.random.normal(jax.random.PRNGKey(12), (3, 8, D)).astype(qdtype)
        out = paged_decode_attention(q, kq, vq, table, lens, k_scale=ks, v_scale=vs, interpret=True)
        explicit = paged_decode_attention(q, kq, vq, table, lens, k_scale=ks, v_scale=vs, fold_scales=not rows,
                                          interpret=True)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(explicit, np.float32))
        close(out, paged_decode_attention_ref(q, kq, vq, table, lens, k_scale=ks, v_scale=vs), jnp.bfloat16)
        qr = jax.random.normal(jax.random.PRNGKey(13), (9, 8, D)).astype(qdtype)
        out = ragged_paged_attention(qr, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, interpret=True)
        explicit = ragged_paged_attention(qr, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, v_rows=rows,
                                          interpret=True)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(explicit, np.float32))
        close(out, ragged_paged_attention_ref(qr, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs), jnp.bfloat16)


@pytest.mark.parametrize("kv", KV)
def test_cascade_on_compressed_pages(kv):
    hq, hkv = 8, 2
    k, v = pages(hkv, key=2)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    q = jax.random.normal(jax.random.PRNGKey(5), (4, hq, D)).astype(jnp.bfloat16)
    shared, slen = jnp.array([1, 2, 3], jnp.int32), jnp.int32(24)
    table = jnp.array([[4, 5], [6, 0], [7, 8], [9, 10]], jnp.int32)
    lens = jnp.array([9, 3, 16, 12], jnp.int32)
    rows = jnp.array([True, True, False, True])
    out = shared_prefix_decode_attention(q, kq, vq, shared, slen, table, lens, rows, k_scale=ks, v_scale=vs,
                                         interpret=True)
    ref = shared_prefix_decode_attention_ref(q, kq, vq, shared, slen, table, lens, rows, k_scale=ks, v_scale=vs)
    close(out, ref, jnp.bfloat16)


def test_scales_are_checked():
    k, v = pages(2)
    (kq, ks), (vq, vs) = quantize_kv(k, jnp.int8), quantize_kv(v, jnp.int8)
    q = jnp.zeros((1, 4, D), jnp.bfloat16)
    table, lens = jnp.array([[1]], jnp.int32), jnp.array([3], jnp.int32)
    with pytest.raises(ValueError, match="k_scale / v_scale"):  # int8 pages without scales
        paged_decode_attention(q, kq, vq, table, lens, interpret=True)
    with pytest.raises(ValueError, match="k_scale.shape"):
        paged_decode_attention(q, kq, vq, table, lens, k_scale=ks[:, :3], v_scale=vs, interpret=True)
    with pytest.raises(ValueError, match="k_scale / v_scale"):  # bf16 pages given scales
        paged_decode_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), table, lens, k_scale=ks,
                               v_scale=vs, interpret=True)


@pytest.mark.parametrize("kv", KV)
def test_quantizing_write_kernel_equals_the_xla_scatter(kv):
    """The Pallas write quantizes in the kernel, bit for bit as the XLA scatter does (slots across
    pages, a partial tail block, padding tokens on the null page)."""
    hkv = 2
    kp, vp = jnp.zeros((hkv, P, S, D), kv), jnp.zeros((hkv, P, S, D), kv)
    ks, vs = jnp.ones((hkv, P, S), jnp.float32), jnp.ones((hkv, P, S), jnp.float32)
    kn = jax.random.normal(jax.random.PRNGKey(6), (11, hkv, D)) * jnp.where(jnp.arange(D) < 2, 20.0, 1.0)
    vn = jax.random.normal(jax.random.PRNGKey(7), (11, hkv, D))
    slots = jnp.array([8, 9, 10, 17, 23, 24, 40, 41, 0, 0, 47], jnp.int32)
    want = write_kv_quantized(kp, vp, ks, vs, kn, vn, slots)
    got = write_kv_quantized_pallas(kp, vp, ks, vs, kn, vn, slots, block_tokens=4, interpret=True)
    for a, b in zip(want, got):
        a = np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)
        b = np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8) if b.dtype.itemsize == 1 else b)
        assert np.array_equal(a[:, 1:], b[:, 1:])  # page 0: the null page padding writes to


def test_int8_quantization_rounds_half_away_from_zero_without_a_round_primitive():
    """The write kernel quantizes inside Pallas, whose Triton lowering has no `round` (found on the
    H200): the rounding is add-then-truncate, equal to rounding half away from zero."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.quant import quantize_kv

    x = jnp.asarray([[127.0, -127.0, 63.5, -63.5, 0.49, -0.51, 10.2, 0.0]], jnp.float32)
    q, scale = quantize_kv(x, jnp.int8)
    y = np.asarray(x[0]) / float(scale[0])
    want = np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -127, 127).astype(np.int8)
    assert np.array_equal(np.asarray(q[0]), want)
    assert "round" not in str(jax.make_jaxpr(lambda v: quantize_kv(v, jnp.int8))(x))


def _stale_poisoned(kq, vq, ks, vs, table, lens):
    """The pages with every slot no row may read (past a length, unreferenced pages) holding NaN
    scales and, for float8 pages, NaN values: what a recycled page may hold."""
    seen = np.zeros(ks.shape[1] * S, bool)
    for row, n in zip(np.asarray(table), np.asarray(lens)):
        for t in range(int(n)):
            seen[int(row[t // S]) * S + t % S] = True
    stale = jnp.asarray(~seen).reshape(1, -1, S)
    nan = jnp.float32(jnp.nan)
    ks, vs = jnp.where(stale, nan, ks), jnp.where(stale, nan, vs)
    if kq.dtype == jnp.float8_e4m3fn:
        kq = jnp.where(stale[..., None], nan, kq.astype(jnp.float32)).astype(kq.dtype)
        vq = jnp.where(stale[..., None], nan, vq.astype(jnp.float32)).astype(vq.dtype)
    return kq, vq, ks, vs


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fold", [True, False])
def test_stale_slots_with_nan_scales_do_not_leak(kv, fold):
    """Folding the scales into the probabilities multiplies p = 0 by a stale slot's scale: those
    scales must be masked, not only the values (0 * NaN is NaN)."""
    k, v = pages(2, key=8)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    table = jnp.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 12]], jnp.int32)
    lens = jnp.array([33, 9, 37], jnp.int32)
    want = paged_decode_attention_ref(jax.random.normal(jax.random.PRNGKey(9), (3, 8, D)), kq, vq, table, lens,
                                      k_scale=ks, v_scale=vs)
    kq, vq, ks, vs = _stale_poisoned(kq, vq, ks, vs, table, lens)
    q = jax.random.normal(jax.random.PRNGKey(9), (3, 8, D))
    for splits in (1, 2):
        out = paged_decode_attention(q, kq, vq, table, lens, k_scale=ks, v_scale=vs, num_splits=splits,
                                     fold_scales=fold, interpret=True)
        close(out, want, jnp.float32)
    cu, kvl = jnp.array([0, 4, 5, 9], jnp.int32), jnp.array([33, 9, 37], jnp.int32)
    qr = jax.random.normal(jax.random.PRNGKey(10), (9, 8, D))
    out = ragged_paged_attention(qr, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, v_rows=not fold, interpret=True)
    kq0, ks0 = quantize_kv(k, kv)
    vq0, vs0 = quantize_kv(v, kv)
    close(out, ragged_paged_attention_ref(qr, kq0, vq0, table, cu, kvl, k_scale=ks0, v_scale=vs0), jnp.float32)


@pytest.mark.parametrize("kv", KV)
def test_quantized_splice_kernel_equals_its_reference(kv):
    """The splice on compressed pages (dequantize, rotate, quantize again, in one kernel) against the
    jnp form: keys with nonzero shifts get new codes and scales, zero shifts and every V row copy codes
    and scales bit for bit; padding entries (dst < 0) write nothing; N not a multiple of the block."""
    from pallas_kernels.splice import splice_kv_ref
    from pallas_kernels.splice_quantized import splice_kv_quantized, splice_kv_quantized_ref

    hkv = 2
    k, v = pages(hkv, key=11)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    src = jnp.array([8, 9, 10, 11, 12, 13, 14, 0, 15], jnp.int32)  # page 1 (+ a padding entry)
    dst = jnp.array([40, 41, 42, 43, 44, 45, 46, -1, 47], jnp.int32)  # page 5
    shift = jnp.array([7, 0, 300, -5, 1, 0, 4096, 3, 2], jnp.int32)
    inv = 1.0 / (10000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    got = splice_kv_quantized(kq, vq, ks, vs, src, dst, shift, inv, block_tokens=4, interpret=True)
    want = splice_kv_quantized_ref(kq, vq, ks, vs, src, dst, shift, inv)
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)  # noqa: E731
    assert np.array_equal(bits(got[1]), bits(want[1])) and np.array_equal(bits(got[3]), bits(want[3]))  # V
    # K: the rotation's fp32 rounding may differ by an ulp between the two (FMA contraction), and a
    # rotated row's largest value sets its scale: scales within float32 rounding, values within a code
    k_got, k_want = (np.asarray(x[0].astype(jnp.float32) * x[2][..., None]) for x in (got, want))
    assert np.allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6, atol=0)
    row_step = np.max(np.abs(k_want), axis=-1, keepdims=True) / (127.0 if kv == jnp.int8 else 8.0)
    assert np.all(np.abs(k_got - k_want) <= row_step * 1.001)
    k2, v2, ks2, vs2 = (np.asarray(x.astype(jnp.float32)) for x in got)
    kf, ksf = np.asarray(kq.astype(jnp.float32)), np.asarray(ks)
    flat = lambda x: x.reshape(hkv, P * S, *x.shape[3:])  # noqa: E731
    for i, (s_, d_, sh) in enumerate(zip(src.tolist(), dst.tolist(), shift.tolist())):
        if d_ < 0:
            continue
        assert np.array_equal(flat(v2)[:, d_], flat(np.asarray(vq.astype(jnp.float32)))[:, s_])
        if sh == 0:
            assert np.array_equal(flat(k2)[:, d_], flat(kf)[:, s_]) and np.array_equal(flat(ks2)[:, d_], flat(ksf)[:, s_])
    # untouched slots stay as they were (the padding entry's source 0 included)
    touched = np.zeros(P * S, bool)
    touched[[d for d in dst.tolist() if d >= 0]] = True
    assert np.array_equal(flat(k2)[:, ~touched], flat(kf)[:, ~touched])
    # the rotation is the real one: the requantized keys dequantize to the rotated keys within one step
    kr, _ = splice_kv_ref(kq.astype(jnp.float32) * ks[..., None], vq.astype(jnp.float32), src, dst, shift, inv)
    deq = flat(k2 * ks2[..., None])[:, [d for d in dst.tolist() if d >= 0]]
    ref = flat(np.asarray(kr))[:, [d for d in dst.tolist() if d >= 0]]
    step = np.max(np.abs(ref), axis=-1, keepdims=True) / (127.0 if kv == jnp.int8 else 8.0)
    assert np.all(np.abs(deq - ref) <= step)


def test_quantized_splice_refuses_uncompressed_pages():
    from pallas_kernels.splice_quantized import splice_kv_quantized

    k, v = pages(2)
    z = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="k_scale / v_scale|k_pages.dtype"):
        splice_kv_quantized(k, v, None, None, z, z + 8, z, jnp.ones((D // 2,), jnp.float32), interpret=True)


@pytest.mark.parametrize("kv", KV)
def test_float16_queries_keep_small_values_on_compressed_pages(kv):
    """float16 models: the PV weights p * v_scale of small V values would underflow float16; the kernels
    run that dot in bfloat16 (the codes are exact in it)."""
    k, v = pages(2, key=13)
    v = v * 1e-4
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    q = jax.random.normal(jax.random.PRNGKey(14), (3, 8, D)).astype(jnp.float16)
    table = jnp.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 12]], jnp.int32)
    lens = jnp.array([33, 9, 40], jnp.int32)

    def rel(out, ref):
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    out = paged_decode_attention(q, kq, vq, table, lens, k_scale=ks, v_scale=vs, interpret=True)
    assert rel(out, paged_decode_attention_ref(q, kq, vq, table, lens, k_scale=ks, v_scale=vs)) < 5e-3
    cu, kvl = jnp.array([0, 4, 5, 9], jnp.int32), jnp.array([33, 9, 37], jnp.int32)
    qr = jax.random.normal(jax.random.PRNGKey(15), (9, 8, D)).astype(jnp.float16)
    out = ragged_paged_attention(qr, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, interpret=True)
    assert rel(out, ragged_paged_attention_ref(qr, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs)) < 5e-3


@pytest.mark.parametrize("kv", KV + [None])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_with_token_contiguous_v_pages(kv, splits):
    """The layout experiment: V pages stored [Hkv, P, D, S] (one page per block) give the reference's
    output on the usual layout, over ragged lengths, a partial last page and NaN in unused slots."""
    s, hkv = 32, 2  # S != D, so a page of the wrong layout is told apart by its shape
    k1, k2 = jax.random.split(jax.random.PRNGKey(11))
    k = jax.random.normal(k1, (hkv, 12, s, D)) * jnp.where(jnp.arange(D) < 2, 20.0, 1.0)
    v = jax.random.normal(k2, (hkv, 12, s, D))
    table = jnp.array([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 10]], jnp.int32)
    lens = jnp.array([100, 33, 128], jnp.int32)
    v = v.at[:, 6, 1:].set(jnp.nan)  # row 1 ends one token into its second page: the rest is stale
    if kv is None:
        kq, vq, scales = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), {}
    else:
        (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
        scales = dict(k_scale=ks, v_scale=vs)
    q = jax.random.normal(jax.random.PRNGKey(12), (3, 8, D)).astype(jnp.bfloat16)
    ref = paged_decode_attention_ref(q, kq, jnp.nan_to_num(vq), table, lens, **scales)
    for prefetch in (True, False):  # the block's page carried from the iteration before, or its own
        out = paged_decode_attention(q, kq, jnp.swapaxes(vq, -1, -2), table, lens, num_splits=splits,
                                     v_transposed=True, interpret=True, prefetch=prefetch, **scales)
        close(out, ref, jnp.bfloat16)
    with pytest.raises(ValueError, match="pages_per_block"):
        paged_decode_attention(q, kq, jnp.swapaxes(vq, -1, -2), table, lens, pages_per_block=2,
                               v_transposed=True, interpret=True, **scales)
    with pytest.raises(ValueError, match="v_pages.shape"):
        paged_decode_attention(q, kq, vq, table, lens, v_transposed=True, interpret=True, **scales)
