"""Paged decode attention: Pallas kernel (interpret mode on CPU) against its jnp reference.

Every case draws fresh random inputs, scatters the sequences' pages in random order over the
pool (never page 0), and poisons every slot that is not part of a sequence (the null page,
unused pages and the tail of each last page) with NaN, so a read past a length or an unwritten
output shows up as NaN.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.kernel_cases import assert_close, fill_table, poisoned_pool
from pallas_kernels.decode_attention import (
    auto_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

def make_case(seed, lengths, *, hq, hkv, d, s, dtype, extra_pages=3, max_pages=None):
    """Random q and a poisoned page pool holding `lengths` tokens per sequence."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    need = [max(1, math.ceil(n / s)) for n in lengths]
    max_pages = max_pages or max(need)
    num_pages = 1 + sum(need) + extra_pages
    ids = rng.permutation(np.arange(1, num_pages))  # never the null page
    table = np.zeros((b, max_pages), np.int32)
    valid = np.zeros((num_pages * s,), bool)  # slots holding real tokens
    used = 0
    for i, (n, k) in enumerate(zip(lengths, need)):
        fill_table(table, valid, i, ids[used:used + k], n, s)
        used += k
    q, k_pages, v_pages = poisoned_pool(seed, valid, b=b, hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    return q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


CASES = [
    # seed, lengths, hq, hkv, d, s, dtype, kwargs
    (1, [1, 8, 9, 23], 4, 4, 64, 8, jnp.float32, {}),  # GQA 1, page boundary and one past
    (2, [16, 17, 1, 40], 8, 2, 128, 16, jnp.float32, dict(num_splits=1)),  # GQA 4, direct out
    (3, [33, 64, 2], 16, 2, 128, 16, jnp.bfloat16, dict(num_splits=3)),  # GQA 8
    (4, [96, 31, 65], 8, 2, 64, 32, jnp.bfloat16, dict(num_splits=2)),  # page 32
    (5, [128, 64, 1], 8, 1, 64, 64, jnp.float32, dict(num_splits=2)),  # page 64, GQA 8
    (6, [7, 24, 15, 1, 40], 2, 2, 64, 8, jnp.bfloat16, dict(pages_per_block=2, num_splits=4)),
    (7, [48, 5], 8, 2, 128, 8, jnp.float32, dict(pages_per_block=4, num_splits=5)),
    (12, [10, 33], 6, 2, 64, 16, jnp.float32, {}),  # GQA 3: not a power of two
    # each block's slots computed in its own iteration (no carried prefetch)
    (13, [7, 24, 15, 1, 40], 8, 2, 64, 8, jnp.float32, dict(prefetch=False, pages_per_block=2, num_splits=3)),
    (14, [16, 17, 1, 40], 8, 2, 128, 16, jnp.bfloat16, dict(prefetch=False, num_splits=1)),
]


@pytest.mark.parametrize("seed,lengths,hq,hkv,d,s,dtype,kw", CASES)
def test_matches_ref(seed, lengths, hq, hkv, d, s, dtype, kw):
    q, kp, vp, table, lens = make_case(seed, lengths, hq=hq, hkv=hkv, d=d, s=s, dtype=dtype)
    out = paged_decode_attention(q, kp, vp, table, lens, **kw)
    assert_close(out, paged_decode_attention_ref(q, kp, vp, table, lens), dtype)


def test_padded_table_and_custom_scale():
    """Page-table columns past every length (padding 0) and an explicit sm_scale."""
    q, kp, vp, table, lens = make_case(8, [20, 3], hq=4, hkv=1, d=64, s=8, dtype=jnp.float32,
                                       max_pages=7)
    out = paged_decode_attention(q, kp, vp, table, lens, sm_scale=0.3, num_splits=3)
    assert_close(out, paged_decode_attention_ref(q, kp, vp, table, lens, sm_scale=0.3),
                 jnp.float32)


def test_zero_length_gives_zeros_not_nan():
    q, kp, vp, table, lens = make_case(9, [0, 12], hq=4, hkv=2, d=64, s=8, dtype=jnp.float32)
    for ns in (1, 2):
        out = np.asarray(paged_decode_attention(q, kp, vp, table, lens, num_splits=ns))
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out[0], 0.0)
        ref = paged_decode_attention_ref(q, kp, vp, table, lens)
        assert_close(out[1:], np.asarray(ref)[1:], jnp.float32)


def test_auto_splits_fill_the_gpu():
    # rules fitted to the H200 sweep (bench/NOTES.md)
    assert auto_num_splits(1, 8, max_blocks=1024) == 66  # 4 programs/SM on 132 SMs
    assert auto_num_splits(8, 8, max_blocks=32) == 9
    assert auto_num_splits(32, 8, max_blocks=32) == 1  # B * Hkv >= SMs: the grid is full already
    assert auto_num_splits(128, 8, max_blocks=512) == 1
    assert auto_num_splits(1, 8, max_blocks=4) == 4  # at most one block per split


@pytest.mark.parametrize("bad,match", [
    (lambda a: {**a, "q": a["q"].astype(jnp.bfloat16)}, "q.dtype"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "num_q_heads"),
    (lambda a: {**a, "lengths": a["lengths"][:1]}, "lengths.shape"),
    (lambda a: {**a, "page_table": a["page_table"][0]}, "page_table.shape"),
])
def test_validation_errors_name_the_value(bad, match):
    q, kp, vp, table, lens = make_case(10, [5, 9], hq=4, hkv=2, d=64, s=8, dtype=jnp.float32)
    args = dict(q=q, k_pages=kp, v_pages=vp, page_table=table, lengths=lens)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**bad(args))
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_ref(**bad(args))


def test_rejects_non_power_of_two_page():
    q, kp, vp, table, lens = make_case(11, [5], hq=2, hkv=2, d=64, s=8, dtype=jnp.float32)
    kp3, vp3 = kp[:, :, :6], vp[:, :, :6]
    with pytest.raises(ValueError, match="page_size"):
        paged_decode_attention(q, kp3, vp3, table, lens)


@pytest.mark.parametrize("num_splits,prefetch", [(1, True), (4, True), (4, False)])
def test_lowers_to_triton(num_splits, prefetch):
    """The compiled (non-interpret) path lowers to a Triton call for CUDA, even on a CPU host."""
    sd = jax.ShapeDtypeStruct
    args = (sd((4, 32, 128), jnp.bfloat16), sd((8, 300, 16, 128), jnp.bfloat16),
            sd((8, 300, 16, 128), jnp.bfloat16), sd((4, 64), jnp.int32), sd((4,), jnp.int32))
    fn = jax.jit(functools.partial(paged_decode_attention, interpret=False,
                                   num_splits=num_splits, prefetch=prefetch))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    # without the carried slots the loads are indirect: Triton pipelines those only with >= 3 stages
    assert set(re.findall(r"num_stages = (\d+)", text)) == {"2" if prefetch else "3"}


def test_decode_switch_sets_the_kernels_knobs(monkeypatch):
    """``INFERSCALE_DECODE=bk=64,w=2,st=1`` sets the block, warps and stages the caller left unset (the lowering
    says so) and the result still equals the reference; a knob the caller passes wins."""
    sd = jax.ShapeDtypeStruct
    args = (sd((4, 32, 128), jnp.bfloat16), sd((8, 300, 16, 128), jnp.bfloat16),
            sd((8, 300, 16, 128), jnp.bfloat16), sd((4, 64), jnp.int32), sd((4,), jnp.int32))

    def lowered(**kw):
        jax.clear_caches()  # (the switch is read at trace time; the engine keys its caches by it)
        fn = jax.jit(functools.partial(paged_decode_attention, interpret=False, num_splits=1, **kw))
        return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    from pallas_kernels import common
    monkeypatch.delenv("INFERSCALE_DECODE", raising=False)
    base = common.switches()
    default = lowered()
    assert "paged_decode_bk128_sp1" in default and set(re.findall(r"num_stages = (\d+)", default)) == {"2"}
    assert set(re.findall(r"num_warps = (\d+)", default)) == {"4"}
    monkeypatch.setenv("INFERSCALE_DECODE", "bk=64,w=2,st=1")
    assert common.switches() != base  # (the engine's executable store keys its entries by it)
    text = lowered()
    assert "paged_decode_bk64_sp1" in text
    assert set(re.findall(r"num_stages = (\d+)", text)) == {"1"}
    assert set(re.findall(r"num_warps = (\d+)", text)) == {"2"}
    text = lowered(num_stages=3, pages_per_block=8)  # the caller's own knobs win
    assert "paged_decode_bk128_sp1" in text and set(re.findall(r"num_stages = (\d+)", text)) == {"3"}
    # the same values in interpret mode, at a page boundary and one past
    q, kp, vp, table, lens = make_case(15, [16, 17, 1, 40], hq=8, hkv=2, d=64, s=16, dtype=jnp.float32)
    monkeypatch.setenv("INFERSCALE_DECODE", "bk=32,st=1")
    out = paged_decode_attention(q, kp, vp, table, lens, num_splits=1)
    assert_close(out, paged_decode_attention_ref(q, kp, vp, table, lens), jnp.float32)


@pytest.mark.parametrize("spec,match", [("bk=8", "bk"), ("st=0", "st"), ("x=1", "'x=1'"), ("bk=48", "bk")])
def test_decode_switch_refuses_bad_knobs(monkeypatch, spec, match):
    """A bad ``INFERSCALE_DECODE`` item (a block under the dot's minimum, not a power of two, a zero, an unknown
    name) is an error naming the variable and the item."""
    q, kp, vp, table, lens = make_case(16, [5, 9], hq=4, hkv=2, d=64, s=8, dtype=jnp.float32)
    monkeypatch.setenv("INFERSCALE_DECODE", spec)
    with pytest.raises(ValueError, match=f"INFERSCALE_DECODE.*{match}"):
        paged_decode_attention(q, kp, vp, table, lens)


def test_decode_switch_refuses_a_block_under_the_page(monkeypatch):
    q, kp, vp, table, lens = make_case(17, [40, 9], hq=4, hkv=2, d=64, s=32, dtype=jnp.float32)
    monkeypatch.setenv("INFERSCALE_DECODE", "bk=16")
    with pytest.raises(ValueError, match="INFERSCALE_DECODE's bk.*page size 32"):
        paged_decode_attention(q, kp, vp, table, lens)
