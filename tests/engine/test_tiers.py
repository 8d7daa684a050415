"""KV tiers on a tiny fp32 model: LRU eviction order HBM -> host -> disk -> recompute, promotion
back, pinning, and that a segment a running request reads is never evicted.  Outputs (greedy ids
and log-probs) after every demotion must equal those before it, bit for bit: the KV is copied,
never recomputed differently."""

import pytest

from inferscale_jax import PoolExhausted, SamplingParams
from tests.support.tiers_common import S, gen, make_engine, seg_tokens


def tiers_of(e, ids, tenant="default"):
    return {sid: e.segment_tier(sid, tenant) for sid in ids}


def test_lru_eviction_order_promotion_and_pinning():
    e = make_engine(pages=16, host_pages=4)  # 15 usable pages; the host tier holds one 3-page segment
    e.register_segment("p", token_ids=seg_tokens(9, 12), pin=True)  # 2 pages, oldest of all
    for i, sid in enumerate("abc"):
        e.register_segment(sid, token_ids=seg_tokens(i))  # 20 tokens: 3 pages each
    ref = {sid: gen(e, sid) for sid in "pabc"}  # LRU order of the roots now: p, a, b, c
    assert tiers_of(e, "pabc") == dict(p="hbm", a="hbm", b="hbm", c="hbm")

    # a 64-token prompt needs 8 pages, 4 are free: the two LRU unpinned roots a and b go to the
    # host; the host tier holds 4 pages (a bucket of 4 per segment), so a (older) moves on to disk
    e.generate(prompt_token_ids=seg_tokens(20, 8 * S), sampling=SamplingParams(max_tokens=1))
    assert tiers_of(e, "pabc") == dict(p="hbm", a="disk", b="host", c="hbm")
    t = e.stats()["tiers"]
    assert (t["hbm"]["evictions"], t["host"]["evictions"], t["disk"]["evictions"]) == (2, 1, 0)
    assert (t["host"]["segments"], t["host"]["pages_used"], t["disk"]["segments"]) == (1, 4, 1)
    e.check_invariants()
    compiled = e.runner.compiles

    assert gen(e, "a") == ref["a"]  # disk -> HBM
    assert gen(e, "b") == ref["b"]  # host -> HBM
    assert tiers_of(e, "ab") == dict(a="hbm", b="hbm")
    e.tiers.demote(e.store.resolve("c", "default"), "recompute")  # dropped: recomputed from tokens
    assert e.segment_tier("c") == "recompute"
    assert gen(e, "c") == ref["c"]
    assert gen(e, "p") == ref["p"] and e.segment_tier("p") == "hbm"
    assert e.runner.compiles == compiled  # promotions never force the model step to recompile
    t = e.stats()["tiers"]
    assert t["promotions"] == dict(host=1, disk=1, recompute=1)
    assert t["promotion_latency_s_mean"] > 0 and t["promotion_gbps_mean"] > 0
    with pytest.raises(ValueError, match="pinned"):
        e.tiers.demote(e.store.resolve("p", "default"), "host")
    e.check_invariants()


def test_disk_capacity_drops_lru_to_recompute_and_delete_cleans_up():
    e = make_engine(pages=32, host_pages=0, disk_pages=4)
    for i, sid in enumerate("ab"):
        e.register_segment(sid, token_ids=seg_tokens(i))
    ref = {sid: gen(e, sid) for sid in "ab"}
    for sid in "ab":
        e.tiers.demote(e.store.resolve(sid, "default"), "host")  # host holds 0 pages: on to disk
    assert tiers_of(e, "ab") == dict(a="recompute", b="disk")  # disk holds 4 pages: a dropped
    path = e.tiers._entries[e.store.resolve("b", "default").uid].path
    e.delete_segment("b")
    import os
    assert not os.path.exists(path)
    assert gen(e, "a") == ref["a"]
    e.check_invariants()
    e.close()


def test_segment_in_use_is_never_evicted():
    e = make_engine(pages=16)
    for i, sid in enumerate("ab"):
        e.register_segment(sid, token_ids=seg_tokens(i))  # 6 pages
    ref = gen(e, "a")
    gen(e, "b")  # LRU order of the roots: a, b
    # a request reading a is admitted and stays running (decoding) ...
    rid = e.submit(prompt_token_ids=[5, 6, 7], segments=["a"], sampling=SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))
    outs = e.step()
    assert e.store.root(e.store.resolve("a", "default")).readers == 1
    # ... while a 9-page segment is registered (8 pages are free): a is the LRU root but in use,
    # so b is demoted
    e.register_segment("big", token_ids=seg_tokens(5, 9 * S))
    assert tiers_of(e, ["a", "b", "big"]) == dict(a="hbm", b="host", big="hbm")
    # 13 pages: big is demoted too, then nothing is evictable: a clean PoolExhausted, a untouched
    with pytest.raises(PoolExhausted):
        e.register_segment("huge", token_ids=seg_tokens(6, 13 * S))
    assert tiers_of(e, ["a", "b", "big"]) == dict(a="hbm", b="host", big="host")
    assert [s.id for s in e.list_segments()] == ["a", "b", "big"]
    e.check_invariants()
    while e.has_unfinished():
        outs += e.step()
    final = [o.output for o in outs if o.request_id == rid and o.finished][0]
    assert (final.token_ids, final.logprobs) == ref
    assert e.store.root(e.store.resolve("a", "default")).readers == 0
    e.check_invariants()


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "delete"])
def test_damaged_disk_tier_file_is_recomputed_never_served(damage):
    """A disk-tier file flipped, truncated, extended or deleted behind the engine's back: the next
    request naming the segment gets the right output (recomputed from its tokens), the damage is
    counted as an integrity error, and deleting the segment afterwards works."""
    import os

    e = make_engine(pages=32, host_pages=0, disk_pages=64)
    e.register_segment("a", token_ids=seg_tokens(0))
    want = gen(e, "a")
    e.tiers.demote(e.store.resolve("a", "default"), "host")  # host holds 0 pages: on to disk
    assert tiers_of(e, "a") == dict(a="disk")
    path = e.tiers._entries[e.store.resolve("a", "default").uid].path
    size = os.path.getsize(path)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, size - 100)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"\0" * 8)
    else:
        os.remove(path)
    assert gen(e, "a") == want
    assert e.stats()["tiers"]["integrity_errors"]["disk"] == 1
    assert e.stats()["tiers"]["promotions"]["recompute"] == 1 and not os.path.exists(path)
    e.tiers.demote(e.store.resolve("a", "default"), "host")  # to disk again, then deleted by hand
    os.remove(e.tiers._entries[e.store.resolve("a", "default").uid].path)
    e.delete_segment("a")  # the file is already gone: no error
    e.check_invariants()
    e.close()


def test_undamaged_disk_tier_file_is_read_not_recomputed():
    e = make_engine(pages=32, host_pages=0, disk_pages=64)
    e.register_segment("a", token_ids=seg_tokens(0))
    want = gen(e, "a")
    e.tiers.demote(e.store.resolve("a", "default"), "host")
    assert gen(e, "a") == want
    t = e.stats()["tiers"]
    assert t["promotions"]["disk"] == 1 and t["promotions"]["recompute"] == 0 and t["integrity_errors"]["disk"] == 0
    e.close()


@pytest.mark.parametrize("then", ["promote", "to_disk", "snapshot"])
def test_host_tier_block_damaged_in_memory_is_recomputed_never_served(then, tmp_path):
    """A host-tier block changed in memory after its demotion: promoting it, writing it to the disk
    tier, or snapshotting it checks its checksum first; the segment's KV is then recomputed from its
    tokens (the right output), counted as a host integrity error, and never written anywhere."""
    import numpy as np

    kw = dict(snapshot_dir=str(tmp_path / "snap")) if then == "snapshot" else {}
    e = make_engine(pages=32, host_pages=64, disk_pages=64, **kw)
    e.register_segment("a", token_ids=seg_tokens(0))
    want = gen(e, "a")
    seg = e.store.resolve("a", "default")
    e.tiers.demote(seg, "host")
    entry = e.tiers._entries[seg.uid]
    damaged = np.array(entry.kv)  # the block's bytes with one flipped, in its place
    damaged.reshape(-1).view(np.uint8)[damaged.nbytes // 2] ^= 0xFF
    entry.kv = damaged
    if then == "to_disk":
        e.tiers.demote(seg, "disk")
        assert tiers_of(e, "a") == dict(a="recompute")  # not written to disk with the damage
    elif then == "snapshot":
        e.save_snapshot()
        assert tiers_of(e, "a") == dict(a="recompute")
    assert gen(e, "a") == want
    t = e.stats()["tiers"]
    assert t["integrity_errors"]["host"] == 1 and t["promotions"]["recompute"] == 1 and t["promotions"]["host"] == 0
    e.check_invariants()
    e.close()


def test_undamaged_host_tier_block_is_promoted_not_recomputed():
    e = make_engine(pages=32, host_pages=64)
    e.register_segment("a", token_ids=seg_tokens(0))
    want = gen(e, "a")
    e.tiers.demote(e.store.resolve("a", "default"), "host")
    assert gen(e, "a") == want
    t = e.stats()["tiers"]
    assert t["promotions"]["host"] == 1 and t["integrity_errors"]["host"] == 0
    e.close()
