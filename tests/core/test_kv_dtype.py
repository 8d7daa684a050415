"""Compressed KV (int8 / float8_e4m3fn pages with a float32 scale per token and kv head;
pallas_kernels/quant.py): quantization error on data with outlier channels, the exactness contract
with a compressed KV dtype (injected generation equals a full prefill with the same KV dtype, token
for token and log-prob for log-prob), bit-exact tier round trips, snapshots that record the KV dtype,
and clear errors for what is not built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inferscale_jax import SamplingParams, SnapshotMismatch
from inferscale_jax.config import EngineConfig
from inferscale_jax.tiers import gather_pages
from pallas_kernels.quant import dequantize_kv, pack_block, quantize_kv, unpack_block
from tests.support.tiny_engine import make_engine

KV = ["int8", "float8_e4m3fn"]
SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
rng = np.random.default_rng(0)
SEG_A, SEG_B, Q = (rng.integers(3, 97, n).tolist() for n in (30, 19, 7))


def chosen(out):
    return out.token_ids, [out.logprobs[i][t] for i, t in enumerate(out.token_ids)]


@pytest.mark.parametrize("dtype,bound", [(jnp.int8, 0.5 / 127), (jnp.float8_e4m3fn, 1 / 16)])
def test_quantization_error_with_outlier_channels(dtype, bound):
    """Per (token, head) scales: each value's error is within half a step of its row's scale (int8)
    or the e4m3 relative rounding (float8), even where a few channels are 30x larger, as in real K."""
    key = jax.random.PRNGKey(1)
    x = jax.random.normal(key, (4, 33, 2, 128)) * jnp.where(jnp.arange(128) < 4, 30.0, 1.0)
    q, s = quantize_kv(x, dtype)
    assert q.dtype == jnp.dtype(dtype) and s.shape == x.shape[:-1]
    err = jnp.abs(dequantize_kv(q, s, jnp.float32) - x)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    if dtype == jnp.int8:
        assert float(jnp.max(err / amax)) <= bound * 1.001
    else:
        assert float(jnp.max(err / jnp.maximum(jnp.abs(x), amax / 448 * 2 ** -6))) <= bound
    packed = pack_block(q, s)
    assert packed.dtype == jnp.uint8 and packed.shape[-1] == 132
    q2, s2 = unpack_block(packed, dtype)
    assert bool((jax.lax.bitcast_convert_type(q2, jnp.uint8) == jax.lax.bitcast_convert_type(q, jnp.uint8)).all())
    assert bool((s2 == s).all())
    assert bool((quantize_kv(jnp.zeros((3, 16)), dtype)[1] == 1).all())  # an all-zero row: scale 1, no NaN


@pytest.mark.parametrize("kv", KV)
def test_injected_equals_full_prefill_with_the_same_kv_dtype(kv):
    e = make_engine(kv_dtype=kv)
    e.register_segment("a", token_ids=SEG_A)
    e.register_segment("b", token_ids=SEG_B)
    inj = e.generate(prompt_token_ids=Q, segments=["a", "b"], sampling=SP)  # the chain node [a, b] computed
    again = e.generate(prompt_token_ids=Q, segments=["a", "b"], sampling=SP)  # reused, prefix-cache hits
    full = make_engine(kv_dtype=kv).generate(prompt_token_ids=SEG_A + SEG_B + Q, sampling=SP)
    assert chosen(inj) == chosen(full) == chosen(again)
    assert again.metrics.cached_tokens >= len(SEG_A + SEG_B)
    comp = e.generate(prompt_token_ids=Q, segments=["a", "b"], sampling=SP, mode="compose")  # re-rotated, requantized
    assert len(comp.token_ids) == 8
    st = e.stats()
    assert st["kv_dtype"] == kv
    # 2 layers x K,V x 2 kv heads x (16 bytes + a 4-byte scale) per token, vs 4-byte floats: 512
    assert st["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert st["tokens_resident"]["hbm"] == st["pages_used"] * 8 and st["tokens_resident"]["host"] == 0


@pytest.mark.parametrize("kv", KV)
def test_host_tier_round_trip_is_bit_exact(kv):
    e = make_engine(kv_dtype=kv)
    e.register_segment("a", token_ids=SEG_A)
    first = e.generate(prompt_token_ids=Q, segments=["a"], sampling=SP)
    seg = e.store.resolve("a", "default")
    pages = e.store.node([seg]).pages
    before = np.asarray(gather_pages(e.runner.cache, jnp.asarray(pages)))
    e.tiers.demote(seg, "host")
    assert e.segment_tier("a") == "host"
    back = e.generate(prompt_token_ids=Q, segments=["a"], sampling=SP)
    assert e.segment_tier("a") == "hbm"
    pages = e.store.node([seg]).pages
    after = np.asarray(gather_pages(e.runner.cache, jnp.asarray(pages)))
    assert before.dtype == np.uint8 and np.array_equal(before, after)  # values and scales, byte for byte
    assert chosen(back) == chosen(first)


def test_snapshot_records_the_kv_dtype(tmp_path):
    e = make_engine(kv_dtype="int8", snapshot_dir=str(tmp_path))
    e.register_segment("a", token_ids=SEG_A)
    want = chosen(e.generate(prompt_token_ids=Q, segments=["a"], sampling=SP))
    e.save_snapshot()
    e.close()
    r = make_engine(kv_dtype="int8", snapshot_dir=str(tmp_path))
    out = r.generate(prompt_token_ids=Q, segments=["a"], sampling=SP)
    assert chosen(out) == want and out.metrics.cached_tokens == len(SEG_A)
    r.close()
    with pytest.raises(SnapshotMismatch, match="kv=int8"):
        make_engine(snapshot_dir=str(tmp_path), strict_restore=True)


def test_clear_errors():
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int4")


@pytest.mark.parametrize("kv", KV)
def test_pallas_kernels_read_compressed_pages_in_the_engine(kv):
    """The Pallas kernels (interpret mode here) dequantize inside: the same tokens as the jnp path, with
    segments injected, a chain, a decode batch, a cascade group (two requests share segment a) and a
    composed request (the quantized splice kernel re-rotates and requantizes segment a's keys at their new place)."""
    def run(impl):
        e = make_engine(kv_dtype=kv, attention_impl=impl, cascade_decode=True)
        e.register_segment("a", token_ids=SEG_A)
        e.register_segment("b", token_ids=SEG_B)
        outs = e.generate_batch([dict(prompt_token_ids=Q, segments=["a", "b"], sampling=SP),
                                 dict(prompt_token_ids=Q[:3], segments=["a"], sampling=SP),
                                 dict(prompt_token_ids=Q[2:], segments=["a"], sampling=SP),
                                 dict(prompt_token_ids=Q, segments=["b", "a"], sampling=SP, mode="compose")])
        return [o.token_ids for o in outs], [chosen(o)[1] for o in outs]
    (tok_p, lp_p), (tok_r, lp_r) = run("pallas"), run("ref")
    assert tok_p == tok_r
    assert np.max(np.abs(np.asarray(lp_p) - np.asarray(lp_r))) < 1e-3
