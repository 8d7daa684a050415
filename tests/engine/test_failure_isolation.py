"""Failure isolation: one request's failure fails that request alone; engine-wide faults fail the
running requests with ``EngineFault`` and the engine either goes on (accounting intact) or stops
serving (device lost), never half-serving."""

import asyncio

import jax
import numpy as np
import pytest

from inferscale_jax import AsyncEngine, EngineFault, RequestTooLong, SamplingParams, SegmentNotFound
from tests.support.tiny_engine import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
MARK = 50  # top_k of the request whose rows the fault injection rejects (greedy: top_k changes nothing)


def _run(engine, ids):
    """Step until every id finished; {id: output or error}."""
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.error if out.error is not None else out.output
        if all(i in done for i in ids):
            return done
    raise AssertionError(f"requests never finished: {set(ids) - set(done)}")


def _solo(prompt, segments_tokens=()):
    """Greedy tokens of ``prompt`` after ``segments_tokens`` on a fresh engine."""
    e = make_engine()
    segs = []
    for i, toks in enumerate(segments_tokens):
        e.register_segment(f"s{i}", token_ids=toks, tenant="solo")
        segs.append(f"s{i}")
    return e.generate(prompt_token_ids=prompt, segments=segs, tenant="solo", sampling=GREEDY).token_ids


SEG_A = list(range(3, 23))
SEG_B = list(range(30, 47))
P1, P2, P3 = [5, 6, 7], [8, 9, 10, 11], [12, 13]


def test_segment_deleted_before_admission_fails_that_request_alone():
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A, tenant="t1")
    e.register_segment("b", token_ids=SEG_B, tenant="t2")
    r1 = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t1", sampling=GREEDY)
    r2 = e.submit(prompt_token_ids=P2, segments=["b"], tenant="t2", sampling=GREEDY)
    r3 = e.submit(prompt_token_ids=P3, tenant="t3", sampling=GREEDY)
    e.delete_segment("a", tenant="t1")  # after submit, before the step that admits it
    done = _run(e, [r1, r2, r3])
    assert isinstance(done[r1], SegmentNotFound) and "'a'" in str(done[r1])
    assert done[r2].token_ids == _solo(P2, [SEG_B])
    assert done[r3].token_ids == _solo(P3)
    e.check_page_accounting()


def test_segment_replaced_before_admission_is_not_found_and_preempted_requests_continue():
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A, tenant="t1")
    r1 = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t1", sampling=GREEDY)
    e.delete_segment("a", tenant="t1")
    e.register_segment("a", token_ids=SEG_B, tenant="t1")  # same id, other content
    assert isinstance(_run(e, [r1])[r1], SegmentNotFound)
    # a request that already ran (then was preempted) keeps its tokens: it finishes, exactly
    r2 = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t1", sampling=GREEDY)
    e.step()
    req = e.scheduler.requests[r2]
    e.loop.drain()  # settle the in-flight decode step, as the scheduler does before preempting
    e.scheduler._preempt(req)
    e.delete_segment("a", tenant="t1")
    assert _run(e, [r2])[r2].token_ids == _solo(P1, [SEG_B])
    e.check_page_accounting()


def _inject(engine, monkeypatch, phase):
    """Rows of the MARK request raise in dispatch during ``phase`` ("prefill" or "decode")."""
    real = engine.runner.dispatch

    def dispatch(plan, *a, **k):
        decode = all(len(r.tokens) == 1 for r in plan.rows)
        if any(r.top_k == MARK for r in plan.rows) and decode == (phase == "decode"):
            raise OverflowError("Python int too large to convert to C int")
        return real(plan, *a, **k)
    monkeypatch.setattr(engine.runner, "dispatch", dispatch)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_failing_row_fails_its_request_only(monkeypatch, phase, overlap):
    e = make_engine(overlap_decode=overlap)
    e.register_segment("b", token_ids=SEG_B, tenant="t2")
    _inject(e, monkeypatch, phase)
    bad = e.submit(prompt_token_ids=P1, tenant="t1", sampling=SamplingParams(max_tokens=6, temperature=0.0, top_k=MARK))
    r2 = e.submit(prompt_token_ids=P2, segments=["b"], tenant="t2", sampling=GREEDY)
    r3 = e.submit(prompt_token_ids=P3, tenant="t3", sampling=GREEDY)
    done = _run(e, [bad, r2, r3])
    assert isinstance(done[bad], OverflowError)
    assert done[r2].token_ids == _solo(P2, [SEG_B])
    assert done[r3].token_ids == _solo(P3)
    assert e.fault is None
    e.check_page_accounting()


def test_a_lost_step_result_is_recomputed_and_outputs_are_unchanged(monkeypatch):
    e = make_engine()
    real = e.runner.collect
    calls = {"n": 0}

    def collect(pending):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step's read-back fails once (the cache itself is fine)
            raise RuntimeError("INTERNAL: transient device error")
        return real(pending)
    monkeypatch.setattr(e.runner, "collect", collect)
    ids = [e.submit(prompt_token_ids=p, tenant="t", sampling=GREEDY) for p in (P1, P2, P3)]
    done = _run(e, ids)
    assert [done[i].token_ids for i in ids] == [_solo(p) for p in (P1, P2, P3)]
    e.check_page_accounting()


def _lose_device(engine, monkeypatch):
    real = engine.runner.collect

    def collect(pending):
        real(pending)  # the step ran; reading its result is what fails
        for leaf in jax.tree.leaves(engine.runner.cache):
            leaf.delete()  # the KV cache is gone, as after a device fault
        raise RuntimeError("INTERNAL: CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.runner, "collect", collect)


def test_a_lost_device_stops_the_engine_with_engine_fault(monkeypatch):
    e = make_engine()
    r1 = e.submit(prompt_token_ids=P1, tenant="t", sampling=GREEDY)
    _lose_device(e, monkeypatch)
    with pytest.raises(EngineFault, match="restart"):
        for _ in range(3):  # the first step's results are read (and lost) in the next one
            e.step()
    assert isinstance(e.fault, EngineFault)
    with pytest.raises(EngineFault):
        e.submit(prompt_token_ids=P2, tenant="t", sampling=GREEDY)
    with pytest.raises(EngineFault):
        e.step()
    assert r1  # submitted before the fault


def test_async_engine_fails_every_stream_once_and_calls_on_fatal(monkeypatch):
    e = make_engine()
    fatal = []
    ae = AsyncEngine(e, on_fatal=fatal.append)
    _lose_device(e, monkeypatch)

    async def one(p):
        try:
            await ae.generate(prompt_token_ids=p, tenant="t", sampling=GREEDY)
        except EngineFault as err:
            return err
        return None

    async def main():
        return await asyncio.gather(*(one(p) for p in (P1, P2, P3)))
    try:
        errs = asyncio.run(main())
        assert all(isinstance(x, EngineFault) for x in errs)
        assert len(fatal) == 1 and ae.fatal is fatal[0]
        with pytest.raises(EngineFault):
            asyncio.run(ae.generate(prompt_token_ids=P1, tenant="t", sampling=GREEDY))
    finally:
        ae.shutdown()


def test_an_unexpected_step_error_fails_running_requests_then_serving_goes_on(monkeypatch):
    e = make_engine()
    ids = [e.submit(prompt_token_ids=p, tenant="t", sampling=GREEDY) for p in (P1, P2)]
    e.step()  # both admitted and prefilled
    real = e.scheduler._cascade_groups
    monkeypatch.setattr(e.scheduler, "_cascade_groups", lambda reqs: 1 / 0)
    outs = e.step()
    assert {o.request_id for o in outs} == set(ids)
    assert all(isinstance(o.error, EngineFault) and "retry" in str(o.error) for o in outs)
    monkeypatch.setattr(e.scheduler, "_cascade_groups", real)
    e.check_page_accounting()
    r3 = e.submit(prompt_token_ids=P3, tenant="t", sampling=GREEDY)
    assert _run(e, [r3])[r3].token_ids == _solo(P3)


def test_unseeded_requests_draw_fresh_keys_and_seeded_ones_repeat():
    keys = []
    for _ in range(2):
        e = make_engine()
        a = e.submit(prompt_token_ids=P1, tenant="t", sampling=SamplingParams(max_tokens=2))
        b = e.submit(prompt_token_ids=P1, tenant="t", sampling=SamplingParams(max_tokens=2, seed=7))
        keys.append((e.scheduler.requests[a].key.copy(), e.scheduler.requests[b].key.copy()))
    assert not np.array_equal(keys[0][0], keys[1][0])  # request 1 of two processes: different streams
    assert np.array_equal(keys[0][1], keys[1][1])


@pytest.mark.parametrize("bad", ["a\nb", "with space", "", "x" * 257, "tab\t", "ünï", "q?x", 5])
def test_segment_ids_outside_the_alphabet_are_rejected(bad):
    e = make_engine()
    with pytest.raises(ValueError, match="segment_id"):
        e.register_segment(bad, token_ids=SEG_A)
    assert len(e.store) == 0


def test_segment_ids_of_the_whole_alphabet_work():
    e = make_engine()
    sid = "Team-1/faq:v1.2_x"
    e.register_segment(sid, token_ids=SEG_A)
    assert e.generate(prompt_token_ids=P1, segments=[sid], sampling=GREEDY).token_ids == _solo(P1, [SEG_A])
    e.delete_segment(sid)


def test_compose_that_can_never_fit_is_request_too_long_naming_the_sizes():
    e = make_engine(pages=16)  # 15 usable pages of 8 tokens
    e.register_segment("a", token_ids=list(range(3, 43)), tenant="t")  # 5 pages
    e.register_segment("b", token_ids=list(range(43, 83)), tenant="t")  # 5 pages
    with pytest.raises(RequestTooLong, match=r"pages in all.*holds 15 pages"):
        e.submit(prompt_token_ids=P1, segments=["a", "b"], tenant="t", mode="compose", sampling=GREEDY)
    # exact mode shares the chain's pages: the same request fits
    rid = e.submit(prompt_token_ids=P1, segments=["a", "b"], tenant="t", mode="exact", sampling=GREEDY)
    assert not isinstance(_run(e, [rid])[rid], Exception)


def test_outputs_finished_earlier_in_a_failing_step_are_still_reported(monkeypatch):
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A, tenant="t1")
    running = e.submit(prompt_token_ids=P2, tenant="t", sampling=GREEDY)
    e.step()
    e.step()  # its prefill read back: decoding from now on
    short = e.submit(prompt_token_ids=P3, tenant="t", sampling=SamplingParams(max_tokens=1, temperature=0.0))
    e.step()  # its prefill is in flight: it finishes when this step is read, in the next one
    gone = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t1", sampling=GREEDY)
    e.delete_segment("a", tenant="t1")  # `gone` fails at admission
    real = e.scheduler._apply

    def apply(owner, row, res, i):  # `short` finishes, then the step raises
        out = real(owner, row, res, i)
        if getattr(owner, "id", None) == short:
            raise ZeroDivisionError("a bug")
        return out
    monkeypatch.setattr(e.scheduler, "_apply", apply)
    outs = {o.request_id: o for o in e.step()}
    assert set(outs) == {running, gone, short}
    assert isinstance(outs[gone].error, SegmentNotFound)
    assert outs[short].error is None and outs[short].output.token_ids == _solo(P3)[:1]
    assert isinstance(outs[running].error, EngineFault)
    e.check_page_accounting()


def test_an_output_that_cannot_be_decoded_fails_only_its_request(monkeypatch):
    a_ids, b_ids = _solo(P1), _solo(P2)
    marker = next(t for t in a_ids if t not in b_ids)
    e = make_engine()
    real = e.scheduler.decode

    def decode(ids, sampling=None):
        if marker in ids:
            raise IndexError("piece id is out of range")  # a slow tokenizer on a padded vocab
        return real(ids, sampling)
    monkeypatch.setattr(e.scheduler, "decode", decode)
    stop = SamplingParams(max_tokens=6, temperature=0.0, stop=["zz"])  # decodes every token
    ra = e.submit(prompt_token_ids=P1, tenant="t", sampling=stop)
    rb = e.submit(prompt_token_ids=P2, tenant="t", sampling=stop)
    done = _run(e, [ra, rb])
    assert isinstance(done[ra], IndexError)
    assert done[rb].token_ids == b_ids
    assert e.fault is None
    e.check_page_accounting()


def _failing_splices(monkeypatch, e, fails):
    """``e.runner.run_splices`` raising while ``fails(splices)``; returns its calls' count."""
    real, calls = e.runner.run_splices, {"n": 0}

    def run_splices(splices):
        calls["n"] += 1
        if fails(splices):
            raise RuntimeError("INTERNAL: copy failed")
        return real(splices)
    monkeypatch.setattr(e.runner, "run_splices", run_splices)
    return calls


def test_a_copy_on_write_lost_with_its_step_runs_again_before_its_row(monkeypatch):
    """The copy of a shared partial page is a KV chore of the plan with the request's first row;
    when that step is lost, the rows run again alone and the copy with them: same tokens."""
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A, tenant="t")  # 20 tokens: a partially filled last page
    calls = _failing_splices(monkeypatch, e, lambda splices: calls["n"] == 1)
    free = e.pool.num_free
    r1 = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t", sampling=GREEDY)
    r2 = e.submit(prompt_token_ids=P2, tenant="t", sampling=GREEDY)
    done = _run(e, [r1, r2])
    assert calls["n"] == 2  # lost with the first step, run again with r1's row alone
    assert done[r1].token_ids == _solo(P1, [SEG_A])
    assert done[r2].token_ids == _solo(P2)
    assert e.fault is None
    e.check_page_accounting()
    assert e.pool.num_free == free


def test_a_failing_copy_on_write_fails_its_request_alone_and_leaks_no_page(monkeypatch):
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A, tenant="t")
    calls = _failing_splices(monkeypatch, e, lambda splices: True)
    free = e.pool.num_free
    r1 = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t", sampling=GREEDY)
    r2 = e.submit(prompt_token_ids=P2, tenant="t", sampling=GREEDY)
    done = _run(e, [r1, r2])
    assert isinstance(done[r1], RuntimeError) and calls["n"] == 2
    assert done[r2].token_ids == _solo(P2)  # in the same steps, no chore of its own
    assert e.fault is None
    e.check_page_accounting()
    assert e.pool.num_free == free
    monkeypatch.undo()
    r3 = e.submit(prompt_token_ids=P1, segments=["a"], tenant="t", sampling=GREEDY)
    assert _run(e, [r3])[r3].token_ids == _solo(P1, [SEG_A])
