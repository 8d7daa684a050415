"""The qkv split + RoPE kernel (pallas_kernels/rope.py) against the model's jnp form (interpret mode), and its
Triton lowering for CUDA on this host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import RopeConfig
from models.rope import inv_freq
from pallas_kernels import common
from pallas_kernels.rope import qkv_rope_pallas, qkv_rope_ref


def case(n, hq, hkv, d, dtype, seed=0, rope=RopeConfig()):
    qkv = jax.random.normal(jax.random.PRNGKey(seed), (n, (hq + 2 * hkv) * d), jnp.float32).astype(dtype)
    pos = (jnp.arange(n, dtype=jnp.int32) * 37 + 1000 + seed) % 8192
    return qkv, pos, jnp.asarray(inv_freq(rope, d))


@pytest.mark.parametrize("n,hq,hkv,d", [(1, 2, 1, 8), (5, 4, 2, 16), (33, 8, 2, 32), (16, 4, 4, 64)])
@pytest.mark.parametrize("block_tokens", [1, 4, 16])
def test_bf16_equals_the_model(n, hq, hkv, d, block_tokens):
    """Every element equal in bf16 (each product rounded, as the model), ragged token counts past the block.

    Both sides run on the CPU backend, also on a GPU host: there interpret mode hands the kernel's body to
    XLA's GPU compiler, whose fusions may keep a product in float32 where the model's fusion rounded it (one
    bf16 step apart, run AZ in bench/NOTES.md).  The compiled kernel's equality on a GPU is the engine A/B
    below (exact tokens and log-probs) and ``bench/kernels/glue.py``'s check."""
    with jax.default_device(jax.devices("cpu")[0]):
        qkv, pos, f = case(n, hq, hkv, d, jnp.bfloat16, seed=n + block_tokens)
        got = qkv_rope_pallas(qkv, pos, f, hq, hkv, block_tokens=block_tokens, interpret=True)
        want = qkv_rope_ref(qkv, pos, f, hq, hkv)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.devices() == {jax.devices("cpu")[0]}
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_fp32_and_scaled_rope_are_close():
    """float32 activations (cos / sin within an ulp of XLA's) and llama3-scaled frequencies."""
    rope = RopeConfig(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    qkv, pos, f = case(9, 4, 2, 32, jnp.float32, rope=rope)
    for a, b in zip(qkv_rope_pallas(qkv, pos, f, 4, 2, block_tokens=4), qkv_rope_ref(qkv, pos, f, 4, 2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (dict(num_heads=3), r"qkv.shape: got \(4, 128\)"),
    (dict(positions=jnp.zeros((3,), jnp.int32)), r"positions"),
    (dict(freq=jnp.zeros((4,), jnp.float32)), r"freq.shape: got \(4,\), expected \(8,\)"),
])
def test_bad_inputs_are_refused_with_their_values(args, match):
    qkv, pos, f = case(4, 4, 2, 16, jnp.bfloat16)
    kw = dict(qkv=qkv, positions=pos, freq=f, num_heads=4, num_kv_heads=2) | args
    with pytest.raises(ValueError, match=match):
        qkv_rope_pallas(**kw)


def test_it_lowers_to_triton(monkeypatch):
    """The compiled path (as on a GPU) lowers for CUDA: the head branches and cos / sin are Triton-typed."""
    monkeypatch.setattr(common, "default_interpret", lambda: False)
    jax.clear_caches()
    qkv, pos, f = case(40, 32, 8, 128, jnp.bfloat16)
    text = jax.jit(lambda a, p, fr: qkv_rope_pallas(a, p, fr, 32, 8)).trace(qkv, pos, f).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and 'name = "qkv_rope_t8"' in text
    jax.clear_caches()


def test_the_engine_generates_the_same_with_and_without_the_kernel(monkeypatch):
    """The engine's steps (prefill, mixed, decode) run the kernel by default on the Pallas kernels, and give
    ``INFERSCALE_ROPE=jnp``'s (the model's own form) greedy tokens and log-probs exactly, in bf16 at positions
    past 200; the switch keys the caches.  (float32 engines run it in every other engine test on the kernels.)"""
    import pallas_kernels.rope as rope_mod
    from tests.support.tiny_engine import PROMPTS, assert_same_generations, switch_ab
    assert common.ROPE_CHOICES[0] == "pallas"  # (the default: what "" means)
    prompts = PROMPTS + [list(range(1, 90)) * 3]  # 267 tokens: angles far from 0
    (base, n0, key0), (got, n1, key1) = switch_ab(monkeypatch, "INFERSCALE_ROPE", ("", "jnp"), rope_mod,
                                                  "_rope_kernel", prompts, dtype="bfloat16", pages=96)
    assert n0 > 0 and n1 == 0, (n0, n1)
    assert key0 != key1
    assert_same_generations(base, got, atol=0.0)


def test_a_bad_rope_switch_is_refused_with_its_value(monkeypatch):
    monkeypatch.setenv("INFERSCALE_ROPE", "triton")
    with pytest.raises(ValueError, match="INFERSCALE_ROPE='triton'.*'pallas', 'jnp'"):
        common.rope()
