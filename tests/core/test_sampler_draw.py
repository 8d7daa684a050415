"""The sampler's CDF draw (``sampling.sample_tokens(draw="cdf")``, ``INFERSCALE_SAMPLER=cdf``) against the
distribution it must draw from: frequencies over many keys, filtered tokens never drawn, edge blocks and single-
token rows; greedy rows and log-probs unchanged; the engine under the switch is seeded and keyed by it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inferscale_jax import SamplingParams
from inferscale_jax.sampling import _draw_by_cdf, request_key, sample_tokens
from tests.support.tiny_engine import make_engine


def keys(n: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.stack([request_key(seed * 100003 + i) for i in range(n)]))


@pytest.mark.parametrize("vocab", [600, 256, 97])
def test_the_cdf_draw_follows_the_distribution(vocab):
    """20000 rows of one distribution over ``vocab`` entries (a third filtered to -inf, across several 256-token
    blocks and a padded last block): every frequency within 5 standard errors of its probability, no filtered
    entry drawn."""
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, 2.0, vocab).astype(np.float32)
    logits[rng.random(vocab) < 1 / 3] = -np.inf
    logits[vocab - 1] = 3.0  # the last entry (the padded block's) drawable
    p = np.exp(logits - logits[np.isfinite(logits)].max())
    p /= p.sum()
    n = 20000
    got = np.asarray(_draw_by_cdf(keys(n, vocab), jnp.asarray(np.tile(logits, (n, 1)))))
    assert np.isfinite(logits[got]).all(), "a filtered token was drawn"
    freq = np.bincount(got, minlength=vocab) / n
    se = np.sqrt(p * (1 - p) / n) + 1e-4
    assert (np.abs(freq - p) <= 5 * se).all(), np.abs(freq - p).max()


def test_edge_rows_of_the_cdf_draw():
    """One drawable token (first, last, in the middle of a block) is always drawn; rows draw independently."""
    v = 700
    rows = np.full((6, v), -np.inf, np.float32)
    for r, t in enumerate([0, v - 1, 300, 255, 256, 511]):
        rows[r, t] = 0.0
    got = np.asarray(_draw_by_cdf(keys(6, 1), jnp.asarray(rows)))
    assert got.tolist() == [0, v - 1, 300, 255, 256, 511]
    # a tiny mass beside a huge one: both drawable, the tiny one rarely
    two = np.full((4000, v), -np.inf, np.float32)
    two[:, 10], two[:, 650] = 0.0, -6.0
    got = np.asarray(_draw_by_cdf(keys(4000, 2), jnp.asarray(two)))
    assert set(got.tolist()) <= {10, 650} and 0 < (got == 650).sum() < 40


def test_a_uniform_at_the_top_of_its_range_draws_a_drawable_token():
    """u = the largest float32 under 1 (its product with the total may round to the total): the draw is the last
    drawable token, never a filtered one nor a padding slot past the vocabulary; u = 0 the first drawable one."""
    v = 600  # three blocks of 256, the last one padded
    rows = np.full((3, v), -np.inf, np.float32)
    rows[0, [3, 200, 300]] = [0.0, 1.0, 2.0]  # the last block (512-599) wholly filtered
    rows[1, :] = np.random.default_rng(5).normal(0, 1, v)
    rows[1, 580:] = -np.inf
    rows[2, [0, 599]] = [5.0, -30.0]  # a mass that vanishes beside the other in float32
    top = np.nextafter(np.float32(1), np.float32(0))
    got = np.asarray(_draw_by_cdf(None, jnp.asarray(rows), uniform=jnp.full((3,), top, jnp.float32)))
    assert np.isfinite(rows[np.arange(3), got]).all() and (got < v).all(), got
    assert got[0] == 300 and got[1] == 579, got
    low = np.asarray(_draw_by_cdf(None, jnp.asarray(rows), uniform=jnp.zeros((3,), jnp.float32)))
    assert low.tolist() == [3, 0, 0]


def test_sample_tokens_with_the_cdf_draw_keeps_greedy_rows_and_log_probs():
    rng = np.random.default_rng(3)
    b, v = 8, 300
    logits = jnp.asarray(rng.normal(0, 3, (b, v)).astype(np.float32))
    temp = jnp.asarray([0.0, 0.7, 1.0, 0.0, 1.3, 0.5, 0.0, 1.0], jnp.float32)
    top_k = jnp.asarray([0, 0, 5, 0, 0, 0, 0, 1], jnp.int32)
    top_p = jnp.asarray([1.0, 0.9, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0], jnp.float32)
    args = (logits, temp, top_k, top_p, keys(b, 4), jnp.arange(b, dtype=jnp.int32), 3)
    g_tok, g_lp, g_ids, g_top = sample_tokens(*args, draw="gumbel")
    c_tok, c_lp, c_ids, c_top = sample_tokens(*args, draw="cdf")
    greedy = np.asarray(temp) == 0
    np.testing.assert_array_equal(np.asarray(c_tok)[greedy], np.asarray(jnp.argmax(logits, -1))[greedy])
    np.testing.assert_array_equal(np.asarray(c_tok)[greedy], np.asarray(g_tok)[greedy])
    np.testing.assert_array_equal(np.asarray(c_ids), np.asarray(g_ids))
    np.testing.assert_allclose(np.asarray(c_top), np.asarray(g_top))
    lsm = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(c_lp), lsm[np.arange(b), np.asarray(c_tok)], rtol=1e-6)
    # top-k 1 draws the argmax; top-k 5 one of the five largest; top-p 0.5 only from its nucleus
    assert int(c_tok[7]) == int(jnp.argmax(logits[7]))
    assert int(c_tok[2]) in np.argsort(-np.asarray(logits[2]))[:5].tolist()
    with pytest.raises(ValueError, match="draw='exact'"):
        sample_tokens(*args, draw="exact")


def test_the_engine_under_the_cdf_draw_is_seeded_and_keyed_by_the_switch(monkeypatch):
    from pallas_kernels import common
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    monkeypatch.delenv("INFERSCALE_SAMPLER", raising=False)
    base = common.switches()
    jax.clear_caches()
    gumbel = make_engine().generate(prompt_token_ids=[5, 6, 7, 8], sampling=sp).token_ids
    monkeypatch.setenv("INFERSCALE_SAMPLER", "cdf")
    assert common.switches() != base
    jax.clear_caches()
    engine = make_engine()
    a = engine.generate(prompt_token_ids=[5, 6, 7, 8], sampling=sp).token_ids
    b = engine.generate(prompt_token_ids=[5, 6, 7, 8], sampling=sp).token_ids
    assert a == b and len(a) == 12
    assert a != gumbel  # the switch reached the engine's steps: the same seed draws other tokens
    monkeypatch.setenv("INFERSCALE_SAMPLER", "tree")
    with pytest.raises(ValueError, match="INFERSCALE_SAMPLER='tree'.*'gumbel', 'cdf'"):
        common.sampler_draw()
    jax.clear_caches()
