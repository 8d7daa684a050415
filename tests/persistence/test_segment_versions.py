"""Segment versions (``segment_updates.py``): update while requests read the old version, append
computing only the new tokens, and a ``kill -9`` in the middle of an update (``tiers_child.py``)."""

import time

import numpy as np
import pytest

from inferscale_jax import SamplingParams, SegmentNotFound
from tests.persistence.test_persistence import Child, same_generation
from tests.support.tiers_common import PROMPT, SP, gen, make_engine, seg_tokens
from tests.support.tiny_engine import assert_only_nodes_hold_pages

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def full_prefill(tokens, sampling=GREEDY):
    """The reference: the whole sequence computed from nothing (no segments, no prefix cache)."""
    ref = make_engine(prefix_caching=False)
    out = ref.generate(prompt_token_ids=tokens, sampling=sampling)
    return out.token_ids, out.logprobs


def same(got, want, tol=1e-4):
    (ids, lps), (want_ids, want_lps) = got, want
    assert ids == want_ids
    for a, b in zip(lps, want_lps):
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) <= tol


def test_update_while_requests_read_the_old_version():
    e = make_engine(pages=96)
    old, new, other = seg_tokens(1, 37), seg_tokens(2, 29), seg_tokens(3, 11)
    info = e.register_segment("doc", token_ids=old)
    e.register_segment("other", token_ids=other)
    assert info.version == 1
    questions = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    chains = [["doc"] if i % 2 else ["doc", "other"] for i in range(8)]
    long = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    readers = [e.submit(prompt_token_ids=q, segments=c, sampling=long) for q, c in zip(questions, chains)]
    outs = {}
    while len(e.scheduler.running) < 8:
        for o in e.step():  # admit all 8 (the [doc, other] chain node is computed for them)
            assert not o.finished
    old_uid = e.store.resolve("doc", "default").uid
    assert any(old_uid in n.uids and len(n.uids) == 2 for n in e.store.nodes())
    queued = e.submit(prompt_token_ids=questions[0], segments=["doc"], sampling=GREEDY)  # not admitted yet

    info = e.update_segment("doc", token_ids=new)
    assert (info.version, info.num_tokens) == (2, len(new)) and info.updated >= info.created
    assert all(old_uid not in n.uids for n in e.store.nodes())  # the old chain nodes are gone
    assert [s.version for s in e.list_segments() if s.id == "doc"] == [2]
    fresh = [e.submit(prompt_token_ids=q, segments=c, sampling=GREEDY) for q, c in zip(questions, chains)]
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                assert o.error is None, o.error
                outs[o.request_id] = (o.output.token_ids, o.output.logprobs)

    seg_text = {"doc": None, "other": other}
    for rid, q, c in zip(readers, questions, chains):  # exactly the old output
        same(outs[rid], full_prefill([t for s in c for t in (seg_text[s] or old)] + q, long))
    for rid, q, c in zip(fresh, questions, chains):  # exactly the new output
        same(outs[rid], full_prefill([t for s in c for t in (seg_text[s] or new)] + q))
    same(outs[queued], full_prefill(new + questions[0]))  # re-resolved at admission: the new version
    assert_only_nodes_hold_pages(e)  # no page leaked: the old version's pages went with its readers
    e.check_page_accounting()
    assert e.stats()["segment_tokens_computed"] == len(old) + len(other) + len(new)


def test_update_reuses_the_common_prefix_and_delete_races_fail_only_their_request():
    e = make_engine()
    base = seg_tokens(4, 40)
    e.register_segment("doc", token_ids=base)
    before = e.stats()["segment_tokens_computed"]
    edited = base[:30] + [3, 4, 5]  # an edit at token 30: only from the last shared page on is new
    e.update_segment("doc", token_ids=edited)
    assert e.stats()["segment_tokens_computed"] - before == len(edited) - 30
    same(gen(e, "doc"), full_prefill(edited + PROMPT, SP), tol=1e-4)
    waiting = e.submit(prompt_token_ids=PROMPT, segments=["doc"], sampling=SP)
    e.delete_segment("doc")
    outs = [o for _ in range(3) for o in e.step() if o.finished]
    assert [o.request_id for o in outs] == [waiting] and isinstance(outs[0].error, SegmentNotFound)
    with pytest.raises(SegmentNotFound):
        e.update_segment("doc", token_ids=[1, 2])
    e.register_segment("x", token_ids=[1])
    with pytest.raises(ValueError, match="exactly one of text= or token_ids="):
        e.update_segment("x")
    with pytest.raises(ValueError, match="empty"):
        e.append_segment("x", token_ids=[])
    with pytest.raises(SegmentNotFound):  # another tenant's segment is a missing one
        e.update_segment("x", token_ids=[1], tenant="other")
    assert_only_nodes_hold_pages(e)


@pytest.mark.parametrize("keep", [29, 24])
def test_an_update_to_a_prefix_of_the_old_version_computes_nothing_and_equals_full_prefill(keep):
    """The new version is the old one cut short: all of its KV is the old version's, no token is
    computed, and a cut inside a page copies that page's kept positions (a KV chore with no step
    to carry it, so it runs at once)."""
    e = make_engine()
    base = seg_tokens(4, 40)
    e.register_segment("doc", token_ids=base)
    before = e.stats()["segment_tokens_computed"]
    e.update_segment("doc", token_ids=base[:keep])
    assert e.stats()["segment_tokens_computed"] == before
    same(gen(e, "doc"), full_prefill(base[:keep] + PROMPT, SP), tol=1e-4)
    assert_only_nodes_hold_pages(e)


@pytest.mark.parametrize("seg_len,add", [(13, 6), (16, 20), (5, 1)])
def test_append_equals_register_of_the_concatenation_and_computes_only_the_new_tokens(seg_len, add):
    rng = np.random.default_rng(seg_len)
    first, more = rng.integers(1, 96, seg_len).tolist(), rng.integers(1, 96, add).tolist()
    e = make_engine()
    e.register_segment("log", token_ids=first)
    e.register_segment("tail", token_ids=[9, 8, 7])
    e.generate(prompt_token_ids=PROMPT, segments=["log", "tail"], sampling=SP)  # an old [log, tail] node
    before = e.stats()["segment_tokens_computed"]
    info = e.append_segment("log", token_ids=more)
    assert e.stats()["segment_tokens_computed"] - before == add  # only the appended tokens
    assert (info.version, info.num_tokens) == (2, seg_len + add)

    ref = make_engine()
    ref.register_segment("log", token_ids=first + more)
    ref.register_segment("tail", token_ids=[9, 8, 7])
    for chain in (["log"], ["log", "tail"]):
        got = e.generate(prompt_token_ids=PROMPT, segments=chain, sampling=GREEDY)
        want = ref.generate(prompt_token_ids=PROMPT, segments=chain, sampling=GREEDY)
        same((got.token_ids, got.logprobs), (want.token_ids, want.logprobs))
    e.append_segment("log", token_ids=[4])  # appending again: version 3
    assert e.list_segments()[0].version == 3
    assert_only_nodes_hold_pages(e)


def test_append_to_a_segment_evicted_to_host_promotes_it_first():
    e = make_engine(pages=12)
    e.register_segment("a", token_ids=seg_tokens(5, 30))
    e.register_segment("b", token_ids=seg_tokens(6, 30))
    e.register_segment("c", token_ids=seg_tokens(7, 30))  # the pool holds 11 pages: "a" went to host
    assert e.segment_tier("a") == "host"
    before = e.stats()["segment_tokens_computed"]
    e.append_segment("a", token_ids=[1, 2, 3])
    assert e.stats()["segment_tokens_computed"] - before == 3
    same(gen(e, "a"), full_prefill(seg_tokens(5, 30) + [1, 2, 3] + PROMPT, SP))
    e.check_invariants()


@pytest.mark.parametrize("stage,version", [("computed", 1), ("committed", 2)])
def test_kill_in_the_middle_of_an_update(tmp_path, stage, version):
    d = tmp_path / "snap"
    child = Child(d, f"mid_update:{stage}", tmp_path / "child.log")
    try:
        child.wait_for("updating")
        marker = tmp_path / "update-paused"
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.proc.poll() is None, open(tmp_path / "child.log").read()[-3000:]
            assert time.monotonic() < deadline, "the update never paused"
            time.sleep(0.02)
        assert marker.read_text() == stage
    finally:
        if child.proc.poll() is None:
            child.kill()
    e = make_engine(snapshot_dir=str(d))
    (info,) = e.list_segments("t")
    assert info.version == version
    want = seg_tokens(0) if version == 1 else seg_tokens(9, 27)
    assert e.store.resolve("s0", "t").token_ids == want  # the old or the new version, never a mix
    same(gen(e, "s0", tenant="t"), full_prefill(want + PROMPT, SP))
    if version == 1:
        same_generation(gen(e, "s0", tenant="t"), child.generations()["s0"])
    e.close()
