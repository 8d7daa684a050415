"""Page accounting, tenancy and compile buckets of the engine, on a tiny deterministic model.

Page ids are asserted exactly: the pool hands out free pages head first (1, 2, 3, ...), and the
engine's allocation pattern for each request is fixed by the page arithmetic.
"""

import dataclasses

import numpy as np
import pytest

from inferscale_jax import RequestTooLong, SamplingParams, SegmentExists, SegmentNotFound
from tests.support.tiny_engine import S, make_engine

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def used_pages(engine):
    return sorted(p for p in range(1, engine.pool.num_pages) if engine.pool.refcount(p) > 0)


def test_exact_page_ids_and_refcounts():
    e = make_engine()
    e.register_segment("a", token_ids=list(range(1, 21)))  # 20 tokens: pages 1, 2, 3 (3 partial)
    assert used_pages(e) == [1, 2, 3]
    node = e.store.nodes()[0]
    assert node.pages == [1, 2, 3] and node.num_tokens == 20
    copies = []
    orig = e.runner.run_splices
    e.runner.run_splices = lambda splices: (copies.append([tuple(map(list, (sp.src, sp.dst, sp.shift)))
                                                           for sp in splices]), orig(splices))
    # 20 seg + 5 prompt + 3 generated: shares 1, 2; copies partial page 3 into a new page 4; then 5
    out = e.generate(prompt_token_ids=[5, 6, 7, 8, 9], segments=["a"], sampling=GREEDY)
    # copy-on-write of the shared partial page, exactly once: its 4 positions before the fork
    # (page 3's slots 3 * S + 0..3 -> page 4's), unrotated, with the request's first step
    assert copies == [[([3 * S + i for i in range(4)], [4 * S + i for i in range(4)], [0] * 4)]]
    assert out.metrics.cached_tokens == 20 and out.metrics.prompt_tokens == 25
    # after the request only the segment holds pages; the request's full page 4 stays cached (free)
    assert used_pages(e) == [1, 2, 3]
    assert all(e.pool.refcount(p) == 1 for p in [1, 2, 3])
    assert e.pool.cache_key(4) is not None and e.pool.is_free(4)
    e.check_invariants()
    # segment whose length is a page multiple: no copy at all
    copies.clear()
    e.register_segment("b", token_ids=list(range(30, 46)))  # 16 tokens: next free pages
    b_pages = e.store.nodes()[-1].pages
    e.generate(prompt_token_ids=[1, 2], segments=["b"], sampling=GREEDY)
    assert copies == []
    e.delete_segment("a")
    e.delete_segment("b")
    assert used_pages(e) == []
    assert e.pool.num_free == e.pool.num_pages - 1
    e.check_invariants()
    assert len(b_pages) == 2


def test_admission_reuses_a_nodes_page_hashes_and_they_equal_a_fresh_hashing():
    """A segment's page hashes are hashed once per node and root; every request over it still
    carries exactly the hashes a from-scratch hashing of its tokens gives."""
    e = make_engine()
    e.register_segment("a", token_ids=list(range(1, 4 * S + 3)))  # 4 full pages and a partial one
    node = e.store.nodes()[0]
    seqs = []
    start = e.kv.start
    e.kv.start = lambda req: (start(req), seqs.append(req.seq))[0]
    calls = []
    hashes_for = e.kv.prefix_cache.hashes_for
    e.kv.prefix_cache.hashes_for = lambda root, ids, head=(): (calls.append(len(head)), hashes_for(root, ids, head))[1]
    for prompt in ([50, 51, 52], list(range(60, 60 + 2 * S + 1)), [70]):
        e.generate(prompt_token_ids=prompt, segments=["a"], sampling=GREEDY)
    assert calls == [0, 4, 4, 4]  # the node hashed once (at the first admission), then reused
    root = e.kv.root("default")
    assert list(node.page_hashes) == [root] and len(node.page_hashes[root]) == 4
    for seq in seqs:
        fresh = hashes_for(root, seq.tokens[:len(seq.hashes) * S])
        assert seq.hashes == fresh


def test_delete_is_deferred_while_pages_are_read():
    e = make_engine()
    e.register_segment("a", token_ids=list(range(1, 18)))
    node = e.store.nodes()[0]
    e.pool.incref(node.pages)  # a running reader's references
    e.delete_segment("a")
    assert all(e.pool.refcount(p) == 1 for p in node.pages)  # still alive for the reader
    with pytest.raises(SegmentNotFound):
        e.generate(prompt_token_ids=[1], segments=["a"], sampling=GREEDY)
    e.pool.decref(node.pages)
    assert used_pages(e) == []
    e.check_invariants()


def test_chain_nodes_evicted_lru_when_pool_is_short():
    e = make_engine(pages=16)  # 15 usable pages
    e.register_segment("a", token_ids=list(range(1, 13)))  # 2 pages
    e.register_segment("b", token_ids=list(range(20, 32)))  # 2 pages
    e.generate(prompt_token_ids=[1], segments=["a", "b"], sampling=GREEDY)
    assert len(e.store.nodes()) == 3  # a, b, [a, b]
    big = list(np.random.default_rng(0).integers(1, 90, 10 * S))  # 11 pages: more than the 9 free
    e.generate(prompt_token_ids=big, sampling=dataclasses.replace(GREEDY, max_tokens=2))
    assert len(e.store.nodes()) == 2  # the chain [a, b] was evicted to make room; roots stay
    e.check_invariants()
    e.generate(prompt_token_ids=[1], segments=["a", "b"], sampling=GREEDY)  # recomputed
    assert len(e.store.nodes()) == 3


def test_tenancy():
    e = make_engine()
    e.register_segment("kb", token_ids=list(range(1, 30)), tenant="A")
    with pytest.raises(SegmentNotFound) as foreign:
        e.generate(prompt_token_ids=[3], segments=["kb"], tenant="B", sampling=GREEDY)
    with pytest.raises(SegmentNotFound) as missing:
        e.generate(prompt_token_ids=[3], segments=["nope"], tenant="B", sampling=GREEDY)
    assert str(foreign.value).replace("kb", "X") == str(missing.value).replace("nope", "X")
    with pytest.raises(SegmentNotFound):
        e.delete_segment("kb", tenant="B")
    assert [s.id for s in e.list_segments("A")] == ["kb"] and e.list_segments("B") == []
    with pytest.raises(SegmentExists):
        e.register_segment("kb", token_ids=[1, 2], tenant="A")
    e.register_segment("kb", token_ids=[1, 2], tenant="B")  # same id, other namespace: fine

    prompt = list(range(40, 40 + 3 * S + 1))
    a1 = e.generate(prompt_token_ids=prompt, tenant="A", sampling=GREEDY)
    b1 = e.generate(prompt_token_ids=prompt, tenant="B", sampling=GREEDY)
    a2 = e.generate(prompt_token_ids=prompt, tenant="A", sampling=GREEDY)
    assert a1.metrics.cached_tokens == 0 and b1.metrics.cached_tokens == 0
    assert a2.metrics.cached_tokens == 3 * S
    assert a1.token_ids == b1.token_ids == a2.token_ids

    e.register_segment("faq", token_ids=list(range(60, 75)), tenant="A", public=True)
    outs = [e.generate(prompt_token_ids=[7], segments=["faq"], tenant=t, sampling=GREEDY) for t in "ABC"]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert "faq" in [s.id for s in e.list_segments("C")]
    with pytest.raises(SegmentNotFound):
        e.delete_segment("faq", tenant="C")  # readable by all, deletable by its owner
    e.delete_segment("faq", tenant="A")
    e.check_invariants()


def test_errors_name_the_problem():
    e = make_engine(pages=8)
    with pytest.raises(RequestTooLong, match=r"600 tokens.*512"):
        e.generate(prompt_token_ids=[1] * 590, sampling=SamplingParams(max_tokens=10))
    with pytest.raises(RequestTooLong, match=r"pool holds at most 56 tokens"):
        e.generate(prompt_token_ids=[1] * 60, sampling=SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="temperature"):
        e.generate(prompt_token_ids=[1], sampling=SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"token id 97 outside \[0, 97\)"):
        e.generate(prompt_token_ids=[97])
    with pytest.raises(ValueError, match="mode"):
        e.generate(prompt_token_ids=[1], mode="fast")
    assert e.pool.num_free == e.pool.num_pages - 1  # nothing leaked by the failures


def test_no_recompiles_within_a_bucket():
    e = make_engine(pages=256)
    rng = np.random.default_rng(3)
    for n in (17, 31):  # warm-up: the bucket's shortest and longest requests
        e.generate(prompt_token_ids=list(rng.integers(1, 90, n)), sampling=GREEDY)
    warm = e.compiles
    for n in rng.integers(17, 32, 20):  # prefill chunks of 16 + (1..15) tokens; <= 8 pages
        e.generate(prompt_token_ids=list(rng.integers(1, 90, int(n))), sampling=GREEDY)
    assert e.compiles == warm, f"{e.compiles - warm} new compiles"
    assert e.stats()["compiles"] == warm


def test_sampling_seed_and_stops():
    e = make_engine()
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    a = e.generate(prompt_token_ids=[1, 2, 3], sampling=sp)
    b = e.generate(prompt_token_ids=[1, 2, 3], sampling=sp)
    c = e.generate(prompt_token_ids=[1, 2, 3], sampling=dataclasses.replace(sp, seed=8))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.token_ids != c.token_ids
    stop_at = a.token_ids[3]
    d = e.generate(prompt_token_ids=[1, 2, 3], sampling=dataclasses.replace(sp, stop_token_ids=[stop_at]))
    assert d.token_ids == a.token_ids[:a.token_ids.index(stop_at) + 1] and d.finish_reason == "stop"
    assert a.finish_reason == "length"
    lp = e.generate(prompt_token_ids=[1, 2, 3], sampling=dataclasses.replace(sp, logprobs=3))
    assert all(len(x) >= 3 and all(v <= 0 for v in x.values()) for x in lp.logprobs)
    assert all(tok in x for tok, x in zip(lp.token_ids, lp.logprobs))


def test_pallas_kernels_in_the_engine_match_the_reference_path():
    """The serving path with the Pallas kernels (interpreted on CPU) equals the jnp path."""
    outs = []
    for impl in ("ref", "pallas"):
        e = make_engine(attention_impl=impl)
        e.register_segment("a", token_ids=list(range(1, 20)))  # partial last page: copy-on-write
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
        outs.append(e.generate(prompt_token_ids=[5, 6, 7], segments=["a"], sampling=sp))
        assert e.stats()["attention_impl"] == impl
    ref, pal = outs
    assert pal.token_ids == ref.token_ids
    for a, b in zip(ref.logprobs, pal.logprobs):
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) < 1e-4


def test_an_auto_sized_pool_is_the_same_across_starts(monkeypatch):
    """hbm_pages=None on an accelerator: free memory differs by a few pages from one start to the
    next; the pool (part of every compiled step's shapes) must not, or a restart misses the
    persistent compilation cache.  Small pools are not rounded."""
    import jax

    from inferscale_jax.engine import ALLOCATOR_SLACK
    from inferscale_jax.kv_cache import page_bytes

    e = make_engine()
    per_page = page_bytes(e.cfg, e.config.page_size, e.dtype)

    class Device:
        def __init__(self, pages, in_use):
            self.free, self.in_use = (pages + 0.5) * per_page / e.config.hbm_fraction, in_use

        def memory_stats(self):
            return {"bytes_limit": self.free, "bytes_in_use": self.in_use}

    def pool(pages, in_use=0):
        monkeypatch.setattr(jax, "local_devices", lambda: [Device(pages, in_use)])
        return e._auto_pages()

    assert {pool(n) for n in (20855, 20868, 20991)} == {20480}
    assert pool(21000) == 20992 and pool(700) == 700
    # what the allocator holds beyond the weights right after the load differs from start to start
    # (run AL: 38400 then 38912 pages, every step missed the caches); up to the slack it is not counted
    # (the weights are on the CPU here, none on this device)
    slack = min(ALLOCATOR_SLACK, int(21000.5 * per_page / e.config.hbm_fraction * (1 - e.config.hbm_fraction) / 2))
    assert {pool(21000, b) for b in (0, slack // 3, slack - 1, slack)} == {20992}
    # more than that is another engine's pool in this process: the new pool leaves it its memory
    other = slack + 4096 * per_page
    assert pool(21000, other) == (int((21000.5 * per_page / e.config.hbm_fraction - other)
                                      * e.config.hbm_fraction) // per_page) // 512 * 512 < 20992
