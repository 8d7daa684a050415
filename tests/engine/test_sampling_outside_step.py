"""The model step samples greedily; rows that draw are sampled again from its logits in a small executable of
their own (``runner.ModelRunner.sample``, ``_sample_step``):

- seeded sampling (temperature alone, and with top-k / top-p) through the engine, batched with greedy rows, equals
  ``generate_dense`` with the same options (the same sampler over a dense cache's logits), token for token;
- the warm-up compiles each warm bucket's plain sampler; after it, greedy and temperature-only requests compile
  nothing, and top-k / top-p compile no model step (no variant of it keys on them): only their sampler.
"""

import jax

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
    params = jax.tree.map(lambda x: x, engine.runner.params)
    for req, out in zip(reqs, outs):
        want, _ = generate_dense(params, CFG, req["prompt_token_ids"], req["sampling"], dtype="float32")
        assert out.token_ids == want, (req, out.token_ids, want)
    drawn = [o.token_ids for o, r in zip(outs, reqs) if r["sampling"].temperature > 0]
    greedy = [o.token_ids for o, r in zip(outs, reqs) if r["sampling"].temperature == 0]
    assert any(d not in greedy for d in drawn)  # (the draws did draw: not every row took its argmax)


def test_sampling_options_compile_no_model_step_after_the_warmup():
    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    e.warmup(progress_bar=False)
    samplers = lambda: {hk for hk in e.runner.helpers if hk[0] == "sample"}  # noqa: E731
    warmed = samplers()
    assert {hk[1].rows for hk in warmed} == {k.rows for k in e.runner.buckets.warmup_keys("small")}
    assert {hk[2] for hk in warmed} == {()}  # the plain sampler of each warm bucket's shape
    prompt = list(range(1, 12))
    for opts in OPTIONS[:2]:  # greedy, then temperature alone: nothing compiled
        e.generate(prompt_token_ids=prompt, sampling=_sampling(opts, 4))
        assert samplers() == warmed
    e.generate(prompt_token_ids=prompt, sampling=_sampling(OPTIONS[2], 4))  # top-k / top-p: their sampler
    assert e.stats()["compiles_after_warmup"] == 0
    assert not [k for k in e.runner.executables if FILTERED in k[1]]
    assert {hk[2] for hk in samplers() - warmed} == {(FILTERED,)}
