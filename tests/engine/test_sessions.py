"""Conversation memory (``sessions.py``) and literal chain elements (``segments.literal``) in the
engine: every turn reuses all earlier turns exactly, across a restart; TTL, per-tenant cap,
tenancy; segments placed after literal tokens equal a full prefill and are computed once."""

import pytest

from inferscale_jax import SamplingParams, SegmentNotFound
from tests.persistence.test_segment_versions import full_prefill, same
from tests.support.tiers_common import make_engine
from tests.support.tiny_engine import assert_only_nodes_hold_pages

SP = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
END = 11  # the "end of turn" token our fake template writes after every message


def turn_tokens(i):
    return [20 + i, 30 + i, 40 + i, 50 + (i * 7) % 40, END]


def test_five_turn_session_reuses_every_earlier_turn_exactly_across_a_restart(tmp_path):
    d = str(tmp_path / "snap")
    e = make_engine(pages=96, snapshot_dir=d)
    conv, saved = [5, 6, 7, END], 0
    for turn in range(5):
        conv = conv + turn_tokens(turn)  # the client sends the whole conversation every turn
        out = e.generate(prompt_token_ids=conv, session="chat-1", sampling=SP)
        assert out.metrics.cached_tokens == saved  # exactly every previous turn (0 on the first)
        assert out.metrics.prompt_tokens == len(conv)
        same((out.token_ids, out.logprobs), full_prefill(conv, SP))
        conv = conv + out.token_ids + [END]
        info = e.save_session("chat-1", token_ids=conv)
        assert (info.num_tokens, info.turns) == (len(conv), turn + 1)
        saved = len(conv)
        if turn == 2:  # a restart in between keeps it (durable registry + snapshot)
            e.close()
            e = make_engine(pages=96, snapshot_dir=d)
            assert [s.id for s in e.list_sessions()] == ["chat-1"]
    assert e.list_segments() == [] and e.stats()["sessions"] == 1  # sessions are not segments
    with pytest.raises(SegmentNotFound):  # nor can a segment route or id reach one
        e.generate(prompt_token_ids=[1], segments=["~session/chat-1"], sampling=SP)
    # an edited history no longer starts with the session: served in full, correctly
    edited = [5, 6, 8] + conv[3:]
    out = e.generate(prompt_token_ids=edited, session="chat-1", sampling=SP)
    assert out.metrics.cached_tokens < len(conv)
    same((out.token_ids, out.logprobs), full_prefill(edited, SP))
    assert_only_nodes_hold_pages(e)
    e.close()


def test_session_ttl_cap_and_tenancy(monkeypatch):
    e = make_engine(pages=96, session_ttl_s=1000.0, max_sessions_per_tenant=2)
    for sid in ("a", "b", "c"):  # the third evicts the least recently saved
        e.save_session(sid, token_ids=[1, 2, 3, ord(sid) % 90])
    assert [s.id for s in e.list_sessions()] == ["b", "c"]
    assert e.list_sessions(tenant="other") == []
    with pytest.raises(SegmentNotFound):
        e.session_info("b", tenant="other")
    out = e.generate(prompt_token_ids=[1, 2, 3, ord("b") % 90, 9], session="b", tenant="other", sampling=SP)
    assert out.metrics.cached_tokens == 0  # another tenant's session is never used
    info = e.session_info("b")
    e.delete_session("b")
    with pytest.raises(SegmentNotFound):
        e.delete_session("b")
    # expiry: a session is gone once its last save is older than the TTL
    assert info.expires == info.updated + 1000.0 and [s.id for s in e.list_sessions()] == ["c"]
    later = info.updated + 1001.0
    monkeypatch.setattr(e, "now", lambda: later)
    assert e.list_sessions() == []
    assert e.stats()["sessions"] == 0
    with pytest.raises(ValueError, match="session="):
        e.save_session("bad id", token_ids=[1])
    assert_only_nodes_hold_pages(e)


def test_literal_before_a_segment_is_a_chain_node_computed_once():
    e = make_engine(pages=96)
    faq = list(range(30, 60))
    e.register_segment("faq", token_ids=faq)
    header, rest = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14]
    cached = []
    for q in (70, 71):
        out = e.generate(prompt_token_ids=rest + [q], segments=[header, "faq"], sampling=SP)
        same((out.token_ids, out.logprobs), full_prefill(header + faq + rest + [q], SP))
        cached.append(out.metrics.cached_tokens)
    assert cached == [0, len(header) + len(faq)]  # computed once, then [header + faq] reused
    # another tenant with its own "faq" of the same tokens never hits this tenant's nodes
    e.register_segment("faq", token_ids=faq, tenant="other")
    out = e.generate(prompt_token_ids=rest + [70], segments=[header, "faq"], tenant="other", sampling=SP)
    assert out.metrics.cached_tokens == 0
    # compose reads a literal's own KV like a segment's
    out = e.generate(prompt_token_ids=[70], segments=["faq", header], mode="compose", sampling=SP)
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="segments holds"):
        e.generate(prompt_token_ids=[1], segments=[[]], sampling=SP)
    assert_only_nodes_hold_pages(e)
