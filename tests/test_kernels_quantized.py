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
from pallas_kernels.quant import quantize_kv
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
@pytest.mark.parametrize("qdtype,hq,hkv,splits", [(jnp.bfloat16, 8, 2, 1), (jnp.float32, 4, 4, 3),
                                                  (jnp.bfloat16, 7, 1, 2)])
def test_decode_on_compressed_pages(kv, qdtype, hq, hkv, splits):
    k, v = pages(hkv)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    q = jax.random.normal(jax.random.PRNGKey(3), (3, hq, D)).astype(qdtype)
    table = jnp.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 12]], jnp.int32)
    lens = jnp.array([33, 9, 40], jnp.int32)  # across page boundaries, a partial last page
    out = paged_decode_attention(q, kq, vq, table, lens, k_scale=ks, v_scale=vs, num_splits=splits, interpret=True)
    close(out, paged_decode_attention_ref(q, kq, vq, table, lens, k_scale=ks, v_scale=vs), qdtype)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("qdtype,splits", [(jnp.bfloat16, 1), (jnp.float32, 2)])
def test_ragged_on_compressed_pages(kv, qdtype, splits):
    hq, hkv = 8, 2
    k, v = pages(hkv, key=1)
    (kq, ks), (vq, vs) = quantize_kv(k, kv), quantize_kv(v, kv)
    # a 9-token chunk over 15 cached, a decode row, a 4-token chunk over nothing, then 2 padding tokens
    cu = jnp.array([0, 9, 10, 14], jnp.int32)
    kvl = jnp.array([24, 31, 4], jnp.int32)
    table = jnp.array([[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0]], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(4), (16, hq, D)).astype(qdtype)
    out = ragged_paged_attention(q, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs, kv_splits=splits, interpret=True)
    ref = ragged_paged_attention_ref(q, kq, vq, table, cu, kvl, k_scale=ks, v_scale=vs)
    close(out[:14], ref[:14], qdtype)


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
