"""Multi-step decode (EngineConfig.decode_steps; inferscale_jax/decode_loop.py): decode steps run
several at a time in one device loop must give what single steps give, token for token (finish
reasons exactly; log-probs within the float32 rounding of another batch bucket), with every way a
request ends inside a loop: EOS, a stop id, max_tokens mid-loop, a stop string (found on the host),
an abort while a loop is in flight; beside rows that cannot loop (penalties, a bias), cascade
groups over segments, overlap on and off, and a pool too small to give every row its pages ahead."""

import dataclasses

import jax
import numpy as np
import pytest

from inferscale_jax import Engine, EngineConfig, SamplingParams
from inferscale_jax.decode_loop import pack_stops, stop_width
from models import init_params
from tests.core.test_scheduler import mixed_requests, register
from tests.engine.test_overlap import assert_identical, preempting_requests, stopping_requests
from tests.support.tiny_engine import CFG, assert_only_nodes_hold_pages, make_engine

EOS = (33, 52, 85)  # ids the tiny model samples often: requests without ignore_eos end on them
CFG_EOS = dataclasses.replace(CFG, eos_token_ids=EOS)


def eos_engine(**kw):
    """The tiny engine with EOS ids, so requests without ``ignore_eos`` end on them."""
    params = init_params(CFG_EOS, jax.random.PRNGKey(0), scale=0.5)
    engine = Engine(params, CFG_EOS, None, EngineConfig(**{"dtype": "float32", "page_size": 8, "hbm_pages": 256,
                                                           "prefill_chunk": 16, **kw}))
    engine.debug_checks = True
    return engine


def ending_requests(rng, n=12):
    """Requests that end inside a loop in every way: EOS (no ignore_eos), a stop id, max_tokens at
    every offset of a loop of 4 or 8, greedy and sampled, some with log-probs."""
    reqs = []
    for i in range(n):
        sp = SamplingParams(max_tokens=int(rng.integers(1, 28)), temperature=0.0 if i % 2 else 1.0, seed=i,
                            ignore_eos=i % 3 == 0, stop_token_ids=[11, 23] if i % 4 == 1 else [],
                            logprobs=3 if i % 5 == 0 else None)
        reqs.append(dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, int(rng.integers(2, 30)))],
                         sampling=sp))
    return reqs


def run(reqs, build=make_engine, segments=False, **kw):
    engine = build(**kw)
    if segments:
        register(engine)
    return engine, engine.generate_batch(reqs)


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_loop_equals_single_steps_with_every_end(overlap):
    rng = np.random.default_rng(11)
    reqs = ending_requests(rng) + stopping_requests(rng, 6)
    _, want = run(reqs, eos_engine, overlap_decode=overlap)
    for steps in (4, 8):
        engine, got = run(reqs, eos_engine, overlap_decode=overlap, decode_steps=steps)
        for a, b in zip(got, want):
            assert_identical(a, b)
        assert engine.stats()["decode_loops"] > 0  # the loop ran
        assert engine.stats()["steps"] < engine.stats()["step_decode_rows"]
        engine.check_invariants()
        assert_only_nodes_hold_pages(engine)
    reasons = [o.finish_reason for o in want]
    assert reasons.count("stop") >= 4 and reasons.count("length") >= 4  # both ends were taken
    # EOS ends among them, past the first token (inside the decode steps)
    assert sum(o.finish_reason == "stop" and len(o.token_ids) > 2 and o.token_ids[-1] in EOS for o in want) >= 2
    # max_tokens fell at many offsets inside a loop of 8
    assert len({len(o.token_ids) % 8 for o in want if o.finish_reason == "length"}) >= 4


def test_the_device_stops_a_row_at_its_stop_id_and_budget():
    """Inside the loop a row that sampled a stop id, or its budget, samples nothing more (-1) and
    writes no more K/V: the host is not needed to stop it."""
    rng = np.random.default_rng(11)
    engine = eos_engine(decode_steps=8)
    seen, plans = [], {}
    dispatch, collect = engine.runner.dispatch, engine.runner.collect

    def spy_dispatch(plan, *args, **kw):
        pending = dispatch(plan, *args, **kw)
        plans[id(pending)] = (pending, plan)
        return pending

    def spy_collect(pending):
        res = collect(pending)
        if pending.steps > 1:
            seen.append((plans[id(pending)][1].stops, np.stack([r.tokens for r in res], axis=1)))  # [rows, steps]
        return res

    engine.runner.dispatch, engine.runner.collect = spy_dispatch, spy_collect
    engine.generate_batch(ending_requests(rng) + stopping_requests(rng, 6))
    assert seen
    stopped_early = 0
    for stops, toks in seen:
        for (ids, budget), row in zip(stops, toks):
            n = int((row >= 0).sum())
            assert (row[:n] >= 0).all() and (row[n:] == -1).all()  # tokens, then nothing
            assert 1 <= n <= budget
            hits = [k for k, t in enumerate(row[:n]) if t in ids]
            assert hits in ([], [n - 1])  # a stop id is the row's last token
            stopped_early += bool(hits) and n < budget
    assert stopped_early >= 2


def test_decode_loop_beside_segments_penalties_and_mixed_steps():
    """Cascade groups over segments, rows that cannot loop (penalties: their steps run alone),
    and requests arriving while others decode (mixed steps between the loops)."""
    rng = np.random.default_rng(2)
    reqs = mixed_requests(rng) + stopping_requests(rng, 4)
    reqs.append(dict(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=0.5)))
    _, want = run(reqs, segments=True, pages=256)
    engine, got = run(reqs, segments=True, pages=256, decode_steps=4)
    for a, b in zip(got, want):
        assert_identical(a, b)
    assert engine.stats()["decode_loops"] > 0
    assert_only_nodes_hold_pages(engine)


def test_decode_loop_streams_arrivals_between_loops():
    """Requests added while others decode in loops: their outputs equal the single-step engine's,
    and each request's streamed deltas concatenate to its final ids."""
    rng = np.random.default_rng(4)
    reqs = ending_requests(rng, 10)
    outs = {}
    for steps in (1, 4):
        engine = eos_engine(decode_steps=steps)
        got, deltas, loops_before = {}, {}, []
        ids = [engine.submit(**reqs[0]), engine.submit(**reqs[1])]
        pending = list(range(2, len(reqs)))
        while engine.has_unfinished() or pending:
            for o in engine.step():
                deltas.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    got[o.request_id] = o.output
            if pending and engine.scheduler.steps % 3 == 0:  # an arrival every few steps
                loops_before.append(engine.scheduler.loops)
                ids.append(engine.submit(**reqs[pending.pop(0)]))
        for rid in ids:
            assert deltas[rid] == got[rid].token_ids
        outs[steps] = [got[r] for r in ids]
        if steps > 1:  # requests arrived after loops had run, and loops ran after them
            assert 0 < max(loops_before) < engine.stats()["decode_loops"], loops_before
    for a, b in zip(outs[4], outs[1]):
        assert_identical(a, b)


def test_decode_loop_with_a_short_pool_falls_back_and_preempts_the_same():
    reqs = preempting_requests()
    _, want = run(reqs, pages=12)
    engine, got = run(reqs, pages=12, decode_steps=8)
    for a, b in zip(got, want):
        assert_identical(a, b)
    st = engine.stats()
    # loops ran where the pool held their pages, and the preemptions came out the same
    assert st["decode_loops"] > 0 and st["preemptions"] > 0
    engine.check_invariants()
    assert engine.pool.num_free == engine.pool.num_pages - 1  # no leak (no segments here)


def test_abort_while_a_decode_loop_is_in_flight():
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [dict(prompt_token_ids=[3 + i, 8, 9, 10], sampling=sp) for i in range(3)]
    alone = make_engine(pages=64)
    want = [alone.generate(**r) for r in reqs]
    engine = make_engine(pages=64, decode_steps=4)
    free0 = engine.pool.num_free
    ids = [engine.submit(**r) for r in reqs]
    got, outs = {}, []
    while engine.scheduler.loops < 2:
        outs += engine.step()
    assert engine.loop.inflight is not None and engine.loop.inflight[1].plan.steps == 4
    before = engine.pool.num_free
    out = engine.abort(ids[1])
    assert out.finished and out.output.finish_reason == "abort"
    assert engine.pool.num_free > before  # its pages (the loop's look-ahead ones too) came back at once
    while engine.has_unfinished():
        outs += engine.step()
    engine.step()  # settles whatever is still in flight
    for o in outs:
        if o.finished:
            got[o.request_id] = o.output
    assert ids[1] not in got  # no token or second finish for the aborted request
    for i in (0, 2):
        assert got[ids[i]].token_ids == want[i].token_ids
    assert engine.pool.num_free == free0
    assert engine.stats()["decode_loops"] >= 5


def test_stop_string_inside_a_decode_loop(tmp_path, monkeypatch):
    """A stop string is found on the host: the text is cut where single steps cut it, and the
    loop's later tokens are dropped."""
    monkeypatch.setenv("INFERSCALE_CACHE", str(tmp_path))
    prompt = "Q: How long is the warranty? A:"
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    one = Engine.from_pretrained(None, EngineConfig(dtype="float32", hbm_pages=256))
    full = one.generate(prompt, sampling=greedy)
    stop = full.text[20:24]
    sp = dataclasses.replace(greedy, stop=["never-produced-zz", stop])
    want = one.generate(prompt, sampling=sp)
    loop = Engine.from_pretrained(None, EngineConfig(dtype="float32", hbm_pages=256, decode_steps=8))
    got = loop.generate(prompt, sampling=sp)
    assert got.finish_reason == want.finish_reason == "stop"
    assert got.text == want.text and got.token_ids == want.token_ids
    assert loop.stats()["decode_loops"] > 0
    assert loop.generate(prompt, sampling=greedy).token_ids == full.token_ids


def test_pack_stops_layout():
    stops = pack_stops([(frozenset({7, 2}), 3), (frozenset(), 1)], rows=4)
    w = stop_width(2)
    assert stops.shape == (4, w + 1) and stops.dtype == np.int32
    assert stops[0, :2].tolist() == [2, 7] and (stops[0, 2:w] == -1).all() and stops[0, w] == 3
    assert (stops[1, :w] == -1).all() and stops[1, w] == 1
    assert (stops[2:, w] == 0).all()  # padding rows: no budget, done at once
    assert [stop_width(n) for n in (0, 4, 5, 16, 17)] == [4, 4, 16, 16, 64]


def test_decode_steps_is_checked():
    for bad in (0, 65, 2.5):
        with pytest.raises(ValueError, match="decode_steps"):
            EngineConfig(decode_steps=bad)


def test_warmup_compiles_the_decode_loops():
    """With decode_steps > 1 the warm-up compiles each decode bucket's loop too: serving then
    compiles nothing (for the stop ids most requests carry: EOS, or none)."""
    engine = eos_engine(decode_steps=4, max_batch=8)
    engine.warmup(buckets="all", progress_bar=False)
    loops = [k for k in engine.runner.executables if k[1] and k[1][-1][0] == "loop"]
    assert loops and all(not k[0].ragged for k in loops)
    rng = np.random.default_rng(5)
    reqs = [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, int(rng.integers(2, 40)))],
                 sampling=SamplingParams(max_tokens=int(rng.integers(4, 30)), temperature=0.7 * (i % 2), seed=i,
                                         ignore_eos=i % 3 == 0, logprobs=2 if i % 4 == 0 else None))
            for i in range(8)]
    engine.generate_batch(reqs)
    assert engine.stats()["decode_loops"] > 0
    assert engine.runner.compiles_after_warmup == 0


def test_a_row_ending_at_max_model_len_beside_a_longer_one():
    """A row with fewer tokens left than the loop's steps gets pages for its own tokens only: one
    ending exactly at ``max_model_len`` runs in loops beside a longer request, as in single steps."""
    rng = np.random.default_rng(0)
    reqs = [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, CFG.max_position_embeddings - 20)],
                 sampling=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
            dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, 5)],
                 sampling=SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))]
    _, want = run(reqs, pages=160)
    engine, got = run(reqs, pages=160, decode_steps=8)
    for a, b in zip(got, want):
        assert_identical(a, b)
    assert [o.finish_reason for o in got] == ["length", "length"] and engine.stats()["decode_loops"] > 0


def test_look_ahead_pages_preempt_no_more_than_single_steps():
    """The loop's pages are taken all or nothing, for each row's own budget: on small pools the
    preemptions are the single steps' (none forced by pages held for a loop that did not run)."""
    for seed in range(10, 16):
        rng = np.random.default_rng(seed)
        pages = int(rng.integers(9, 18))
        reqs = [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, int(rng.integers(3, 20)))],
                     sampling=SamplingParams(max_tokens=int(rng.integers(5, 30)), temperature=0.0, ignore_eos=True))
                for _ in range(int(rng.integers(3, 7)))]
        one, want = run(reqs, pages=pages)
        loop, got = run(reqs, pages=pages, decode_steps=8)
        for a, b in zip(got, want):
            assert_identical(a, b)
        assert loop.stats()["preemptions"] == one.stats()["preemptions"], seed
        assert loop.pool.num_free == loop.pool.num_pages - 1, seed
