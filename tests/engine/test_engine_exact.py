"""Exact injection: generation with segments equals the HF model on the concatenated tokens (fp32)."""

import numpy as np
import pytest
import torch

from tests.support.hf_tiny import build_hf_model
from inferscale_jax import Engine, EngineConfig, SamplingParams

PAGE = 8
N_GEN = 6
N_LP = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama_gqa"))
    hf = build_hf_model("gqa_4to1", d)
    engine = Engine.from_pretrained(d, EngineConfig(dtype="float32", page_size=PAGE, hbm_pages=128,
                                                    prefill_chunk=16))
    engine.debug_checks = True
    return hf, engine


def hf_greedy(hf, ids, n):
    """HF greedy continuation and the full log-softmax at every generated position."""
    ids = list(ids)
    lps = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1).numpy()
            lps.append(lp)
            ids.append(int(lp.argmax()))
    return ids[-n:], lps


def check_against_hf(hf, engine, seg_tokens, prompt, segments, tenant="default"):
    sp = SamplingParams(max_tokens=N_GEN, temperature=0.0, logprobs=N_LP, ignore_eos=True)
    out = engine.generate(prompt_token_ids=prompt, segments=segments, tenant=tenant, sampling=sp)
    full = [t for s in seg_tokens for t in s] + list(prompt)
    ref_ids, ref_lps = hf_greedy(hf, full, N_GEN)
    assert out.token_ids == ref_ids
    worst = 0.0
    for pos_lp, ref in zip(out.logprobs, ref_lps):
        assert len(pos_lp) >= N_LP
        for tok, lp in pos_lp.items():
            worst = max(worst, abs(lp - ref[tok]) / max(1.0, abs(ref[tok])))
    assert worst < 1e-4, f"logprobs differ from HF by {worst:.2e}"
    engine.check_invariants()
    return out


def rand_tokens(rng, n):
    return [int(x) for x in rng.integers(3, 257, n)]


@pytest.mark.parametrize("seg_len", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5])
@pytest.mark.parametrize("prompt_len", [0, 5])
def test_single_segment_exact(setup, seg_len, prompt_len):
    hf, engine = setup
    rng = np.random.default_rng(seg_len * 100 + prompt_len)
    seg = rand_tokens(rng, seg_len)
    sid = f"s{seg_len}-{prompt_len}"
    engine.register_segment(sid, token_ids=seg)
    prompt = rand_tokens(rng, prompt_len)
    first = check_against_hf(hf, engine, [seg], prompt, [sid])
    assert first.metrics.cached_tokens >= seg_len - 1
    second = check_against_hf(hf, engine, [seg], prompt, [sid])  # served from cache
    assert second.token_ids == first.token_ids
    engine.delete_segment(sid)


@pytest.mark.parametrize("lens", [(PAGE - 1, PAGE + 3), (PAGE, PAGE), (5, 1, 2 * PAGE + 3), (PAGE + 1, 3, PAGE - 1)])
def test_chained_segments_exact(setup, lens):
    hf, engine = setup
    rng = np.random.default_rng(sum(lens) * 7 + len(lens))
    segs = [rand_tokens(rng, n) for n in lens]
    ids = [f"c{'-'.join(map(str, lens))}-{i}" for i in range(len(lens))]
    for sid, toks in zip(ids, segs):
        engine.register_segment(sid, token_ids=toks)
    prompt = rand_tokens(rng, 4)
    first = check_against_hf(hf, engine, segs, prompt, ids)  # computes the chain nodes
    assert first.metrics.cached_tokens >= lens[0]
    second = check_against_hf(hf, engine, segs, prompt, ids)  # chain served from the index
    assert second.metrics.cached_tokens >= sum(lens)
    # segment 2 alone (its own standalone KV) must not be confused with its chained KV
    check_against_hf(hf, engine, segs[1:2], prompt, ids[1:2])
    for sid in ids:
        engine.delete_segment(sid)


def test_exact_after_pool_churn(setup):
    hf, engine = setup
    rng = np.random.default_rng(99)
    seg = rand_tokens(rng, 2 * PAGE + 3)
    engine.register_segment("churn", token_ids=seg)
    prompt = rand_tokens(rng, 6)
    before = check_against_hf(hf, engine, [seg], prompt, ["churn"])
    for i in range(12):  # many unrelated prompts recycle every free page
        engine.generate(prompt_token_ids=rand_tokens(rng, 30 + i),
                        sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.check_invariants()
    after = check_against_hf(hf, engine, [seg], prompt, ["churn"])
    assert after.token_ids == before.token_ids
    engine.delete_segment("churn")


def test_prefix_cache_hit_is_exact(setup):
    hf, engine = setup
    rng = np.random.default_rng(5)
    prompt = rand_tokens(rng, 4 * PAGE + 2)
    first = check_against_hf(hf, engine, [], prompt, [])
    second = check_against_hf(hf, engine, [], prompt, [])
    assert first.metrics.cached_tokens == 0 or first.metrics.cached_tokens < second.metrics.cached_tokens
    assert second.metrics.cached_tokens == 4 * PAGE
