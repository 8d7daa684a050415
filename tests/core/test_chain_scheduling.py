"""Missing chain nodes are scheduled work: computed as prefill rows of the scheduler's normal
device steps (``Scheduler._step``, a ``NodeJob`` per missing node) while other requests
keep decoding, once for every request that needs them, with exact outputs and exact page
accounting (``scheduler.py``, 2)."""

import pytest

from inferscale_jax import PoolExhausted, RequestTooLong, SamplingParams, SegmentNotFound
from tests.support.tiny_engine import assert_only_nodes_hold_pages, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEG_A = list(range(3, 23))  # 20 tokens: a partially filled last page
SEG_B = list(range(30, 70))  # 40 tokens: three prefill chunks of 16 (tiny_engine)
SEG_C = list(range(70, 89))  # 19 tokens
P1, P2, P3 = [5, 6, 7], [8, 9, 10, 11], [12, 13]


def full_prefill(tokens, sampling=GREEDY, **kw):
    """Greedy tokens of ``tokens`` as one plain prompt (no segments) on a fresh engine."""
    return make_engine(**kw).generate(prompt_token_ids=tokens, sampling=sampling).token_ids


def spy_rows(engine):
    """Record every device step the runner launches: a list of [(start, tokens)] per step."""
    steps = []
    real = engine.runner.dispatch

    def dispatch(plan, *a, **k):
        steps.append([(r.start, list(r.tokens)) for r in plan.rows])
        return real(plan, *a, **k)
    engine.runner.dispatch = dispatch
    return steps


def node(engine, *ids, tenant="default"):
    return engine.store.node([engine.store.resolve(i, tenant) for i in ids], touch=False)


def run(engine, ids, limit=500):
    """Step until every id finished; {id: output or error}."""
    done = {}
    for _ in range(limit):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.error if out.error is not None else out.output
        engine.check_page_accounting()
        if all(i in done for i in ids):
            return done
    raise AssertionError(f"requests never finished: {set(ids) - set(done)}")


def tokens_in(steps, lo, hi):
    """How many tokens at positions [lo, hi) the recorded prefill rows computed (decode rows,
    one token each, of other requests may pass through these positions too)."""
    return sum(1 for rows in steps for start, toks in rows if len(toks) > 1
               for p in range(start, start + len(toks)) if lo <= p < hi)


def test_decodes_go_on_while_a_missing_node_is_computed():
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A)
    e.register_segment("b", token_ids=SEG_B)
    a = e.submit(prompt_token_ids=P3, sampling=LONG)
    a_tokens = []
    for _ in range(3):  # A is decoding: one token per step
        a_tokens += [t for o in e.step() if o.request_id == a for t in o.new_token_ids]
    assert a_tokens
    steps = spy_rows(e)
    b = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    node_steps = 0
    while node(e, "a", "b") is None:
        before = len(steps)
        outs = e.step()
        e.check_page_accounting()
        node_steps += 1
        mine = [o for o in outs if o.request_id == a]
        assert len(mine) == 1 and len(mine[0].new_token_ids) == 1, "A got no token: the node stalled it"
        a_tokens += mine[0].new_token_ids
        # one prefill step (the node's next chunk) and one decode step, never the whole node
        assert len(steps) - before <= 2
        assert node_steps < 20
    assert node_steps >= 3  # 40 node tokens in chunks of 16: spread over three steps
    done = run(e, [a, b])
    assert done[a].token_ids[:len(a_tokens)] == a_tokens
    assert done[b].token_ids == full_prefill(SEG_A + SEG_B + P1)
    assert done[a].token_ids == full_prefill(P3, LONG)
    assert tokens_in(steps, len(SEG_A), len(SEG_A) + len(SEG_B)) == len(SEG_B)
    assert_only_nodes_hold_pages(e)


def test_requests_needing_the_same_node_wait_for_one_job():
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A)
    e.register_segment("b", token_ids=SEG_B)
    steps = spy_rows(e)
    r1 = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    r2 = e.submit(prompt_token_ids=P2, segments=["a", "b"], sampling=GREEDY)
    e.step()
    r3 = e.submit(prompt_token_ids=P3, segments=["a", "b"], sampling=GREEDY)  # joins mid-job
    e.step()
    e.check_page_accounting()
    jobs = list(e.scheduler.jobs.values())
    assert len(jobs) == 1 and [r.id for r in jobs[0].waiters] == [r1, r2, r3]
    assert node(e, "a", "b") is None
    done = run(e, [r1, r2, r3])
    # the node's 40 tokens were computed once, not once per request
    assert tokens_in(steps, len(SEG_A), len(SEG_A) + len(SEG_B)) == len(SEG_B)
    for rid, p in ((r1, P1), (r2, P2), (r3, P3)):
        assert done[rid].token_ids == full_prefill(SEG_A + SEG_B + p)
    # the node's tokens count as computed for the request the job was created for only
    assert done[r1].metrics.cached_tokens == len(SEG_A)
    assert done[r2].metrics.cached_tokens == done[r3].metrics.cached_tokens == len(SEG_A) + len(SEG_B)
    assert node(e, "a", "b").readers == 0
    assert_only_nodes_hold_pages(e)


def test_a_three_segment_chain_computes_its_two_missing_nodes_in_turn():
    e = make_engine()
    for sid, toks in (("a", SEG_A), ("b", SEG_B), ("c", SEG_C)):
        e.register_segment(sid, token_ids=toks)
    steps = spy_rows(e)
    r = e.submit(prompt_token_ids=P2, segments=["a", "b", "c"], sampling=GREEDY)
    seen = []  # the chain length of each node job, in the order they ran
    done = {}
    for _ in range(100):
        for job in e.scheduler.jobs.values():
            if not seen or seen[-1] != len(job.chain):
                seen.append(len(job.chain))
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.error or out.output
        e.check_page_accounting()
        if r in done:
            break
    assert seen == [2, 3]
    assert done[r].token_ids == full_prefill(SEG_A + SEG_B + SEG_C + P2)
    assert node(e, "a", "b") is not None and node(e, "a", "b", "c") is not None
    end = len(SEG_A) + len(SEG_B) + len(SEG_C)
    assert tokens_in(steps, len(SEG_A), end) == len(SEG_B) + len(SEG_C)
    assert_only_nodes_hold_pages(e)


def _mid_job(e, other_sampling):
    """Segments a and b registered, a plain request and one naming [a, b] submitted, one step
    run: (plain request id, chain request id, its node job, now part-way computed)."""
    e.register_segment("a", token_ids=SEG_A)
    e.register_segment("b", token_ids=SEG_B)
    other = e.submit(prompt_token_ids=P3, sampling=other_sampling)
    r = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    e.step()
    (job,) = e.scheduler.jobs.values()
    assert job.seq is not None and job.seq.computed < len(job.seq.tokens)  # mid-job
    return other, r, job


@pytest.mark.parametrize("deleted", ["a", "b"])
def test_a_segment_deleted_while_its_node_job_runs_fails_the_request_and_caches_nothing(deleted):
    """The waiting request never ran: it fails with ``SegmentNotFound`` like any request whose
    segment was deleted before it ran; the job's pages are released, no node is cached."""
    e = make_engine()
    other, r, job = _mid_job(e, GREEDY)
    uid = e.store.resolve(deleted, "default").uid
    e.delete_segment(deleted)
    e.check_page_accounting()
    done = run(e, [r, other])
    assert isinstance(done[r], SegmentNotFound) and repr(deleted) in str(done[r])
    assert done[other].token_ids == full_prefill(P3)
    assert not e.scheduler.jobs
    assert all(uid not in n.uids for n in e.store.nodes())
    assert all(n.readers == 0 for n in e.store.nodes())
    assert_only_nodes_hold_pages(e)


def test_aborting_the_only_waiter_cancels_the_node_job():
    e = make_engine()
    other, r, job = _mid_job(e, LONG)
    free_mid = e.pool.num_free
    assert e.abort(r).finished
    assert not e.scheduler.jobs and job.seq is None
    assert e.pool.num_free > free_mid  # the job's pages came back
    assert node(e, "a", "b") is None and node(e, "a").readers == 0
    e.check_page_accounting()
    done = run(e, [other])
    assert done[other].token_ids == full_prefill(P3, LONG)
    assert_only_nodes_hold_pages(e)
    # the same chain later is computed from scratch, exactly
    r2 = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    assert run(e, [r2])[r2].token_ids == full_prefill(SEG_A + SEG_B + P1)
    assert_only_nodes_hold_pages(e)


# page counts (S = 8): pinned roots a (16 tokens, 2 pages) and b (24 tokens, 3 pages) can be
# neither evicted nor demoted; node [a, b] (40 tokens) shares a's 2 pages and needs 3 of its own
SEG_A2, SEG_B2 = list(range(3, 19)), list(range(30, 54))
PROMPT_41 = list(range(1, 42))  # 41 tokens + 7 max_tokens: 6 pages, held from admission


def test_a_node_job_without_pages_waits_while_others_run_then_proceeds():
    e = make_engine(pages=14)  # 13 usable: 5 roots + 6 for the running request leave 2 < 3 free
    e.register_segment("a", token_ids=SEG_A2, pin=True)
    e.register_segment("b", token_ids=SEG_B2, pin=True)
    a = e.submit(prompt_token_ids=PROMPT_41, sampling=SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    while not any(o.request_id == a for o in e.step()):  # A's prompt: three chunks
        pass
    assert e.pool.num_free == 2
    b = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    waited = 0
    done = {}
    while a not in done:
        outs = e.step()
        e.check_page_accounting()
        for out in outs:
            if out.finished:
                done[out.request_id] = out.error or out.output
        if a not in done:
            (job,) = e.scheduler.jobs.values()
            assert job.seq is None  # no pages yet: it waits, A goes on
            assert any(o.request_id == a for o in outs)
            waited += 1
    assert waited >= 3
    done.update(run(e, [b]))
    assert done[a].token_ids == full_prefill(PROMPT_41, SamplingParams(max_tokens=7, temperature=0.0,
                                                                       ignore_eos=True))
    assert done[b].token_ids == full_prefill(SEG_A2 + SEG_B2 + P1)
    assert node(e, "a", "b") is not None
    assert_only_nodes_hold_pages(e)


def test_a_node_job_that_can_never_get_pages_fails_its_requests_cleanly():
    e = make_engine(pages=8)  # 7 usable: the pinned roots' 5 leave 2 < 3 free, and nothing runs
    e.register_segment("a", token_ids=SEG_A2, pin=True)
    e.register_segment("b", token_ids=SEG_B2, pin=True)
    r1 = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    r2 = e.submit(prompt_token_ids=P2, segments=["a", "b"], sampling=GREEDY)
    done = run(e, [r1, r2])
    assert isinstance(done[r1], PoolExhausted) and isinstance(done[r2], PoolExhausted)
    assert not e.scheduler.jobs and node(e, "a", "b") is None
    assert node(e, "a").readers == 0 and node(e, "b").readers == 0
    assert_only_nodes_hold_pages(e)
    # the engine goes on serving what fits
    r3 = e.submit(prompt_token_ids=P3, segments=["a"], sampling=GREEDY)
    assert run(e, [r3])[r3].token_ids == full_prefill(SEG_A2 + P3)


def test_a_failing_node_job_row_fails_only_the_requests_waiting_on_it(monkeypatch):
    e = make_engine()
    e.register_segment("a", token_ids=SEG_A)
    e.register_segment("b", token_ids=SEG_B)
    real = e.runner.dispatch

    def dispatch(plan, *a, **k):  # the node job's rows (positions of b after a) are rejected
        if any(r.start >= len(SEG_A) and len(r.tokens) > 1 and r.tokens[0] in SEG_B for r in plan.rows):
            raise OverflowError("Python int too large to convert to C int")
        return real(plan, *a, **k)
    monkeypatch.setattr(e.runner, "dispatch", dispatch)
    other = e.submit(prompt_token_ids=list(range(1, 30)), sampling=GREEDY)  # prefills beside the job
    r1 = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    r2 = e.submit(prompt_token_ids=P2, segments=["a", "b"], sampling=GREEDY)
    done = run(e, [other, r1, r2])
    assert isinstance(done[r1], OverflowError) and isinstance(done[r2], OverflowError)
    assert done[other].token_ids == full_prefill(list(range(1, 30)))
    assert e.fault is None and not e.scheduler.jobs and node(e, "a", "b") is None
    assert node(e, "a").readers == 0
    assert_only_nodes_hold_pages(e)


def test_a_chain_whose_nodes_can_never_fit_the_pool_is_refused_at_submit():
    """One chain node per prefix of the chain, all resident while the request runs: a chain of
    70 one-token parts needs more pages than a 63-page pool has, so it is a RequestTooLong naming
    the pages (the server's 400), never a request retried forever on out_of_pages."""
    e = make_engine(pages=64)
    e.register_segment("t", token_ids=[42])
    with pytest.raises(RequestTooLong, match=r"chain of 70 segments needs \d+ KV pages .* holds 63 pages"):
        e.submit(prompt_token_ids=P1, segments=["t"] * 70, sampling=GREEDY)
    assert not e.scheduler.waiting and not e.scheduler.jobs
    # a chain that fits still runs, equal to the full prefill of its tokens
    r = e.submit(prompt_token_ids=P1, segments=["t"] * 5, sampling=GREEDY)
    assert run(e, [r])[r].token_ids == full_prefill([42] * 5 + P1)
    assert_only_nodes_hold_pages(e)


def test_a_node_job_whose_last_chunk_was_lost_in_a_failed_step_is_recomputed(monkeypatch):
    """An unexpected error fails the running requests (``Engine.step``); a node job's chunk in
    the lost step is computed again, so the requests waiting on the job are served, not left
    waiting on a job that believes it is done."""
    from inferscale_jax import EngineFault

    e = make_engine()
    e.register_segment("a", token_ids=SEG_A)
    e.register_segment("b", token_ids=SEG_B)
    r0 = e.submit(prompt_token_ids=P2, sampling=LONG)  # running beside the job: the failure's victim
    r1 = e.submit(prompt_token_ids=P1, segments=["a", "b"], sampling=GREEDY)
    for _ in range(50):
        e.step()
        jobs = list(e.scheduler.jobs.values())
        if jobs and jobs[0].seq is not None and jobs[0].seq.computed == len(jobs[0].seq.tokens):
            break  # the job's last chunk is dispatched, not yet read back
    else:
        raise AssertionError("the node job's last chunk was never dispatched")
    (job,) = e.scheduler.jobs.values()
    real = e.scheduler._apply_all
    monkeypatch.setattr(e.scheduler, "_apply_all", lambda *a: 1 / 0)  # reading that step back fails
    outs = e.step()
    monkeypatch.setattr(e.scheduler, "_apply_all", real)
    assert [o.request_id for o in outs] == [r0] and isinstance(outs[0].error, EngineFault)
    assert job.seq.computed < len(job.seq.tokens)  # its lost chunk will run again
    done = run(e, [r1])
    assert done[r1].token_ids == full_prefill(SEG_A + SEG_B + P1)
    e.check_page_accounting()
    assert_only_nodes_hold_pages(e)
