"""One device step per iteration: prefill chunks and decode rows in one ragged step.

- a mixed step (a chunk beside decode rows) gives the same sampled tokens and logprobs as
  running its rows apart (fp32, 1e-5), and as HF on the full sequence;
- the scheduler really mixes them (a long prompt's chunks run beside decodes, within the
  token budget) and the outputs equal each request run alone;
- after ``Engine.warmup(buckets="all")``, 200 requests of random lengths, segments and batch sizes compile
  nothing (``compiles_after_warmup == 0``), and every step shape maps into the warm-up set.
"""

import numpy as np
import pytest
import torch

from tests.support.hf_tiny import build_hf_model
from inferscale_jax import Engine, EngineConfig, SamplingParams
from inferscale_jax.buckets import StepBuckets
from inferscale_jax.runner import StepRow
from tests.support.tiny_engine import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama_ragged"))
    hf = build_hf_model("gqa_4to1", d)
    engine = Engine.from_pretrained(d, EngineConfig(dtype="float32", page_size=8, hbm_pages=128, prefill_chunk=16))
    return hf, engine


def test_a_mixed_step_equals_its_rows_apart_and_hf(hf_engine):
    hf, e = hf_engine
    rng = np.random.default_rng(0)
    v = e.cfg.vocab_size
    a = rng.integers(1, v, 21).tolist()  # decoding: 20 tokens cached, the 21st fed now
    b = rng.integers(1, v, 13).tolist()  # a fresh prompt: one 13-token chunk
    c = rng.integers(1, v, 30).tolist()  # a prompt whose second chunk (tokens 16..29) runs now
    pa, pb, pc = (e.kv.allocate(-(-len(t) // 8)) for t in (a, b, c))
    lp = dict(top_k=0)
    # history: a's first 20 tokens and c's first 16, computed beforehand
    e.runner.step([StepRow(a[:16], 0, pa), StepRow(c[:16], 0, pc)])
    e.runner.step([StepRow(a[16:20], 16, pa)])
    mixed = e.runner.step([StepRow(a[20:], 20, pa, **lp), StepRow(b, 0, pb, **lp), StepRow(c[16:], 16, pc, **lp)],
                          num_logprobs=5)
    assert e.runner.buckets.key(3, 1 + 13 + 14, 4, 5).ragged  # (a mixed bucket, not decode)
    apart = [e.runner.step([row], num_logprobs=5) for row in
             (StepRow(a[20:], 20, pa), StepRow(b, 0, pb), StepRow(c[16:], 16, pc))]
    for i, one in enumerate(apart):
        assert mixed.tokens[i] == one.tokens[0]
        np.testing.assert_allclose(mixed.top_logprobs[i], one.top_logprobs[0], atol=1e-5)
        np.testing.assert_array_equal(mixed.top_ids[i], one.top_ids[0])
    with torch.no_grad():
        for i, full in enumerate((a, b, c)):
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0, -1].double(), -1).numpy()
            assert mixed.tokens[i] == int(ref.argmax())
            np.testing.assert_allclose(mixed.top_logprobs[i], ref[mixed.top_ids[i]], atol=1e-4)
    e.pool.decref(pa + pb + pc)


def test_long_prompts_are_chunked_beside_decodes_and_outputs_are_unchanged():
    rng = np.random.default_rng(1)
    short = [rng.integers(1, 97, 5).tolist() for _ in range(3)]
    long = rng.integers(1, 97, 150).tolist()  # 10 chunks of 16
    alone = make_engine(pages=128)
    want = [alone.generate(prompt_token_ids=p, sampling=GREEDY).token_ids for p in short + [long]]
    e = make_engine(pages=128, max_num_batched_tokens=24)  # 3 decode rows leave 21 prefill tokens
    steps = []
    real = e.runner.dispatch

    def dispatch(plan, *a, **k):
        steps.append([len(r.tokens) for r in plan.rows])
        return real(plan, *a, **k)
    e.runner.dispatch = dispatch
    ids = [e.submit(prompt_token_ids=p, sampling=GREEDY) for p in short]
    e.step()
    e.step()  # the short prompts' first tokens are sampled: they decode from now on
    ids.append(e.submit(prompt_token_ids=long, sampling=GREEDY))
    got = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                got[o.request_id] = o.output.token_ids
    assert [got[i] for i in ids] == want
    assert all(sum(s) <= 24 for s in steps)  # the budget held in every step
    mixed = [s for s in steps if any(n == 1 for n in s) and any(n > 1 for n in s)]
    assert len(mixed) >= 3  # the long prompt's chunks ran beside decode rows
    assert max(n for s in steps for n in s) <= 16  # and no chunk exceeded prefill_chunk


def test_every_step_shape_maps_into_the_warmup_set():
    b = StepBuckets(max_rows=64, max_tokens=2048, max_pages_per_seq=512, min_table_pages=4, num_logprobs=20)
    keys = set(b.all_keys())
    rng = np.random.default_rng(2)
    for _ in range(2000):
        rows = int(rng.integers(1, 65))
        decode = rng.random() < 0.5
        tokens = rows if decode else int(rng.integers(rows + 1, 2049))
        need = int(rng.integers(1, 513))
        shared = int(rng.integers(1, need + 1)) if decode and rows >= 2 and rng.random() < 0.3 else 0
        key = b.key(rows, tokens, need - shared if shared else need, int(rng.integers(0, 2)) * 5, shared)
        assert key in keys, key
        assert key.rows >= rows and key.tokens >= tokens and key.width >= (need - shared if shared else need)
    # the set stays small enough to compile at startup (54 buckets before mixed steps took cascade
    # groups: one bucket per token bucket and log-prob width more; 68 before they took the smallest
    # group bucket that holds their groups: the 16-group buckets of the six 64-row mixed token buckets,
    # with and without log-probs, 12 more here)
    assert len(keys) <= 80


def test_a_mixed_step_whose_chunks_group_alone_takes_a_bucket_with_room_for_its_groups():
    """A mixed step's cascade bucket holds what its rows can form: up to rows // 2 groups (the warm-up
    bucket: every group has two rows or more), and a bigger group bucket if a step ever held more."""
    b = StepBuckets(max_rows=15, max_tokens=2048, max_pages_per_seq=512, min_table_pages=4, num_logprobs=20)
    warm = b.key(15, 40, 3, 0, 2, 1)
    assert warm in set(b.all_keys()) and warm.groups >= 15 // 2
    for groups in (1, warm.groups, warm.groups + 1, 15):
        key = b.key(15, 15 * 40, 3, 0, 2, groups)
        assert key.ragged and key.groups >= groups, (groups, key)


@pytest.mark.parametrize("fit", ["", "fit"])
def test_mixed_groups_fit_takes_the_smallest_warmed_group_bucket(monkeypatch, fit):
    """The default (``INFERSCALE_MIXED_GROUPS`` unset, or ``fit``): a mixed step of 64 rows takes the
    16-group bucket for up to 16 groups and the 64-group one above; both are in the warm-up set, which
    grows by the fit buckets alone; ``max`` keeps one bucket per token bucket; a bad value is refused
    by name."""
    kw = dict(max_rows=64, max_tokens=2048, max_pages_per_seq=512, min_table_pages=4, num_logprobs=20)
    monkeypatch.setenv("INFERSCALE_MIXED_GROUPS", "max")
    base = StepBuckets(**kw)
    assert base.key(60, 125, 3, 0, 2, 8).groups == 64 and base.mixed_group_buckets(64) == [64]
    monkeypatch.setenv("INFERSCALE_MIXED_GROUPS", fit)
    b = StepBuckets(**kw)
    keys = set(b.all_keys())
    for groups, want in ((1, 16), (8, 16), (16, 16), (17, 64), (32, 64)):
        key = b.key(60, 125, 3, 0, 2, groups)
        assert key.ragged and key.groups == want and key in keys, (groups, key)
    assert b.key(20, 30, 3, 0, 2, 8).groups == 16  # a 32-row mixed step: 16 groups is already the most
    assert b.key(6, 30, 3, 0, 2, 3).groups == base.key(6, 30, 3, 0, 2, 3).groups  # small steps unchanged
    extra = keys - set(base.all_keys())
    assert extra and all(k.ragged and k.groups == 16 and k.rows >= 34 for k in extra), extra
    assert set(base.all_keys()) <= keys
    monkeypatch.setenv("INFERSCALE_MIXED_GROUPS", "tight")
    with pytest.raises(ValueError, match="INFERSCALE_MIXED_GROUPS='tight'.*'fit', 'max'"):
        StepBuckets(**kw)


def test_after_warmup_200_random_requests_compile_nothing():
    e = make_engine(pages=256, max_batch=8, max_num_batched_tokens=64)
    info = e.warmup(buckets="all")  # every bucket (the CPU's default set is the small one)
    assert info["buckets"] > 0 and e.stats()["warm"]
    rng = np.random.default_rng(3)
    for i in range(4):
        e.register_segment(f"s{i}", token_ids=rng.integers(1, 97, int(rng.integers(5, 60))).tolist(), tenant="t")
    n = 0
    while n < 200:
        batch = []
        for _ in range(int(rng.integers(1, 12))):
            segs = [f"s{j}" for j in rng.choice(4, int(rng.integers(0, 3)), replace=False)]
            sp = SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=float(rng.choice([0.0, 0.8])),
                                seed=int(rng.integers(0, 1000)), ignore_eos=True,
                                logprobs=int(rng.integers(1, 4)) if rng.random() < 0.2 else None)
            batch.append(dict(prompt_token_ids=rng.integers(1, 97, int(rng.integers(1, 90))).tolist(),
                              segments=segs, tenant="t", sampling=sp))
        outs = e.generate_batch(batch)
        assert all(o.finish_reason == "length" for o in outs)
        n += len(batch)
    s = e.stats()
    assert s["compiles_after_warmup"] == 0, s
    assert 0.0 <= s["padding_token_fraction"] < 1.0


def test_config_rejects_a_budget_below_a_chunk():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(prefill_chunk=512, max_num_batched_tokens=256)


def test_replay_last_reruns_the_step_and_leaves_the_kv_as_it_was():
    """``ModelRunner.replay_last`` (device-only step timing in bench/engine/engine_bench.py): the same step again
    on the same inputs writes the same K/V into the same slots; ``last_key`` names its bucket."""
    e = make_engine()
    pages = e.kv.allocate(3)
    assert e.runner.last_key is None
    e.runner.step([StepRow(list(range(1, 9)), 0, pages), StepRow([5, 6, 7], 0, pages[2:])])
    key = e.runner.last_key
    assert key.ragged and key.tokens >= 11 and key.rows >= 2, key
    before = [np.asarray(k) for k in e.runner.cache.k + e.runner.cache.v]
    k0 = e.runner.cache.k[0]
    assert e.runner.replay_last(2) > 0
    assert e.runner.cache.k[0] is not k0  # the step ran again (a new cache came out of it)
    after = [np.asarray(k) for k in e.runner.cache.k + e.runner.cache.v]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    e.kv.release(pages)
