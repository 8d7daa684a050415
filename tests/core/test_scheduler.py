"""Continuous batching, preemption and the async/streaming API (issue 5)."""

import asyncio

import jax
import numpy as np
import pytest

from inferscale_jax import AsyncEngine, PoolExhausted, SamplingParams, scheduler
from tests.support.tiny_engine import S, assert_only_nodes_hold_pages, make_engine


def mixed_requests(rng, n=16):
    """Requests mixing segments, prompt lengths and sampling parameters."""
    seg_choices = [[], ["a"], ["b"], ["a", "b"], ["b", "a"], ["c"], ["a", "c"]]
    reqs = []
    for i in range(n):
        if i % 3 == 0:
            sp = SamplingParams(max_tokens=int(rng.integers(3, 9)), temperature=0.0, ignore_eos=True)
        elif i % 3 == 1:
            sp = SamplingParams(max_tokens=int(rng.integers(3, 9)), temperature=0.9, top_k=20, top_p=0.9,
                                seed=int(rng.integers(0, 1000)), ignore_eos=True, logprobs=2)
        else:
            sp = SamplingParams(max_tokens=int(rng.integers(3, 9)), temperature=1.2, seed=i,
                                ignore_eos=True, stop_token_ids=[5])
        prompt = [int(x) for x in rng.integers(1, 97, int(rng.integers(1, 40)))]
        reqs.append(dict(prompt_token_ids=prompt, segments=seg_choices[i % len(seg_choices)], sampling=sp))
    return reqs


def register(engine):
    engine.register_segment("a", token_ids=list(range(1, 22)))  # partial last page
    engine.register_segment("b", token_ids=list(range(30, 46)))  # exactly two pages
    engine.register_segment("c", token_ids=[7])


def assert_same(batched, alone, tol=1e-5):
    assert batched.token_ids == alone.token_ids
    assert batched.finish_reason == alone.finish_reason
    if alone.logprobs is not None:
        for x, y in zip(batched.logprobs, alone.logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[k] - y[k]) for k in x) < tol


def spy_steps(engine, group_tokens=None):
    """Record (cascade groups as (shared pages, rows) each, cascade rows, rows, mixed) of every
    device step the runner launches (mixed: a row computes more than one token); and into
    ``group_tokens`` when given, each step's query tokens per group."""
    seen = []
    orig = engine.runner.dispatch

    def dispatch(plan, *a, **k):
        groups = tuple((k, sum(r.group == i for r in plan.rows)) for i, k in enumerate(plan.groups))
        if group_tokens is not None:
            group_tokens.append([sum(len(r.tokens) for r in plan.rows if r.group == i) for i in range(len(groups))])
        seen.append((groups, sum(r.cascade for r in plan.rows), len(plan.rows),
                     any(len(r.tokens) > 1 for r in plan.rows)))
        return orig(plan, *a, **k)
    engine.runner.dispatch = dispatch
    return seen


@pytest.mark.parametrize("cascade", ["policy", "always"])
def test_16_concurrent_requests_equal_running_alone(cascade, monkeypatch):
    """'always': every group of rows sharing pages (decode rows, and prefill chunks past the shared
    pages) goes through the cascade kernel (the tiny shapes are far below the policy's threshold),
    mixed in one step with the other rows."""
    if cascade == "always":
        monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", 0)
    rng = np.random.default_rng(0)
    reqs = mixed_requests(rng)
    alone_engine = make_engine(pages=256)
    register(alone_engine)
    alone = [alone_engine.generate(**r) for r in reqs]
    engine = make_engine(pages=256)
    register(engine)
    group_tokens = []
    seen = spy_steps(engine, group_tokens)
    batched = engine.generate_batch(reqs)
    # cascade, or the GPU kernels (their split count follows the batch size): sums in another
    # order, so the documented exactness bound (1e-4); the CPU reference path agrees to 1e-5
    tight = cascade == "policy" and jax.default_backend() == "cpu"
    for b, a in zip(batched, alone):
        assert_same(b, a, 1e-5 if tight else 1e-4)
    cascaded = [(n, rows) for k, n, rows, _ in seen if k]
    if cascade == "always":  # groups of segment "a" / "b" rows ran beside rows of other segments
        assert cascaded and all(t >= 2 for step in group_tokens for t in step)  # >= 2 query tokens each
        assert any(n >= 2 for n, _ in cascaded) and any(n < rows for n, rows in cascaded)
    else:
        assert not cascaded
    assert_only_nodes_hold_pages(engine)  # every request's pages came back
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def test_tiny_pool_preempts_and_outputs_are_unchanged():
    rng = np.random.default_rng(1)
    reqs = [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, 20)],
                 sampling=SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True))
            for i in range(8)]
    alone_engine = make_engine(pages=64)
    alone = [alone_engine.generate(**r) for r in reqs]
    engine = make_engine(pages=12)  # 11 usable pages; each request needs 5 by its end
    free0 = engine.pool.num_free
    batched = engine.generate_batch(reqs)
    for b, a in zip(batched, alone):
        assert_same(b, a)
    assert engine.stats()["preemptions"] > 0
    assert engine.pool.num_free == free0  # no leak
    engine.check_invariants()


def test_request_that_can_never_fit_fails_instead_of_waiting_forever():
    engine = make_engine(pages=8)  # 7 usable pages
    engine.register_segment("big", token_ids=list(range(1, 5 * S + 1)), pin=True)  # 5 pages, stays in HBM
    with pytest.raises(PoolExhausted, match="free KV pages"):
        engine.generate(prompt_token_ids=list(range(50, 50 + 3 * S)), sampling=SamplingParams(max_tokens=4))
    assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == 0


def test_long_prompt_is_chunked_and_does_not_stall_decodes():
    engine = make_engine(pages=128)
    short = engine.submit(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=30, temperature=0.0,
                                                                               ignore_eos=True))
    engine.step()  # the short request is decoding now
    long = engine.submit(prompt_token_ids=list(range(1, 90)) * 2,  # 178 tokens: 12 chunks of 16
                         sampling=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    got_short, steps = 0, 0
    while True:
        outs = engine.step()
        steps += 1
        got_short += sum(len(o.new_token_ids) for o in outs if o.request_id == short)
        if any(o.request_id == long and o.new_token_ids for o in outs):
            break
    assert steps >= 11  # the long prompt took one chunk per step ...
    assert got_short >= steps - 1  # ... while the short request produced a token every step
    while engine.has_unfinished():
        engine.step()


def test_async_stream_is_incremental_and_cancel_frees_pages():
    engine = make_engine(pages=64)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = engine.generate(prompt_token_ids=[3, 4, 5], sampling=sp)
    free0 = engine.pool.num_free
    aeng = AsyncEngine(engine)

    async def main():
        deltas = [d async for d in aeng.stream(prompt_token_ids=[3, 4, 5], sampling=sp)]
        # one delta per step while the reader keeps up (outputs waiting for a lagging reader are
        # merged: detokenize.Deltas), so more than one, each with tokens
        assert 1 < len(deltas) <= 12 and all(d.new_token_ids for d in deltas)
        assert deltas[-1].finished and not deltas[0].finished
        assert [t for d in deltas for t in d.new_token_ids] == expected.token_ids
        assert deltas[-1].output.token_ids == expected.token_ids

        # many in flight at once
        outs = await asyncio.gather(*[aeng.generate(prompt_token_ids=[i + 1, 2], sampling=sp) for i in range(6)])
        assert all(len(o.token_ids) == 12 for o in outs)

        # cancel mid-stream: the pages come back before the next step
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        agen = aeng.stream(prompt_token_ids=list(range(1, 40)), sampling=long)
        got = [await agen.__anext__() for _ in range(3)]
        assert engine.pool.num_free < free0
        await agen.aclose()
        for _ in range(200):
            stats = await aeng.stats()
            if stats["running"] == 0:
                break
            await asyncio.sleep(0.01)
        assert stats["running"] == 0 and stats["waiting"] == 0
        assert engine.pool.num_free == free0
        assert len(got) == 3

    try:
        asyncio.run(main())
    finally:
        aeng.shutdown()


def cascade_runs(impl, make_reqs, setup, monkeypatch, threshold=0):
    """Outputs and step records of the same requests with cascade decode off and on."""
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", threshold)
    outs, seens = [], []
    for cascade in (False, True):
        engine = make_engine(pages=128, cascade_decode=cascade, attention_impl=impl)
        setup(engine)
        seens.append(spy_steps(engine))
        outs.append(engine.generate_batch(make_reqs()))
        assert_only_nodes_hold_pages(engine)
    for plain, casc in zip(*outs):  # same tokens; logprobs within the documented exactness bound (1e-4):
        assert casc.token_ids == plain.token_ids  # the LSE merge sums in another order
        for x, y in zip(casc.logprobs, plain.logprobs):
            assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-4
    assert not any(k for k, *_ in seens[0])
    return seens[1]


def greedy_lp(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_cascade_decode_equals_plain_decode(impl, monkeypatch):
    """Rows of two segments and rows of none decode in one step: each group ("kb", 4 full pages,
    3 rows; "faq", 2 full pages, 2 rows) reads its pages once, the row of no segment its own;
    outputs as without cascade."""
    def setup(engine):
        engine.register_segment("kb", token_ids=list(range(1, 4 * S + 3)))  # 4 full pages + 2
        engine.register_segment("faq", token_ids=list(range(50, 50 + 2 * S)))  # 2 full pages

    def reqs():
        segs = [["kb"], ["faq"], ["kb"], [], ["faq"], ["kb"]]
        return [dict(prompt_token_ids=[10 + i, 20 + i], segments=sg, sampling=greedy_lp())
                for i, sg in enumerate(segs)]
    seen = cascade_runs(impl, reqs, setup, monkeypatch)
    assert (((4, 3), (2, 2)), 5, 6, False) in seen  # kb's 4 full pages for its 3 rows, faq's 2 for its 2, of 6 rows


def test_prefix_cache_hits_form_a_cascade_group(monkeypatch):
    """Requests without segments that share a long prompt prefix (prefix-cache hits) group too."""
    system = list(range(1, 3 * S + 1))  # 3 full pages

    def setup(engine):
        engine.generate(prompt_token_ids=system + [90], sampling=SamplingParams(max_tokens=1))

    def reqs():
        return [dict(prompt_token_ids=system + [60 + i, 70 + i], sampling=greedy_lp(5)) for i in range(4)]
    seen = cascade_runs("ref", reqs, setup, monkeypatch)
    assert (((3, 4),), 4, 4, False) in seen


def test_cascade_policy_skips_groups_that_save_little(monkeypatch):
    """Below CASCADE_MIN_SAVED_TOKENS (sum of (rows - 1) x shared tokens) the plain kernel is used."""
    def setup(engine):
        engine.register_segment("kb", token_ids=list(range(1, 4 * S + 1)))  # 32 tokens

    def reqs():
        return [dict(prompt_token_ids=[10 + i], segments=["kb"], sampling=greedy_lp(3)) for i in range(3)]
    assert not any(k for k, *_ in cascade_runs("ref", reqs, setup, monkeypatch, threshold=2 * 32 + 1))
    assert (((4, 3),), 3, 3, False) in cascade_runs("ref", reqs, setup, monkeypatch, threshold=2 * 32)


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_three_segment_groups_in_one_step_equal_cascade_off(impl, monkeypatch):
    """Decode steps with rows over three shared segments (of 4, 3 and 2 full pages) and rows of
    none: every group reads its pages once in one launch; tokens and log-probs as with cascade off."""
    def setup(engine):
        engine.register_segment("kb", token_ids=list(range(1, 4 * S + 5)))  # 4 full pages + 4
        engine.register_segment("faq", token_ids=list(range(40, 40 + 3 * S)))  # exactly 3 pages
        engine.register_segment("doc", token_ids=list(range(70, 70 + 2 * S + 1)))  # 2 full pages + 1

    def reqs():
        segs = [["kb"], ["faq"], ["doc"], ["kb"], [], ["faq"], ["doc"], ["kb"], ["doc"], []]
        return [dict(prompt_token_ids=[10 + i, 20 + i, 30 + i][:1 + i % 3], segments=sg, sampling=greedy_lp(5))
                for i, sg in enumerate(segs)]
    seen = cascade_runs(impl, reqs, setup, monkeypatch)
    three = [groups for groups, *_ in seen if len(groups) == 3]
    assert three, f"no step ran three groups: {seen}"
    # the first 8 requests (max_batch), by pages saved: kb 2 x 4, faq 1 x 3, doc 1 x 2; one row alone
    assert (((4, 3), (3, 2), (2, 2)), 7, 8, False) in seen


# (impl, INFERSCALE_MIXED_DECODE)
MIXED_MODES = [("ref", "ragged"), ("pallas", "ragged"), ("ref", "cascade"), ("pallas", "cascade"),
               ("pallas", "ragged:sl=1,sp=3,lk=16")]  # (INFERSCALE_MIXED_DECODE[:INFERSCALE_MIXED_RAGGED])


def set_mixed_mode(monkeypatch, mode: str) -> None:
    decode, _, ragged = mode.partition(":")
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", decode)
    monkeypatch.setenv("INFERSCALE_MIXED_RAGGED", ragged)


@pytest.mark.parametrize("impl,mode", MIXED_MODES)
def test_mixed_steps_run_their_decode_rows_through_the_cascade(impl, mode, monkeypatch):
    """A long prompt prefills chunk by chunk while rows of two segments decode: the mixed steps
    (decode rows + a chunk) read each group's pages once in the same jitted step; tokens and
    log-probs as with cascade off, with the one-token rows in the ragged kernel or in the decode
    step's cascade kernel (``INFERSCALE_MIXED_DECODE``), the ragged kernel splitting every block or the longest."""
    set_mixed_mode(monkeypatch, mode)
    def setup(engine):
        engine.register_segment("kb", token_ids=list(range(1, 4 * S + 3)))  # 4 full pages + 2
        engine.register_segment("faq", token_ids=list(range(50, 50 + 2 * S)))  # 2 full pages

    def reqs():
        segs = [["kb"], ["faq"], ["kb"], ["faq"], ["kb"]]
        out = [dict(prompt_token_ids=[10 + i], segments=sg, sampling=greedy_lp(6)) for i, sg in enumerate(segs)]
        return out + [dict(prompt_token_ids=list(range(2, 80)), sampling=greedy_lp(2))]  # 5 chunks of 16
    seen = cascade_runs(impl, reqs, setup, monkeypatch)
    mixed = [(groups, n, rows) for groups, n, rows, is_mixed in seen if is_mixed and groups]
    assert mixed, f"no mixed step ran cascade groups: {seen}"
    assert (((4, 3), (2, 2)), 5, 6) in mixed  # kb's 3 rows and faq's 2 beside the prompt's chunk


def test_mixed_groups_fit_keeps_tokens_and_logprobs(monkeypatch):
    """The default (``INFERSCALE_MIXED_GROUPS=fit``): mixed steps of 64 rows over two segments run in the
    16-group bucket instead of the 64-group one (``max``), with the same tokens and log-probs."""
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", 0)

    def run():
        engine = make_engine(pages=256, max_batch=64, max_num_batched_tokens=128, cascade_decode=True)
        engine.register_segment("kb", token_ids=list(range(1, 4 * S + 3)))  # 4 full pages + 2
        engine.register_segment("faq", token_ids=list(range(50, 50 + 2 * S)))  # 2 full pages
        keys = []
        key = engine.runner.buckets.key
        engine.runner.buckets.key = lambda *a, **k: keys.append(key(*a, **k)) or keys[-1]
        reqs = [dict(prompt_token_ids=[10 + i], segments=[["kb"], ["faq"]][i % 2], sampling=greedy_lp(6))
                for i in range(6)]
        reqs += [dict(prompt_token_ids=list(range(2 + i, 70)), sampling=greedy_lp(2))  # chunks beside the rows:
                 for i in range(4)]  # > 64 tokens a step, a 64-row mixed bucket
        return engine.generate_batch(reqs), {k.groups for k in keys if k.ragged and k.groups}
    monkeypatch.setenv("INFERSCALE_MIXED_GROUPS", "max")
    want, groups_max = run()
    monkeypatch.delenv("INFERSCALE_MIXED_GROUPS")
    got, groups_fit = run()
    assert 64 in groups_max and groups_fit == {16}, (groups_max, groups_fit)  # (max: 32-row steps take 16 too)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-5


@pytest.mark.parametrize("impl,mode", MIXED_MODES)
def test_questions_chunks_over_a_segment_join_its_cascade_group(impl, mode, monkeypatch):
    """Questions over two segments, each prefilled in chunks beside rows already decoding: a chunk
    joins the group of its segment's pages (its tokens read them in the shared part, its own in the
    ragged kernel), a prompt over no segment joins none; tokens and log-probs as with cascade off,
    either ``INFERSCALE_MIXED_DECODE``."""
    set_mixed_mode(monkeypatch, mode)
    chunk_members = []

    def setup(engine):
        engine.register_segment("kb", token_ids=list(range(1, 4 * S + 3)))  # 4 full pages + 2
        engine.register_segment("faq", token_ids=list(range(50, 50 + 2 * S)))  # 2 full pages
        dispatch = engine.runner.dispatch

        def spy(plan, *a, **k):
            chunk_members.extend((plan.groups[r.group], len(r.tokens), r.start) for r in plan.rows
                                 if r.group >= 0 and len(r.tokens) > 1)
            return dispatch(plan, *a, **k)
        engine.runner.dispatch = spy

    def reqs():
        segs = [["kb"], ["faq"], ["kb"], ["faq"], ["kb"], []]
        return [dict(prompt_token_ids=[int(x) for x in np.random.default_rng(i).integers(3, 90, 5 + 9 * i)],
                     segments=sg, sampling=greedy_lp(4)) for i, sg in enumerate(segs)]
    seen = cascade_runs(impl, reqs, setup, monkeypatch)
    assert any(mixed and groups for groups, _, _, mixed in seen), seen
    # chunks in groups: kb's (4 shared pages) and faq's (2), each starting past its group's pages
    assert {k for k, _, _ in chunk_members} == {4, 2}, chunk_members
    assert all(start >= k * S for k, _, start in chunk_members)


def test_cascade_policy_takes_every_group_of_two_rows_or_more(monkeypatch):
    """Every group of >= 2 rows with the same shared pages, the most saving first; singletons and
    rows without shared pages read alone; hash collisions split; the threshold counts all groups
    together; at most MAX_GROUPS groups."""
    from types import SimpleNamespace

    from inferscale_jax.buckets import MAX_GROUPS
    sched = make_engine(pages=16).scheduler

    def rows(keys, hashes=None):
        return [SimpleNamespace(seq=SimpleNamespace(shared_key=k, shared_hash=hash(k) if hashes is None else h))
                for k, h in zip(keys, hashes or keys)]

    def decode_groups(owners):  # a step of decode rows only
        return sched._cascade_groups(owners, [None] * len(owners), len(owners))
    a, b, c = tuple(range(1, 9)), tuple(range(20, 24)), (99,)
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", 0)
    got = decode_groups(rows([b, a, (), c, a, b, a, ()]))
    assert got == [(8, [1, 4, 6]), (4, [0, 5])]  # a saves 2 x 8 pages, b 1 x 4; c alone, () none
    assert decode_groups(rows([a, b, b, a], hashes=[1, 1, 1, 1])) == [(8, [0, 3]), (4, [1, 2])]
    assert decode_groups(rows([a, b, c, ()])) == []
    # threshold: (2 x 8 + 1 x 4) pages x S tokens saved by both groups together
    saved = (2 * 8 + 4) * S
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", saved)
    assert len(decode_groups(rows([b, a, a, b, a]))) == 2
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", saved + 1)
    assert decode_groups(rows([b, a, a, b, a])) == []
    monkeypatch.setattr(scheduler, "CASCADE_MIN_SAVED_TOKENS", 0)
    keys = [tuple(range(1, 2 + i)) for i in range(MAX_GROUPS + 6)]  # pairs; group i saves i + 1 pages
    got = decode_groups(rows([k for k in keys for _ in range(2)]))
    assert len(got) == MAX_GROUPS and [k for k, _ in got] == [len(k) for k in keys[::-1][:MAX_GROUPS]]
    # a mixed step: prefill chunks (after the decode rows) join the group of their shared pages when
    # they start past them and a decode row reads those pages too, each counting its query tokens
    def chunk(start, n):
        return SimpleNamespace(start=start, tokens=[0] * n)
    owners = rows([a, b, a, b, a, c, (), c]) + [SimpleNamespace(seq=None)]  # (seq None: not yet allocated)
    step = [None, None, None, chunk(4 * S + 3, 2), chunk(7 * S, 3), chunk(S, 4), chunk(0, 9), chunk(S, 6),
            chunk(0, 3)]
    # a: (2 + 0 - 1) x 8 pages saved (chunk 4 starts inside a's pages); b: (1 + 2 - 1) x 4; c: chunks only
    assert sched._cascade_groups(owners, step, 3) == [(8, [0, 2]), (4, [1, 3])]
    step[4] = chunk(8 * S, 5)  # now past a's pages: a saves (2 + 5 - 1) x 8
    assert sched._cascade_groups(owners, step, 3) == [(8, [0, 2, 4]), (4, [1, 3])]
    assert sched._cascade_groups(owners[3:], step[3:], 0) == []  # chunks alone group nowhere


def test_every_cascade_step_maps_into_the_warmup_set():
    """Decode steps of any row count with up to rows // 2 groups (>= 2 rows each) and any shared
    length take a warm-up bucket holding them."""
    from inferscale_jax.buckets import MAX_GROUPS, StepBuckets
    for max_rows in (48, 256):
        b = StepBuckets(max_rows=max_rows, max_tokens=2048, max_pages_per_seq=512, num_logprobs=20)
        keys = set(b.all_keys())
        rng = np.random.default_rng(max_rows)
        for _ in range(500):
            rows = int(rng.integers(2, max_rows + 1))
            groups = int(rng.integers(1, min(MAX_GROUPS, rows // 2) + 1))
            shared, need = int(rng.integers(1, 513)), int(rng.integers(1, 513))
            key = b.key(rows, rows, need, int(rng.integers(0, 2)), shared, groups)
            assert key in keys, key
            assert key.rows >= rows and key.groups >= groups and key.shared >= shared and key.width >= need


def test_a_flooding_tenant_does_not_delay_another_tenants_request():
    """Tenant a queues 24 requests, then tenant b one: b is admitted as slots free (the tenant
    running fewer goes first), not after a's whole queue; a's own requests keep their order."""
    e = make_engine(pages=128, max_batch=4)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a_ids = [e.submit(prompt_token_ids=[3 + i, 4, 5], tenant="a", sampling=sp) for i in range(24)]
    e.step()  # a's first 4 are admitted and run
    b_id = e.submit(prompt_token_ids=[7, 8, 9], tenant="b", sampling=sp)
    assert e.stats()["tenants"] == {"a": {"running": 4, "waiting": 20}, "b": {"running": 0, "waiting": 1}}
    admitted = []
    start = e.kv.start
    e.kv.start = lambda req: (admitted.append(req.id), start(req))[1]
    done = {}
    while len(done) < 25:
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.output
    # a's first 4 finish together: of the 4 freed slots the first goes to a (a tie at 0 running: a
    # has waited longest), the second to b (0 running against a's 1) - not after a's 20 queued
    assert admitted.index(b_id) == 1, admitted[:6]
    assert [r for r in admitted if r != b_id] == a_ids[4:]  # a's in arrival order
    alone = make_engine(pages=128).generate(prompt_token_ids=[7, 8, 9], sampling=sp)
    assert done[b_id].token_ids == alone.token_ids


def test_tenant_reserve_admits_another_tenant_at_the_next_step():
    """With tenant_reserve, tenant a holds at most max_batch - 1 rows of 4 however many it queues,
    so tenant b's request is admitted at the very next step; without it b waits for a slot."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    steps_to_admit = {}
    for reserve in (0.0, 0.25):
        e = make_engine(pages=128, max_batch=4, tenant_reserve=reserve)
        assert e.scheduler.tenant_cap == (3 if reserve else 4)
        for i in range(12):
            e.submit(prompt_token_ids=[3 + i, 4, 5], tenant="a", sampling=sp)
        e.step()
        assert e.stats()["tenants"]["a"]["running"] == e.scheduler.tenant_cap  # a alone: held at its cap
        b_id = e.submit(prompt_token_ids=[7, 8, 9], tenant="b", sampling=sp)
        n = 0
        while e.scheduler.requests[b_id].status != "running":
            e.step()
            n += 1
        steps_to_admit[reserve] = n
        while e.has_unfinished():
            e.step()
    assert steps_to_admit[0.25] == 1 and steps_to_admit[0.0] > 5, steps_to_admit


def test_step_buckets_with_reference_attention_narrow_mixed_steps():
    """narrow_mixed (the jnp reference on the CPU): a mixed step of short rows takes the second
    narrowest table width, a long one the widest; every such key is in the warm-up set, and the
    small set warms the common one."""
    from inferscale_jax.buckets import StepBuckets
    b = StepBuckets(max_rows=8, max_tokens=2048, max_pages_per_seq=256, narrow_mixed=True)
    assert b.widths == [4, 32, 256] and b.mixed_widths == [32, 256]
    short, long_ = b.key(3, 20, 2, 0), b.key(3, 20, 100, 0)
    assert (short.width, long_.width) == (32, 256) and short.ragged
    assert {short, long_} <= set(b.all_keys())
    assert short in b.warmup_keys("small") and long_ not in b.warmup_keys("small")
    wide = StepBuckets(max_rows=8, max_tokens=2048, max_pages_per_seq=256)
    assert wide.key(3, 20, 2, 0).width == 256  # the GPU kernels: always the widest


def test_fair_queue_counts_and_picks():
    from collections import Counter

    from inferscale_jax.fair_queue import FairQueue

    class R:
        def __init__(self, tenant, ready=False):
            self.tenant, self.ready = tenant, ready

    q = FairQueue()
    a = [R("a") for _ in range(5)]
    b1, b2 = R("b"), R("b", ready=True)
    for r in a + [b1, b2]:
        q.append(r)
    assert q.count == {"a": 5, "b": 2} and len(q) == 7
    ready = lambda r: r.ready  # noqa: E731
    assert q.pick(Counter(a=3, b=1), 8, ready) is b2  # b runs fewer; its resident request first
    assert q.pick(Counter(a=0, b=1), 8, ready) is a[0]
    assert q.pick(Counter(a=2, b=2), 8, ready) is a[0]  # a tie: the tenant waiting longest
    for r in a:
        q.remove(r)
    assert q.count == {"b": 2} and q.pick(Counter(b=9), 1, ready) is b1  # one tenant: arrival order
    q.remove(b1)
    q.appendleft(b1)
    q.remove(b2)
    q.remove(b1)
    assert not q and q.count == {}
    for r in (R("a"), R("a"), R("b")):
        q.append(r)
    assert q.pick(Counter(a=3), 8, ready, cap=3).tenant == "b"  # a at its cap: passed over
    assert q.pick(Counter(a=3, b=3), 8, ready, cap=3) is None  # everyone at the cap: nothing


def test_stats_count_the_steps_dispatched():
    """stats()' step counters equal the plans the runner was given: steps, rows, decode rows
    (one token, not a prompt chunk) and tokens."""
    engine = make_engine()
    register(engine)
    plans = []
    orig = engine.runner.dispatch

    def dispatch(plan, *a, **k):
        plans.append([(len(r.tokens), r.slot >= 0) for r in plan.rows])  # (a decode row has a slot)
        return orig(plan, *a, **k)
    engine.runner.dispatch = dispatch
    before = engine.stats()
    engine.generate_batch(mixed_requests(np.random.default_rng(4), 12))
    after = engine.stats()
    assert after["steps"] - before["steps"] == len(plans) > 0
    assert after["step_rows"] - before["step_rows"] == sum(len(p) for p in plans)
    assert after["step_tokens"] - before["step_tokens"] == sum(n for p in plans for n, _ in p)
    decode = after["step_decode_rows"] - before["step_decode_rows"]
    assert decode == sum(d for p in plans for _, d in p)
    assert 0 < decode < after["step_rows"] - before["step_rows"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    assert decode <= generated  # each decode row samples one token (the first comes from the prefill)
