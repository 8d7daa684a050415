"""The residual add + RMSNorm kernel (pallas_kernels/norm.py) against the model's jnp form, and through the
engine's steps (``INFERSCALE_NORM=pallas``) against the default; interpret mode on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm import add_rms_norm_pallas, add_rms_norm_ref


def case(seed, shape, dtype, w_dtype=None):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (jax.random.normal(k[0], shape, jnp.float32) * 3).astype(dtype)
    d = jax.random.normal(k[1], shape, jnp.float32).astype(dtype)
    w = (1 + 0.2 * jax.random.normal(k[2], shape[-1:], jnp.float32)).astype(w_dtype or dtype)
    return x, d, w


def assert_ulp_close(got, want):
    """Equal, or one bf16 rounding step (a few fp32 ones) apart: the kernel sums the squares in another order.
    In bf16 nearly all must be equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    ulp = np.abs(w) * (2.0 ** -7 if want.dtype == jnp.bfloat16 else 2.0 ** -20) + 1e-30
    assert np.all(np.abs(g - w) <= ulp), float(np.max(np.abs(g - w) / ulp))
    if want.dtype == jnp.bfloat16:
        assert np.mean(g == w) > 0.95


@pytest.mark.parametrize("shape", [(1, 64), (5, 128), (3, 7, 64), (33, 256)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("block_rows", [1, 2, 4])
def test_add_and_norm_match_the_model(shape, dtype, block_rows):
    """Ragged row counts (a last block past N), leading batch axes, both dtypes, several block sizes."""
    x, d, w = case(sum(shape) + block_rows, shape, dtype)
    s, h = add_rms_norm_pallas(x, d, w, 1e-5, block_rows=block_rows, num_warps=4)
    s_ref, h_ref = add_rms_norm_ref(x, d, w, 1e-5)
    np.testing.assert_array_equal(np.asarray(s.astype(jnp.float32)), np.asarray(s_ref.astype(jnp.float32)))
    assert_ulp_close(h, h_ref)


def test_norm_alone_and_a_wider_weight():
    """``delta`` None: the norm alone, x returned as is; an fp32 weight on bf16 rows gives fp32 rows (as jnp)."""
    x, _, w = case(3, (9, 128), jnp.bfloat16, jnp.float32)
    s, h = add_rms_norm_pallas(x, None, w, 1e-6, block_rows=4)
    s_ref, h_ref = add_rms_norm_ref(x, None, w, 1e-6)
    np.testing.assert_array_equal(np.asarray(s.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)))
    assert h.dtype == jnp.float32
    assert_ulp_close(h, h_ref)


def test_rows_of_zeros_and_large_values_stay_finite():
    x = jnp.zeros((4, 64), jnp.bfloat16).at[1].set(3e4).at[2, 5].set(-1e3)
    s, h = add_rms_norm_pallas(x, jnp.zeros_like(x), jnp.ones((64,), jnp.bfloat16), 1e-5)
    _, h_ref = add_rms_norm_ref(x, jnp.zeros_like(x), jnp.ones((64,), jnp.bfloat16), 1e-5)
    assert np.all(np.isfinite(np.asarray(h.astype(jnp.float32))))
    assert_ulp_close(h, h_ref)


@pytest.mark.parametrize("bad,match", [
    (dict(w=jnp.ones((32,), jnp.bfloat16)), r"weight.shape: got \(32,\), expected \(64,\)"),
    (dict(d=jnp.ones((4, 32), jnp.bfloat16)), r"delta.shape: got \(4, 32\)"),
    (dict(d=jnp.ones((4, 64), jnp.float32)), r"delta"),
    (dict(x=jnp.ones((4, 48), jnp.bfloat16), d=None, w=jnp.ones((48,), jnp.bfloat16)), r"H: got 48.*power of two"),
])
def test_bad_inputs_are_refused_with_their_values(bad, match):
    x, d, w = case(0, (4, 64), jnp.bfloat16)
    args = dict(x=x, d=d, w=w) | bad
    with pytest.raises(ValueError, match=match):
        add_rms_norm_pallas(args["x"], args["d"], args["w"], 1e-5)


def test_the_engine_with_the_norm_kernel_generates_as_the_default(monkeypatch):
    """``INFERSCALE_NORM=pallas``: every residual add and norm of the engine's steps (prefill, mixed, decode) in
    the kernel gives the default engine's greedy tokens and close log-probs; the switch keys the caches."""
    import pallas_kernels.norm as norm_mod
    from tests.support.tiny_engine import assert_same_generations, switch_ab
    (base, n0, key0), (got, n1, key1) = switch_ab(monkeypatch, "INFERSCALE_NORM", ("jnp", "pallas"), norm_mod,
                                                  "_add_norm_kernel")
    assert n0 == 0 and n1 > 0, (n0, n1)
    assert key0 != key1
    assert_same_generations(base, got)


def test_a_bad_norm_switch_is_refused_with_its_value(monkeypatch):
    from pallas_kernels import common
    monkeypatch.setenv("INFERSCALE_NORM", "triton")
    with pytest.raises(ValueError, match="INFERSCALE_NORM='triton'.*'jnp', 'pallas'"):
        common.norm()
