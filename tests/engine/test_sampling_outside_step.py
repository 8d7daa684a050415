"""The model step samples greedily; rows that draw are sampled again from its logits in a small executable of
their own (``runner.ModelRunner.sample``, ``_sample_step``):

- seeded sampling (temperature alone, and with top-k / top-p) through the engine, batched with greedy rows, equals
  ``generate_dense`` with the same options (the same sampler over a dense cache's logits), token for token;
- the warm-up compiles each warm bucket's plain sampler; after it, greedy and temperature-only requests compile
  nothing, and top-k / top-p compile no model step (no variant of it keys on them): only their sampler, counted
  in ``stats()["sampler_compiles"]``;
- a prompt chunk before the last draws nothing (its step runs no sampler).
"""

from inferscale_jax import SamplingParams
from inferscale_jax.dense_generate import generate_dense
from inferscale_jax.runner import FILTERED
from tests.support.tiny_engine import CFG, make_engine

PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 23, 29], [2, 4, 6], [9, 8, 7, 6, 5]]
OPTIONS = [dict(temperature=0.0), dict(temperature=0.8, seed=11), dict(temperature=1.3, top_k=7, top_p=0.9, seed=5)]


def _sampling(opts, n=8):
    return SamplingParams(max_tokens=n, ignore_eos=True, **opts)


def test_drawn_rows_equal_the_dense_reference_in_a_mixed_batch():
    engine = make_engine()
    reqs = [dict(prompt_token_ids=p, sampling=_sampling(o)) for p in PROMPTS for o in OPTIONS]
    outs = engine.generate_batch(reqs)
    for req, out in zip(reqs, outs):
        want, _ = generate_dense(engine.runner.params, CFG, req["prompt_token_ids"], req["sampling"], dtype="float32")
        assert out.token_ids == want, (req, out.token_ids, want)
    drawn = [o.token_ids for o, r in zip(outs, reqs) if r["sampling"].temperature > 0]
    greedy = [o.token_ids for o, r in zip(outs, reqs) if r["sampling"].temperature == 0]
    assert any(d not in greedy for d in drawn)  # (the draws did draw: not every row took its argmax)


def test_sampling_options_compile_no_model_step_after_the_warmup():
    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    e.warmup(progress_bar=False)
    samplers = lambda: {hk for hk in e.runner.helpers if hk[0] == "sample"}  # noqa: E731
    warmed = samplers()  # the plain sampler of each warm bucket's shape
    assert warmed == {e.runner._sample_key(k, ()) for k in e.runner.buckets.warmup_keys("small")}
    prompt = list(range(1, 12))
    for opts in OPTIONS[:2]:  # greedy, then temperature alone: nothing compiled
        e.generate(prompt_token_ids=prompt, sampling=_sampling(opts, 4))
        assert samplers() == warmed
    e.generate(prompt_token_ids=prompt, sampling=_sampling(OPTIONS[2], 4))  # top-k / top-p: their sampler
    assert e.stats()["compiles_after_warmup"] == 0
    assert not [k for k in e.runner.executables if FILTERED in k[1]]
    new = samplers() - warmed
    assert {hk[2] for hk in new} == {(FILTERED,)}
    assert e.stats()["sampler_compiles"] == len(new) >= 1


def test_prompt_chunks_before_the_last_draw_nothing():
    """A drawing request's prompt in three chunks (prefill_chunk 16): only the last chunk's step samples, so only
    it runs the sampler (the others' samples are dropped: they must not make their steps draw)."""
    e = make_engine()
    calls = []
    sample = e.runner.sample
    e.runner.sample = lambda step: (calls.append(step.drawn), sample(step))[1]
    out = e.generate(prompt_token_ids=list(range(1, 41)), sampling=_sampling(OPTIONS[1], 1))
    assert len(out.token_ids) == 1
    assert calls == [True], calls


def test_a_sampler_that_fails_to_lower_leaves_the_warmup_whole(caplog):
    """The warm-up's samplers are optional: one that fails is logged, the warm-up still ends warm, and the sampler
    compiles on first use instead."""
    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)

    def broken(key, sharding):
        raise RuntimeError("no sampler today")

    e.runner._lower_sampler = broken
    info = e.warmup(progress_bar=False)
    assert info["buckets"] == len(e.runner.buckets.warmup_keys("small")) and e.stats()["warm"]
    assert not [hk for hk in e.runner.helpers if hk[0] == "sample"]
    assert "no sampler today" in caplog.text
    out = e.generate(prompt_token_ids=list(range(1, 12)), sampling=_sampling(OPTIONS[1], 4))
    assert len(out.token_ids) == 4 and e.stats()["sampler_compiles"] >= 1
    assert e.stats()["compiles_after_warmup"] == 0
