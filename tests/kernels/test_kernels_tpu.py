"""The Mosaic TPU kernels (``pallas_kernels/tpu/``) in JAX's TPU interpret mode against their refs,
the backend dispatch (``kv_cache.resolve_impl``), and the engine driven by the TPU kernels.

No TPU runs here: interpret mode executes the kernels on the CPU, simulating their DMAs,
semaphores and scalar prefetch, and fills uninitialized buffers with NaN.  The attention cases
reuse the ragged tests' NaN-poisoned pools (``test_kernels_ragged.make_case``): a kernel that reads
an invalid slot unmasked, or leaves an output row unwritten, produces NaN and fails.  The case
matrix is pairwise (each GQA ratio 1/4/7/8 with both head dims and both dtypes, not all products)
and small, so the file stays fast.  A separate test lowers each kernel to Mosaic MLIR for a TPU
target (the Python half of Mosaic compilation; the TPU compiler itself needs a TPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inferscale_jax import Engine, EngineConfig, SamplingParams, kv_cache, scheduler
from inferscale_jax.kv_cache import AttnMeta, resolve_impl
from models import init_params
from pallas_kernels.cascade_attention import grouped_cascade_decode_attention_ref
from pallas_kernels.ragged_attention import ragged_paged_attention_ref
from pallas_kernels.tpu import common as tpu_common
from pallas_kernels.tpu.kv_write import _write_call, write_kv_ref, write_kv_tpu
from pallas_kernels.tpu.ragged_attention import _ragged_tpu, choose_blocks, ragged_paged_attention_tpu
from pallas_kernels.tpu.splice import _splice_call, splice_kv_ref, splice_kv_tpu
from tests.kernels.test_kernels_ragged import check_output, make_case
from tests.kernels.test_kernels_splice import bits, disjoint_slots, inv_freq, random_pages, rows, untouched
from tests.support import tiny_engine

SUB = {jnp.float32: 8, jnp.bfloat16: 16}  # page sizes: one sublane tile


# ---------------------------------------------------------------- ragged attention

# (Hq, Hkv, D, dtype, q_lens, cached, pad, block_q, pages_per_block); None: the kernel's choice
RAGGED = [
    (2, 2, 64, jnp.float32, [1, 13, 0, 1, 5], [20, 3, 4, 40, 17], 3, 4, 2),  # G 1; empty row; padding
    (8, 2, 128, jnp.float32, [8, 1, 16], [8, 15, 0], 0, 8, 1),  # G 4; every row ends on a page boundary
    (7, 1, 128, jnp.float32, [3, 1, 9], [0, 23, 8], 1, None, None),  # G 7; defaults
    (8, 1, 64, jnp.float32, [1, 1, 1, 1], [0, 7, 8, 30], 0, None, None),  # G 8; decode-shaped step
    (4, 4, 128, jnp.bfloat16, [17, 1, 2], [0, 31, 14], 2, 4, 2),  # G 1
    (8, 2, 64, jnp.bfloat16, [1, 1, 1], [15, 16, 47], 1, None, None),  # G 4; decode-shaped
    (7, 1, 64, jnp.bfloat16, [5, 0, 12], [16, 3, 33], 0, 3, 1),  # G 7
    (8, 1, 128, jnp.bfloat16, [33, 1], [0, 64], 2, None, None),  # G 8; defaults, long chunk
]


@pytest.mark.parametrize("Hq,Hkv,D,dtype,q_lens,cached,pad,block_q,ppb", RAGGED)
def test_ragged_tpu_matches_ref(Hq, Hkv, D, dtype, q_lens, cached, pad, block_q, ppb):
    args, _ = make_case(q_lens=q_lens, cached=cached, pad=pad, Hq=Hq, Hkv=Hkv, D=D, S=SUB[dtype], dtype=dtype)
    out = ragged_paged_attention_tpu(*args, block_q=block_q, pages_per_block=ppb)
    check_output(out, args, dtype)


def test_ragged_tpu_block_choice_respects_tiling():
    """Tile rows are whole sublane tiles; decode-shaped steps take one tile, chunks about 128 rows."""
    for dtype, group in ((jnp.float32, 1), (jnp.float32, 7), (jnp.bfloat16, 4), (jnp.bfloat16, 8)):
        sub = tpu_common.sublanes(dtype)
        bq, m, ppb = choose_blocks(8, 8, group, 16, 64, dtype)  # decode: one token per row
        assert m % sub == 0 and bq == max(1, sub // group) and m == tpu_common.round_up(bq * group, sub)
        bq, m, ppb = choose_blocks(512, 8, group, 16, 64, dtype)
        assert m % sub == 0 and bq == 128 // group and ppb * 16 == 256
    assert choose_blocks(512, 8, 4, 16, 3, jnp.float32)[2] == 3  # at most the table width


@pytest.mark.parametrize("S,D,dtype,why", [
    (12, 64, jnp.float32, "multiple of 8"), (8, 64, jnp.bfloat16, "multiple of 16"),
    (16, 96, jnp.bfloat16, "head_dim 96"), (16, 64, jnp.float16, "float16")])
def test_untileable_pages_are_refused_with_the_reason(S, D, dtype, why):
    args, _ = make_case(q_lens=[2], cached=[3], Hq=2, Hkv=1, D=D, S=S, dtype=dtype)
    with pytest.raises(ValueError, match=why):
        ragged_paged_attention_tpu(*args)
    assert why in tpu_common.tiling_problem(D, S, dtype)


# ---------------------------------------------------------------- KV write

@pytest.mark.parametrize("dtype,D,n,block", [(jnp.float32, 64, 19, 8), (jnp.bfloat16, 128, 5, 64)])
def test_write_kv_tpu_matches_ref(dtype, D, n, block):
    S = SUB[dtype]
    kp, vp = random_pages(1, (2, 6, S, D), dtype)
    kn, vn = random_pages(2, (n, 2, D), dtype)
    slots = jnp.asarray(np.random.default_rng(n).permutation(np.arange(S, 6 * S))[:n], jnp.int32)
    slots = slots.at[-1].set(3).at[0].set(6 * S + 5)  # a padding token (null page); an out-of-range slot
    got = write_kv_tpu(kp, vp, kn, vn, slots, block_tokens=block)
    want = write_kv_ref(kp, vp, kn, vn, slots)  # (drops the out-of-range slot; the kernel: null page)
    for g, w in zip(got, want):  # every page but the null page, bit for bit
        np.testing.assert_array_equal(bits(g)[:, 1:], bits(w)[:, 1:])


# ---------------------------------------------------------------- splice

def test_splice_tpu_rotates_k_copies_v_and_keeps_shift_zero_bits():
    dtype, D, S, n = jnp.float32, 64, 8, 17
    kp, vp = random_pages(20, (2, 6, S, D), dtype)
    src, dst = disjoint_slots(21, n, 6 * S, first=S)
    kp = kp.at[:, src[0] // S, src[0] % S, :4].set(-0.0).at[:, src[1] // S, src[1] % S, :2].set(jnp.nan)
    dst = dst.at[5].set(-1)  # padding entry
    shift = jax.random.randint(jax.random.PRNGKey(4), (n,), -300, 300).at[:3].set(0)
    k2, v2 = splice_kv_tpu(kp, vp, src, dst, shift, inv_freq(D), block_tokens=8)
    kr, vr = splice_kv_ref(kp, vp, src, dst, shift, inv_freq(D))
    live = np.asarray(dst) >= 0
    d_, s_ = dst[live], src[live]
    np.testing.assert_allclose(rows(k2, d_), rows(kr, d_), rtol=1e-5, atol=1e-5)  # rotated (fp32 order)
    np.testing.assert_array_equal(bits(rows(k2, dst[:3])), bits(rows(kp, src[:3])))  # shift 0: the bits
    np.testing.assert_array_equal(bits(rows(v2, d_)), bits(rows(vp, s_)))
    np.testing.assert_array_equal(untouched(k2, dst), untouched(kp, dst))
    np.testing.assert_array_equal(untouched(v2, dst), untouched(vp, dst))


def test_splice_tpu_stacked_layers_bf16_equals_ref():
    dtype, D, S, n = jnp.bfloat16, 128, 16, 21
    kp, vp = random_pages(30, (2, 1, 5, S, D), dtype)  # [L, Hkv, P, S, D]
    src, dst = disjoint_slots(31, n, 5 * S, first=S)
    shift = jax.random.randint(jax.random.PRNGKey(32), (n,), -300, 300).at[:2].set(0)
    got = splice_kv_tpu(kp, vp, src, dst, shift, inv_freq(D))
    want = splice_kv_ref(kp, vp, src, dst, shift, inv_freq(D))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(bits(got[1]), bits(want[1]))


# ---------------------------------------------------------------- Mosaic lowering (no TPU needed)

def _lowers_for_tpu(fn, *args):
    """Lower ``fn`` for a TPU target on this CPU machine (jaxpr -> Mosaic MLIR, JAX's part of the
    compilation); the device kind it asks for is a TPU's (private hook: skipped should it move)."""
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:
        pytest.skip("jax._src.pallas.mosaic.tpu_info moved")
    mp = pytest.MonkeyPatch()
    mp.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite", raising=False)
    mp.setattr(tpu_info, "get_num_device_cores", lambda: 1, raising=False)
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    finally:
        mp.undo()
    assert "tpu_custom_call" in text


def test_kernels_lower_to_mosaic():
    args, _ = make_case(q_lens=[1, 9, 0], cached=[20, 3, 4], pad=2, Hq=8, Hkv=2, D=128, S=16, dtype=jnp.bfloat16)
    bq, m, ppb = choose_blocks(12, 3, 4, 16, int(args[3].shape[1]), jnp.bfloat16)
    _lowers_for_tpu(functools.partial(_ragged_tpu, sm_scale=0.1, block_q=bq, rows=m, pages_per_block=ppb,
                                      interpret=False), *args)
    kp = jnp.zeros((2, 6, 16, 64), jnp.bfloat16)
    kn, slots = jnp.zeros((19, 2, 64), jnp.bfloat16), jnp.zeros((19,), jnp.int32)
    _lowers_for_tpu(functools.partial(_write_call, block_tokens=8, interpret=False), kp, kp, kn, kn, slots)
    _lowers_for_tpu(functools.partial(_splice_call, block=16, interpret=False), kp, kp, slots, slots, slots,
                    inv_freq(64))


# ---------------------------------------------------------------- dispatch

def test_dispatch_by_backend(monkeypatch, caplog):
    assert resolve_impl("auto", 64, 16, jnp.bfloat16) == "ref"  # this CPU
    assert resolve_impl("pallas_tpu", 64, 16, jnp.bfloat16) == "pallas_tpu"  # forced: interpret mode
    assert resolve_impl("ref", 64, 16, jnp.bfloat16) == "ref"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto", 128, 16, jnp.bfloat16) == "pallas_tpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", 128, 16, jnp.bfloat16) == "pallas"
    assert resolve_impl("auto", 96, 16, jnp.bfloat16) == "ref"  # not a power of two (Triton)
    with caplog.at_level(logging.WARNING, logger="inferscale.kv_cache"):
        assert resolve_impl("pallas_tpu", 16, 8, jnp.float32) == "ref"  # the tiny test model's head_dim
        assert resolve_impl("pallas_tpu", 64, 16, jnp.bfloat16, kv_dtype="int8") == "ref"
    assert "head_dim 16" in caplog.text and "compressed KV (int8)" in caplog.text


def test_cascade_rows_as_ragged_rows_give_the_cascade_result():
    """On pallas_tpu a cascade step runs the ragged kernel over each row's full page list (its
    group's shared pages, then its own): the same attention as the cascade reference (refs on both
    sides).  Two groups of different lengths, a padding group, a row in no group."""
    S, hkv, hq, d = 8, 2, 8, 64
    kp, vp = random_pages(40, (hkv, 16, S, d), jnp.float32)
    q = jax.random.normal(jax.random.PRNGKey(41), (4, hq, d), jnp.float32)
    group_pages = jnp.asarray([[4, 7, 0], [11, 0, 0], [0, 0, 0]], jnp.int32)  # [G, Ps]: 2 full pages + pad, 1, none
    group_lens = jnp.asarray([2 * S, S, 0], jnp.int32)
    table = jnp.asarray([[2, 3], [5, 0], [9, 10], [12, 13]], jnp.int32)
    kv_lens = jnp.asarray([11, 3, 13, 9], jnp.int32)  # suffixes (row 2, outside every group: its whole context)
    row_group = jnp.asarray([0, 0, -1, 1], jnp.int32)
    want = grouped_cascade_decode_attention_ref(q, kp, vp, group_pages, group_lens, row_group, table, kv_lens)
    meta = AttnMeta(slots=None, page_table=table, q_lens=None, kv_lens=kv_lens, group_pages=group_pages,
                    group_lens=group_lens, row_group=row_group)
    full, cu, lens = kv_cache._as_ragged(meta, S)
    assert full.shape == (4, 5) and list(np.asarray(lens)) == [27, 19, 13, 17]
    assert np.asarray(full)[3, :3].tolist() == [11, 12, 13]
    np.testing.assert_allclose(ragged_paged_attention_ref(q, kp, vp, full, cu, lens), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the engine on the TPU kernels

def test_engine_on_tpu_kernels_gives_the_ref_tokens(monkeypatch):
    """One engine per impl on a tiny model whose pages tile (head_dim 64, page 8, fp32, GQA 4): a
    segment injected (its partial last page copied on write through the splice kernel), a
    prefix-cache hit, and two rows of one segment decoding as a cascade group (threshold 0).  The
    TPU kernels (interpret mode) must give the reference path's greedy tokens."""
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", 0)
    cfg = dataclasses.replace(tiny_engine.CFG, head_dim=64, num_heads=4, num_kv_heads=1, num_layers=1)
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cascades = []
    as_ragged = kv_cache._as_ragged
    monkeypatch.setattr(kv_cache, "_as_ragged", lambda meta, s: (cascades.append(meta.group_pages is not None),
                                                                 as_ragged(meta, s))[1])
    tokens = {}
    for impl in ("ref", "pallas_tpu"):
        e = Engine(params, cfg, None, EngineConfig(dtype="float32", page_size=tiny_engine.S, hbm_pages=64,
                                                   prefill_chunk=16, max_batch=4, max_num_batched_tokens=16,
                                                   max_model_len=64, attention_impl=impl))  # few buckets
        e.debug_checks = True
        assert e.stats()["attention_impl"] == impl
        e.register_segment("kb", token_ids=list(range(1, 20)))  # 2 full pages + 3 tokens
        injected = e.generate(prompt_token_ids=[5, 6, 7], segments=["kb"], sampling=sp)
        assert injected.metrics.cached_tokens == 19
        prompt = list(range(30, 50))
        first = e.generate(prompt_token_ids=prompt, sampling=sp)
        hit = e.generate(prompt_token_ids=prompt + [3], sampling=sp)
        assert hit.metrics.cached_tokens == 16  # two full pages from the prefix cache
        group = e.generate_batch([dict(prompt_token_ids=[9 + i], segments=["kb"], sampling=sp) for i in range(2)])
        tokens[impl] = [injected.token_ids, first.token_ids, hit.token_ids] + [o.token_ids for o in group]
        tiny_engine.assert_only_nodes_hold_pages(e)
    assert tokens["pallas_tpu"] == tokens["ref"]
    assert any(cascades), "no cascade step ran on the TPU kernels"
