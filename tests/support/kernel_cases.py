"""Shared pieces of the kernel tests: random queries over a NaN-poisoned page pool."""

import jax
import jax.numpy as jnp
import numpy as np

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def fill_table(table, valid, row, pages, n, s):
    """Put ``pages`` at the start of ``table[row]`` and mark their first ``n`` slots real."""
    table[row, :len(pages)] = pages
    for t in range(n):
        valid[table[row, t // s] * s + t % s] = True


def poisoned_pool(seed, valid, *, b, hq, hkv, d, s, dtype):
    """q [b, hq, d] and K/V pages [hkv, P, s, d] random where ``valid`` (per slot), NaN elsewhere."""
    num_pages = len(valid) // s
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dtype)
    ok = jnp.asarray(valid.reshape(num_pages, s))[None, :, :, None]
    k_pages = jnp.where(ok, jax.random.normal(kk, (hkv, num_pages, s, d), jnp.float32), jnp.nan).astype(dtype)
    v_pages = jnp.where(ok, jax.random.normal(kv, (hkv, num_pages, s, d), jnp.float32), jnp.nan).astype(dtype)
    return q, k_pages, v_pages


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), "unwritten or NaN output elements"
    assert np.isfinite(ref32).all()
    err = np.max(np.abs(out32 - ref32)) / max(1.0, np.max(np.abs(ref32)))
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
