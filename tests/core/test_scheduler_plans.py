"""The scheduler's plans, with no model: a ``FakeRunner`` records every step the scheduler
dispatches and samples tokens that depend only on their position (``fake_runner.py``), so these
tests look at what runs when - the token budget, decode rows first, admission order, preemption
victims, node jobs - and at the page accounting, in milliseconds per step."""

import pytest

from tests.support.fake_runner import FakeRunner, token_at
from inferscale_jax import SamplingParams
from tests.support.tiny_engine import CFG, assert_only_nodes_hold_pages, make_engine


def fake_engine(**kw):
    e = make_engine(**kw)
    fake = FakeRunner(e.runner)  # every part that runs steps gets it (they share one runner)
    e.runner = e.kv.runner = e.tiers.runner = e.loop.runner = fake
    return e


def expected(total_len: int, n: int) -> list[int]:
    return [token_at(total_len - 1 + i, CFG.vocab_size) for i in range(n)]


def run(e, ids, limit=2000):
    got = {}
    for _ in range(limit):
        for o in e.step():
            if o.finished:
                assert o.error is None, o.error
                got[o.request_id] = o.output.token_ids
        if not e.has_unfinished():
            return got
    raise AssertionError("the engine did not finish")


def sp(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_budget_holds_decode_rows_go_first_and_outputs_are_right():
    e = fake_engine(pages=256, max_batch=8, max_num_batched_tokens=24)
    short = [[5 + i] * (3 + i) for i in range(3)]
    ids = [e.submit(prompt_token_ids=p, sampling=sp(12)) for p in short]
    e.step()
    e.step()
    ids.append(e.submit(prompt_token_ids=list(range(1, 91)), sampling=sp(5)))  # 6 chunks of <= 16
    got = run(e, ids)
    assert [got[i] for i in ids] == [expected(len(p), 12) for p in short] + [expected(90, 5)]
    steps = e.runner.steps
    assert all(sum(n for _, n, _ in s) <= 24 and len(s) <= 8 for s in steps)
    for s in steps:  # one-token decode rows lead; chunks follow
        lens = [n for _, n, _ in s]
        first_chunk = next((i for i, n in enumerate(lens) if n > 1), len(lens))
        assert all(n > 1 for n in lens[first_chunk:])
    assert sum(1 for s in steps if any(n == 1 for _, n, _ in s) and any(n > 1 for _, n, _ in s)) >= 3
    assert_only_nodes_hold_pages(e)


def test_admission_is_fifo_with_resident_requests_first():
    e = fake_engine(pages=256, max_batch=8)
    e.register_segment("x", token_ids=list(range(10, 30)))
    e.register_segment("y", token_ids=list(range(40, 60)))
    needs_node = e.submit(prompt_token_ids=[1, 2], segments=["x", "y"], sampling=sp(3))  # [x, y] is missing
    first = e.submit(prompt_token_ids=[3], segments=["x"], sampling=sp(3))  # resident
    second = e.submit(prompt_token_ids=[4], sampling=sp(3))
    e.step()
    order = [r.id for r in e.scheduler.running]
    assert order == [first, second]  # resident ones first, in their order
    assert e.scheduler.jobs and e.scheduler.requests[needs_node].status == "node"
    got = run(e, [needs_node, first, second])
    assert got[needs_node] == expected(20 + 20 + 2, 3) and got[first] == expected(21, 3)
    assert_only_nodes_hold_pages(e)


def test_preemption_takes_the_newest_request_and_outputs_do_not_change():
    e = fake_engine(pages=20, max_batch=8)  # 19 pages of 8 tokens for 4 requests growing to 6 pages
    victims = []
    real = e.scheduler._preempt

    def preempt(req):
        newest = max((r for r in e.scheduler.running), key=lambda r: r.arrival)
        victims.append(req is newest)
        real(req)
    e.scheduler._preempt = preempt
    prompts = [[i + 1] * 8 for i in range(4)]
    ids = [e.submit(prompt_token_ids=p, sampling=sp(40)) for p in prompts]
    got = run(e, ids)
    assert victims and all(victims)
    assert e.scheduler.preemptions == len(victims)
    assert [got[i] for i in ids] == [expected(8, 40)] * 4
    assert_only_nodes_hold_pages(e)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_missing_node_is_computed_once_while_others_decode(overlap):
    e = fake_engine(pages=256, max_batch=8, overlap_decode=overlap)
    e.register_segment("x", token_ids=list(range(10, 30)))  # 20 tokens
    e.register_segment("y", token_ids=list(range(40, 80)))  # 40 tokens: 3 chunks of 16
    busy = e.submit(prompt_token_ids=[7, 8], sampling=sp(30))
    e.step()
    e.step()  # `busy` decodes from here on
    a = e.submit(prompt_token_ids=[1], segments=["x", "y"], sampling=sp(4))
    b = e.submit(prompt_token_ids=[2, 3], segments=["x", "y"], sampling=sp(4))
    before = len(e.runner.steps)
    got = run(e, [busy, a, b])
    # chunk rows at y's positions after x (`busy` also decodes through positions 20..31, one token a row)
    node_rows = [(start, n) for s in e.runner.steps[before:] for start, n, _ in s if 20 <= start < 60 and n > 1]
    assert sum(n for _, n in node_rows) == 40  # y's 40 tokens after x: computed once for both requests
    beside = [s for s in e.runner.steps[before:] if any(20 <= st < 60 and n > 1 for st, n, _ in s)]
    assert all(any(n == 1 for _, n, _ in s) for s in beside)  # `busy` decoded in every one of those steps
    assert got[a] == expected(61, 4) and got[b] == expected(62, 4) and got[busy] == expected(2, 30)
    assert_only_nodes_hold_pages(e)


def test_requests_move_through_the_documented_states():
    """``request.py``'s diagram: WAITING -> RUNNING -> FINISHED, a preempted request back to
    WAITING and on to RUNNING again; every status is a ``RequestStatus`` that still reads as its
    name (the stats count by it)."""
    from inferscale_jax.request import RequestStatus
    e = fake_engine(pages=20, max_batch=8)  # (as the preemption test: the newest requests are preempted)
    ids = [e.submit(prompt_token_ids=[i + 1] * 8, sampling=sp(40)) for i in range(4)]
    reqs = {r.id: r for r in e.scheduler.waiting}
    assert set(reqs) == set(ids)
    seen = {i: [RequestStatus.WAITING] for i in ids}
    while e.has_unfinished():
        e.step()
        for i, r in reqs.items():
            assert isinstance(r.status, RequestStatus)
            if seen[i][-1] != r.status:
                seen[i].append(r.status)
    W, R, F = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED
    assert all(s[0] == W and s[-1] == F and s[-2] == R for s in seen.values()), seen
    assert any(s == [W, R, W, R, F] for s in seen.values()), seen  # (at least one preempted once)
    assert all(set(s) == {W, R, F} for s in seen.values()), seen
    assert R == "running" and str(R) == "running" and f"{W}" == "waiting"
