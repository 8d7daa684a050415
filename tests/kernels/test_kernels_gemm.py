"""The skinny-matmul kernel (pallas_kernels/gemm.py) against XLA's dot (interpret mode), its knobs' choice, and its
Triton lowering for CUDA on this host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.gemm import MAX_BLOCK_M, default_blocks, matmul_pallas, matmul_ref


def case(m, k, n, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(dtype)
    return x, w


def exact(x, w):
    """The product of the (rounded) inputs in float64: what any float32 accumulation approximates."""
    return np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("m,k,n,knobs", [
    (1, 64, 32, {}),  # one row (a padded 16-row block), the shape's own knobs
    (5, 128, 64, dict(block_n=32, block_k=32)),  # ragged rows, several K steps
    (33, 256, 96, dict(block_n=32, block_k=64, split_k=2)),  # split K: float32 partials, one sum
    (130, 64, 48, dict(block_n=16, block_k=16, split_k=4)),  # past MAX_BLOCK_M rows: two row blocks
])
def test_float32_equals_xla(m, k, n, knobs):
    x, w = case(m, k, n, jnp.float32, seed=m)
    got = matmul_pallas(x, w, interpret=True, **knobs)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(matmul_ref(x, w)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), exact(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2])
def test_bf16_is_the_product_rounded_once(split_k):
    """Each bf16 output within one rounding of the exact product (float32 sums, one rounding at the end); XLA's
    dot the same, so the two differ by at most one rounding step."""
    x, w = case(37, 256, 64, jnp.bfloat16, seed=split_k)
    got = np.asarray(matmul_pallas(x, w, block_n=32, block_k=64, split_k=split_k, interpret=True), np.float64)
    want = exact(x, w)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)  # bf16: 8 significant bits
    assert np.all(np.abs(got - want) <= ulp * 0.5 + 1e-6 * np.abs(want).max()), np.abs(got - want).max()
    xla = np.asarray(matmul_ref(x, w), np.float64)
    assert np.all(np.abs(got - xla) <= ulp * 1.0 + 1e-6 * np.abs(want).max())


def test_default_blocks_are_run_azs_winners_and_fit():
    """The 8B's qkv / o / down projections get run AZ's best knobs at 64-128 rows (bench/NOTES.md): 64-column
    blocks, K split in two under 96 column blocks; every choice tiles its shape and fits the shared memory."""
    assert default_blocks(64, 4096, 6144) == dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1)
    for k, n in ((4096, 4096), (14336, 4096)):
        assert default_blocks(128, k, n) == dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=2)
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (48, 96), (64, 32), (32, 48)):
        for m in (1, 64, 128):
            for itemsize in (2, 4):
                kb = default_blocks(m, k, n, itemsize)
                assert n % kb["block_n"] == 0 and k % (kb["block_k"] * kb["split_k"]) == 0, (k, n, kb)
                block_m = min(MAX_BLOCK_M, max(16, 1 << max(0, m - 1).bit_length()))
                stage_bytes = (block_m * kb["block_k"] + kb["block_k"] * kb["block_n"]) * itemsize
                assert stage_bytes * kb["num_stages"] <= 227 * 1024, (m, k, n, kb, stage_bytes)  # (Hopper's most)


@pytest.mark.parametrize("args,match", [
    (dict(w=jnp.zeros((32, 64), jnp.bfloat16)), r"w.shape: got \(32, 64\), expected \[K, N\] with K = 64"),
    (dict(w=jnp.zeros((64, 64), jnp.float32)), r"w.dtype: got float32, expected bfloat16"),
    (dict(block_n=48), r"block_n: got 48, expected a power of two >= 16"),
    (dict(w=jnp.zeros((64, 40), jnp.bfloat16), block_n=16), r"N: got 40, expected a multiple of block_n = 16"),
    (dict(block_k=32, split_k=4), r"K: got 64, expected a multiple of block_k x split_k = 128"),
    (dict(split_k=0), r"split_k: got 0"),
    (dict(x=jnp.zeros((64,), jnp.bfloat16)), r"x.ndim, w.ndim: got \(1, 2\)"),
])
def test_bad_inputs_are_refused_with_their_values(args, match):
    x, w = case(4, 64, 64, jnp.bfloat16)
    kw = dict(x=x, w=w, block_n=32, block_k=32) | args
    with pytest.raises(ValueError, match=match):
        matmul_pallas(**kw)


@pytest.mark.parametrize("split_k", [1, 2])
def test_it_lowers_to_triton(monkeypatch, split_k):
    """The compiled path (as on a GPU) lowers for CUDA at the 8B's o projection, 64 rows."""
    monkeypatch.setattr(common, "default_interpret", lambda: False)
    jax.clear_caches()
    try:
        x, w = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        text = jax.jit(lambda a, b: matmul_pallas(a, b, split_k=split_k)).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text()
    finally:
        jax.clear_caches()
    name = "matmul_n64_k128" + ("_s2" if split_k == 2 else "")
    assert "xla.gpu.triton" in text and f'name = "{name}"' in text


def test_the_engine_with_the_matmul_kernel_generates_as_the_default(monkeypatch):
    """``INFERSCALE_MATMUL=pallas`` (the default): the four projections of the engine's steps (prefill, mixed,
    decode) in the kernel give XLA's dot's greedy tokens (``xla``), and log-probs within bf16's rounding (a bf16 engine: the kernel
    serves 16-bit activations only; its sums run in another order than XLA's); the switch keys the caches.  (The
    tiny engine's steps are under ``MATMUL_MIN_ROWS`` tokens: the floor is lowered to 1 here.)"""
    import inferscale_jax.kv_cache as kv_cache_mod
    import pallas_kernels.gemm as gemm_mod
    import tests.support.tiny_engine as tiny
    from tests.support.tiny_engine import CFG, assert_same_generations, switch_ab
    assert common.MATMUL_CHOICES[0] == "pallas"  # (the default: what "" means)
    monkeypatch.setattr(kv_cache_mod, "MATMUL_MIN_ROWS", 1)
    init = tiny.init_params  # (bf16 weights, as a bf16 checkpoint's: the tiny model's random ones are float32)
    monkeypatch.setattr(tiny, "init_params", lambda *a, **k: jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                                          init(*a, **k)))
    shapes = set()
    real = kv_cache_mod.matmul_pallas
    monkeypatch.setattr(kv_cache_mod, "matmul_pallas", lambda x, w, **kw: (shapes.add(w.shape), real(x, w, **kw))[1])
    (base, n0, key0), (got, n1, key1) = switch_ab(monkeypatch, "INFERSCALE_MATMUL", ("xla", ""), gemm_mod,
                                                  "_matmul_kernel", dtype="bfloat16")
    assert n0 == 0 and n1 > 0, (n0, n1)
    h, d = CFG.hidden_size, CFG.head_dim
    assert shapes == {(h, (CFG.num_heads + 2 * CFG.num_kv_heads) * d), (CFG.num_heads * d, h),
                      (h, 2 * CFG.intermediate_size), (CFG.intermediate_size, h)}, shapes
    assert key0 != key1
    assert max(2 * CFG.intermediate_size, h) <= kv_cache_mod.MATMUL_MAX_N
    assert_same_generations(base, got, atol=0.05)


def test_a_bad_matmul_switch_is_refused_with_its_value(monkeypatch):
    monkeypatch.setenv("INFERSCALE_MATMUL", "cublas")
    with pytest.raises(ValueError, match="INFERSCALE_MATMUL='cublas'.*'pallas', 'xla'"):
        common.matmul()
