"""The scheduler alone: it plans steps over a page pool and applies results made here by hand -
no model, no runner, no device step (``scheduler.py``: ``schedule`` / ``dispatched`` / ``update``
/ ``rollback``).  The engine-core loop that hands its plans to a runner is ``step_loop.py``; the
page manager below gets only a small page pool's arrays (its tiers read their shapes)."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from inferscale_jax import EngineConfig, SamplingParams
from inferscale_jax import scheduler as scheduler_mod
from inferscale_jax.kv_cache import PagedKVCache
from inferscale_jax.kv_manager import KVManager
from inferscale_jax.page_tables import PageTables
from inferscale_jax.request import Request, RequestStatus
from inferscale_jax.runner import StepResult
from inferscale_jax.scheduler import SETTLE, Scheduler
from inferscale_jax.segments import ChainNode, SegmentInfo
from tests.support.tiny_engine import CFG, S


def make(pages=32, max_batch=4, max_tokens=64, token_buckets=()):
    config = EngineConfig(dtype="float32", page_size=S, hbm_pages=pages, prefill_chunk=16)
    arrays = SimpleNamespace(cache=PagedKVCache.create(CFG, pages, S, jnp.float32))
    arrays.place = lambda sharding: None  # (the tiers commit the pool to its device: nothing to do here)
    kv = KVManager(config, CFG, arrays, jnp.float32, num_pages=pages, fingerprint="seam", bos_prefix=[])
    kv.debug_checks = True  # page accounting checked at every update
    counters = dict(requests=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0, segment_tokens_computed=0)
    sched = Scheduler(kv, PageTables(max_batch, 16), config=config, cfg=CFG, max_batch=max_batch,
                      max_tokens=max_tokens, decode=lambda ids, sp: " ".join(map(str, ids)), counters=counters,
                      token_buckets=token_buckets)
    assert not hasattr(sched, "runner")
    return sched


def add(sched, rid, prompt_len, max_tokens, first=1):
    req = Request(rid, "t", list(range(first, first + prompt_len)), [],
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), "exact",
                  np.zeros(2, np.uint32), float(len(sched.requests)))
    sched.add(req)
    return req


def result(step, tokens):
    """A read-back step made by hand: ``tokens[i]`` sampled for row i."""
    n = len(step.entries)
    assert len(tokens) == n
    return StepResult(np.asarray(tokens, np.int32), np.zeros(n, np.float32), np.zeros((n, 0), np.int32),
                      np.zeros((n, 0), np.float32))


def rows(step):
    return [(list(r.tokens), r.start) for r in step.plan.rows]


def test_a_request_is_planned_chunk_by_chunk_then_decoded_and_released():
    sched = make()
    free0 = sched.kv.pool.num_free
    req = add(sched, "a", 20, max_tokens=3)
    assert sched.admit() == [] and req.status == RequestStatus.RUNNING
    assert len(req.seq.pages) == 3 and req.prefill_end == 20

    a = sched.schedule(None)  # the first chunk: prefill_chunk tokens, no sample
    assert rows(a) == [(list(range(1, 17)), 0)] and a.decode_rows == 0 and a.tokens == 16
    assert [samples for _, _, samples in a.entries] == [False] and a.plan.src is None
    sched.dispatched(a)
    assert req.seq.computed == 16
    assert sched.update(a, result(a, [99])) == []  # (a chunk that samples nothing: its id is ignored)

    b = sched.schedule(None)  # the rest of the prompt samples the first token
    assert rows(b) == [(list(range(17, 21)), 16)] and b.entries[0][2]
    sched.dispatched(b)
    [out] = sched.update(b, result(b, [42]))
    assert out.new_token_ids == [42] and not out.finished and req.ttft_s is not None

    c = sched.schedule(None)  # a decode row: the sampled token at its position, a page-table slot
    assert rows(c) == [([42], 20)] and c.decode_rows == 1 and req.slot >= 0
    assert c.plan.rows[0].slot == req.slot and sched.tables.free == 3  # (the runner writes the row as it packs)
    sched.dispatched(c)
    assert sched.update(c, result(c, [43]))[0].new_token_ids == [43]

    d = sched.schedule(None)
    assert rows(d) == [([43], 21)]
    sched.dispatched(d)
    [last] = sched.update(d, result(d, [44]))
    assert last.finished and last.output.token_ids == [42, 43, 44] and last.output.finish_reason == "length"
    assert last.output.text == "42 43 44" and req.status == RequestStatus.FINISHED
    assert not sched.running and not sched.has_unfinished() and sched.tables.free == 4
    assert sched.steps == 4 and sched.step_tokens == 16 + 4 + 1 + 1 and sched.step_decode_rows == 2
    assert sched.counters["generated_tokens"] == 3 and sched.counters["prompt_tokens"] == 20
    # its pages are free again (its two full ones kept in the prefix cache, evictable)
    assert sched.kv.pool.num_free == free0 and len(sched.kv.prefix_cache) == 2
    assert sched.schedule(None) is None


def test_a_token_in_flight_is_fed_on_the_device_and_applied_in_order():
    sched = make()
    req = add(sched, "a", 8, max_tokens=4)
    sched.admit()
    a = sched.schedule(None)
    sched.dispatched(a)  # in flight: it samples the first token
    b = sched.schedule(a)  # planned before `a` is read: the request feeds a's sample
    assert rows(b) == [([0], 8)] and b.plan.src == [0] and b.plan.rows[0].sample_step == 1
    sched.dispatched(b)
    assert req.seq.computed == 9
    assert sched.update(a, result(a, [7]))[0].new_token_ids == [7]
    assert sched.update(b, result(b, [8]))[0].new_token_ids == [8]
    assert req.seq.tokens == list(range(1, 9)) + [7, 8] and req.out_ids == [7, 8]


def test_a_token_known_to_be_the_last_gets_no_row():
    sched = make()
    add(sched, "a", 8, max_tokens=1)
    sched.admit()
    a = sched.schedule(None)
    sched.dispatched(a)
    assert sched.schedule(a) is None  # max_tokens is reached by the in-flight token: nothing to feed
    [out] = sched.update(a, result(a, [5]))
    assert out.finished and out.output.token_ids == [5]


def test_a_lost_step_is_rolled_back_and_its_rows_rerun_alone():
    sched = make()
    req = add(sched, "a", 20, max_tokens=4)
    sched.admit()
    a = sched.schedule(None)
    sched.dispatched(a)
    b = sched.schedule(a)  # the prompt's rest, planned while `a` is in flight
    assert rows(b) == [(list(range(17, 21)), 16)]
    sched.dispatched(b)
    assert req.seq.computed == 20
    sched.rollback(a, b)  # neither result will be read: back to the first row's start
    assert req.seq.computed == 0
    owners, alone = sched.rows_alone()
    assert owners == [req] and [(list(r.tokens), r.start) for r in alone] == [(list(range(1, 17)), 0)]
    assert sched.apply_alone([(req, alone[0], None)]) == [] and req.seq.computed == 16


def test_a_preemption_waits_for_the_step_in_flight_then_takes_the_newest():
    sched = make(pages=3)  # two usable pages: one per 8-token prompt, none for the next token
    old, new = add(sched, "old", 8, 4), add(sched, "new", 8, 4, first=20)
    sched.admit()
    a = sched.schedule(None)
    assert rows(a) == [(list(range(1, 9)), 0), (list(range(20, 28)), 0)]
    sched.dispatched(a)
    assert sched.schedule(a) is SETTLE  # both need a page and a preemption needs settled requests
    outs = sched.update(a, result(a, [5, 6]))
    assert [o.new_token_ids for o in outs] == [[5], [6]]
    b = sched.schedule(None)  # the newest is preempted; the oldest decodes in its page
    assert rows(b) == [([5], 8)] and b.entries[0][0] is old
    assert new.status == RequestStatus.WAITING and new.seq is None and sched.preemptions == 1
    assert new.out_ids == [6]  # (kept: recomputed from its prompt and output when re-admitted)


def test_a_copy_on_write_rides_with_the_first_row_and_comes_back_with_a_rollback():
    """KV chores are plan fields: the copy of a node's partially filled last page is carried by
    the plan holding the request's first row (the runner runs it before the step), taken off at
    dispatch (the prompt's next chunk, planned while the first is in flight, must not copy again
    over the tokens computed there), and given back when those steps are rolled back."""
    sched = make()
    kv = sched.kv
    seg = kv.store.add(SegmentInfo("doc", "t", 20), list(range(100, 120)))
    node = ChainNode("t", (seg.uid,), 20, kv.allocate(-(-20 // S)))  # (made by hand: its KV is never read here)
    kv.store.add_node(node)
    req = Request("a", "t", seg.token_ids + list(range(1, 21)), [seg],
                  SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "exact", np.zeros(2, np.uint32), 0.0)
    sched.add(req)
    sched.admit()
    seq = req.seq
    k, off = divmod(20, S)  # the fork: the node's page k holds its last `off` positions
    assert off and seq.pages[:k] == node.pages[:k] and seq.pages[k] != node.pages[k] and seq.computed == 20
    a = sched.schedule(None)  # the first chunk, from the fork
    assert rows(a)[0][1] == 20
    [sp] = a.plan.splices
    assert sp.src.tolist() == [node.pages[k] * S + i for i in range(off)]
    assert sp.dst.tolist() == [seq.pages[k] * S + i for i in range(off)] and sp.shift.tolist() == [0] * off
    sched.dispatched(a)
    assert seq.splices == []
    b = sched.schedule(a)  # the next chunk, planned while `a` is in flight: no chore
    assert rows(b)[0][1] == 36 and b.plan.splices == []
    sched.dispatched(b)
    sched.rollback(a, b)  # both lost: the first row runs again, and its chore before it
    assert seq.computed == 20 and seq.splices == a.plan.splices
    owners, alone = sched.rows_alone()
    assert owners == [req] and alone[0].start == 20


def _decoding(sched, n, first=1):
    """``n`` requests admitted, prefilled (prompts of 4) and decoding: their first tokens applied."""
    for k in range(n):
        add(sched, f"d{k}", 4, max_tokens=50, first=first)
    sched.admit()
    a = sched.schedule(None)
    sched.dispatched(a)
    assert len(sched.update(a, result(a, [5] * n))) == n


def test_a_step_that_would_just_overflow_a_token_bucket_fills_the_one_below(monkeypatch):
    """Above ``ROUND_DOWN_MIN_TOKENS`` a step whose decode rows and prefill chunks would land just
    past a token bucket takes only the chunk tokens that fill the bucket below (no padding to the
    next one); the rest of the chunk comes in the next step, from where it stopped."""
    monkeypatch.setattr(scheduler_mod, "ROUND_DOWN_MIN_TOKENS", 16)  # (the real one is 256: a small model here)
    sched = make(pages=64, max_batch=8, token_buckets=(8, 16, 32, 64))
    _decoding(sched, 3)
    q1, q2 = add(sched, "q1", 10, max_tokens=2, first=20), add(sched, "q2", 10, max_tokens=2, first=40)
    sched.admit()
    b = sched.schedule(None)  # 3 decode rows + 10 + 10 = 23 tokens: the 16 bucket, filled
    assert b.decode_rows == 3 and b.tokens == 16
    assert rows(b)[3:] == [(list(range(20, 30)), 0), (list(range(40, 43)), 0)]
    sched.dispatched(b)
    sched.update(b, result(b, [6] * 5))
    c = sched.schedule(None)  # 4 decode rows and q2's other 7 tokens: 11, under the threshold
    assert c.decode_rows == 4 and rows(c)[4:] == [(list(range(43, 50)), 3)]
    assert q1.status == q2.status == RequestStatus.RUNNING and q2.seq.computed == 3


def test_the_budget_is_not_rounded_down_below_the_threshold_or_when_it_would_leave_more():
    """Under ``ROUND_DOWN_MIN_TOKENS`` (a C = 1 question's step: padding is about free there) a
    step takes every chunk token it can; so it does above, when filling the bucket below would keep
    fewer chunk tokens than it leaves (a question would crawl a few tokens a step)."""
    sched = make(pages=64, max_batch=8, token_buckets=(8, 16, 32, 64))
    _decoding(sched, 3)
    add(sched, "q1", 10, max_tokens=2, first=20), add(sched, "q2", 10, max_tokens=2, first=40)
    sched.admit()
    b = sched.schedule(None)  # the default threshold (256): the whole 23 tokens, padded to 32
    assert b.tokens == 23

    def work(*lengths):  # node jobs' chunks (a node job's tokens are all prefill)
        return [SimpleNamespace(seq=SimpleNamespace(tokens=[0] * n, computed=0)) for n in lengths]

    wide = make(pages=64, max_batch=64, token_buckets=(8, 16, 32, 64))  # (rows to spare: only the tokens count)
    wide.round_down = 16
    assert wide._token_budget(3, work(10, 10)) == 13  # 23 -> 16: keeps 13, leaves 7
    assert wide._token_budget(14, work(16, 16)) == 18  # 46 -> 32: keeps 18, leaves 14
    assert wide._token_budget(28, work(16, 6)) == 64 - 28  # 32 would keep 4 and leave 18: all of it (50 -> 64)
    assert wide._token_budget(20, work(3)) == 64 - 20  # 16 holds fewer than the decode rows: all of it
    assert wide._token_budget(16, work(16)) == 64 - 16  # 32: a bucket already
    assert wide._token_budget(3, work(16, 16, 16, 16)) == 64 - 3  # more than the budget: all of it
    assert wide._token_budget(2, work(5)) == 64 - 2  # 7: under the threshold
    narrow = make(pages=64, max_batch=5, token_buckets=(8, 16, 32, 64))
    narrow.round_down = 16
    assert narrow._token_budget(3, work(10, 10, 10)) == 13  # two rows left: 23 -> 16 (all three: 33 -> 32, 29)
    assert narrow._token_budget(5, work(10)) == 64 - 5  # no row left: nothing to round
    wide.round_down = 0
    assert wide._token_budget(3, work(10, 10)) == 64 - 3  # 0: off
    wide.round_down, wide.token_buckets = 16, ()
    assert wide._token_budget(3, work(10, 10)) == 64 - 3  # no buckets: never rounded


def test_the_round_down_switch_is_read_from_the_environment(monkeypatch):
    assert make().round_down == scheduler_mod.ROUND_DOWN_MIN_TOKENS == 256
    monkeypatch.setenv("INFERSCALE_ROUND_DOWN_MIN_TOKENS", "0")
    assert make().round_down == 0
    for bad in ("-1", "half", "\u0662"):  # (a non-ASCII digit too)
        monkeypatch.setenv("INFERSCALE_ROUND_DOWN_MIN_TOKENS", bad)
        with pytest.raises(ValueError, match="INFERSCALE_ROUND_DOWN_MIN_TOKENS=.* is invalid: must be a token count"):
            make()
