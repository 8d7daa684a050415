"""vLLM's sampling extras on the device (min_p, logit_bias, min_tokens, bad words), truncation,
and prompt log-probs against the HF model (fp32, same tiny random weights)."""

import math

import numpy as np
import pytest
import torch

from tests.support.hf_tiny import build_hf_model
from inferscale_jax import Engine, EngineConfig, SamplingParams, scoring
from inferscale_jax.sampling import step_bias, tokenize_bad_words
from tests.support.tiny_engine import make_engine


@pytest.fixture(scope="module")
def engine():
    return make_engine(pages=128)


def _greedy(engine, prompt, n=6, **kw):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)
    return engine.generate(prompt_token_ids=prompt, sampling=sp).token_ids


def test_min_p_one_keeps_only_the_most_likely_token(engine):
    """min_p = 1 leaves only the argmax, so a hot sample equals greedy; min_p = 0 does not."""
    prompt = [5, 17, 33, 2, 9]
    greedy = _greedy(engine, prompt, 8)
    outs = [engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, temperature=2.0, min_p=1.0, seed=s, ignore_eos=True)).token_ids for s in range(3)]
    assert all(o == greedy for o in outs)
    hot = [engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, temperature=2.0, seed=s, ignore_eos=True)).token_ids for s in range(3)]
    assert any(o != greedy for o in hot)


def test_logit_bias_forces_and_bans(engine):
    prompt = [4, 8, 15, 16, 23, 42]
    greedy = _greedy(engine, prompt)
    forced = _greedy(engine, prompt, logit_bias={77: 100.0})
    assert forced == [77] * 6
    banned = _greedy(engine, prompt, logit_bias={t: -100.0 for t in set(greedy)})
    assert not set(banned) & set(greedy)
    # a batch mixing a biased row and a plain one: each equals its solo run
    outs = engine.generate_batch([
        dict(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                              logit_bias={77: 100.0})),
        dict(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    assert [o.token_ids for o in outs] == [forced, greedy]


def test_min_tokens_holds_back_stop_ids(engine):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = _greedy(engine, prompt, 8)
    stop = greedy[0]  # the first greedy token ends the request at once ...
    short = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, temperature=0.0, stop_token_ids=[stop], ignore_eos=True))
    assert short.token_ids == [stop] and short.finish_reason == "stop"
    # ... unless min_tokens bans it for the first 4 tokens
    out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=8, temperature=0.0, stop_token_ids=[stop], min_tokens=4, ignore_eos=True))
    assert len(out.token_ids) >= 4 and stop not in out.token_ids[:4]
    assert out.token_ids[0] != stop


def test_bias_of_a_row():
    """step_bias: logit_bias always, a one-token bad word always, a longer one after its head,
    stop ids before min_tokens."""
    sp = SamplingParams(max_tokens=8, logit_bias={3: 1.5}, bad_words=["x"], min_tokens=2)
    ids, vals = step_bias(sp, 0, [], {7}, [[11], [20, 21]])
    assert dict(zip(ids, vals)) == {3: 1.5, 11: -math.inf, 7: -math.inf}
    ids, vals = step_bias(sp, 2, [5, 20], {7}, [[11], [20, 21]])
    assert dict(zip(ids, vals)) == {3: 1.5, 11: -math.inf, 21: -math.inf}
    assert step_bias(SamplingParams(max_tokens=4), 0, [], {7}, []) is None
    assert tokenize_bad_words(["ab"], lambda t: [ord(c) for c in t]) == [[97, 98], [32, 97, 98]]


def test_sampling_extras_validated():
    for bad in (dict(min_p=1.5), dict(min_tokens=9), dict(logit_bias={-1: 1.0}), dict(logit_bias={1: 101.0}),
                dict(bad_words=[""]), dict(truncate_prompt_tokens=0), dict(prompt_logprobs=21),
                dict(skip_special_tokens="no")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(max_tokens=8, **bad)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"


def test_truncate_prompt_tokens_keeps_the_tail(engine):
    prompt = list(range(3, 40))
    a = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=10))
    b = engine.generate(prompt_token_ids=prompt[-10:], sampling=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.metrics.prompt_tokens == 10


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama_plp"))
    hf = build_hf_model("gqa_4to1", d)
    engine = Engine.from_pretrained(d, EngineConfig(dtype="float32", page_size=8, hbm_pages=128, prefill_chunk=16))
    return hf, engine


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()  # [T, V]


@pytest.mark.parametrize("chunk", [512, 16])
def test_prompt_logprobs_match_hf(hf_engine, chunk, monkeypatch):
    """Every prompt token's log-prob (and its top alternatives) equals HF's log-softmax at the
    position before it, with a segment in front and across scoring chunks."""
    monkeypatch.setattr(scoring, "CHUNK", chunk)
    hf, engine = hf_engine
    rng = np.random.default_rng(chunk)
    seg = [int(x) for x in rng.integers(3, 257, 21)]
    prompt = [int(x) for x in rng.integers(3, 257, 30)]
    engine.register_segment(f"plp-{chunk}", token_ids=seg)
    out = engine.generate(prompt_token_ids=prompt, segments=[f"plp-{chunk}"], sampling=SamplingParams(
        max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True))
    full = seg + prompt
    ref = _hf_logprobs(hf, full)
    assert out.prompt_token_ids == prompt and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs):
        pos = len(seg) + i  # this token's position; its log-prob is the previous position's
        assert entry is not None and prompt[i] in entry and len(entry) >= 3
        for tok, lp in entry.items():
            assert abs(lp - ref[pos - 1][tok]) < 1e-4 * max(1.0, abs(ref[pos - 1][tok]))
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        assert set(np.argsort(-ref[pos - 1])[:3]) <= set(entry)
        assert top[0][1] == pytest.approx(ref[pos - 1].max(), abs=1e-4)
    # no segment: the first token has nothing before it
    ids, lps, ranks, n_tokens = engine.prompt_logprobs(prompt_token_ids=prompt, num_logprobs=0)
    assert n_tokens == len(prompt) + len(engine.bos_prefix)
    ref = _hf_logprobs(hf, prompt)
    assert ids == prompt and lps[0] is None
    assert [lp[prompt[i]] for i, lp in enumerate(lps) if i] == pytest.approx(
        [ref[i - 1][prompt[i]] for i in range(1, len(prompt))], abs=1e-4)
    assert ranks[0] is None
    assert ranks[1:] == [1 + int((ref[i - 1] > ref[i - 1][prompt[i]] + 1e-9).sum()) for i in range(1, len(prompt))]
