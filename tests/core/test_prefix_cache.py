"""PrefixCache: hash chain stability and isolation, lookup ownership, LRU eviction of
cached pages (exact page ids), and a randomized state machine against a list-based oracle.

Pool and cache calls go through ``Checked``, which runs ``cache.check_invariants``
(pool invariants + cache/pool consistency) after each call.
"""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from inferscale_jax.page_pool import PagePool
from inferscale_jax.prefix_cache import (
    PUBLIC_TENANT,
    PrefixCache,
    page_hash,
    public_root,
    root_hash,
)
from tests.support import REPO

FP = "llama-test-fp"
ACME_ROOT_HEX = "d8b6e3479d3c3873bc8d10b73341db66604b4451a6a4c9395e4abaaea19c4de7"
ACME_PAGE_HEX = "ba3389e460b7a1a8f4578ad115cf8e0d90372751ccb287547c8246f0016762e8"


class Checked:
    """Proxy that runs ``check()`` after every method call (also when it raises)."""

    def __init__(self, target, check):
        self._target, self._check = target, check

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self._check()

        return call

    def __len__(self):
        return len(self._target)


def make(num_pages: int, page_size: int = 4):
    pool = PagePool(num_pages)
    cache = PrefixCache(pool, page_size)
    cache.check_invariants()
    return Checked(pool, cache.check_invariants), Checked(cache, cache.check_invariants)


# ------------------------------------------------------------------- hashing
def test_hash_stability_hardcoded_and_independent():
    root = root_hash("acme", FP)
    assert root.hex() == ACME_ROOT_HEX
    # Independent recomputation of the documented encoding with hashlib + struct.
    lp = lambda s: struct.pack("<I", len(s.encode())) + s.encode()  # noqa: E731
    expect_root = hashlib.sha256(b"inferscale-jax/prefix-root/v1\x00" + lp("acme") + lp(FP))
    assert root == expect_root.digest()
    h = page_hash(root, (1, 2, 3, 4))
    assert h.hex() == ACME_PAGE_HEX
    assert h == hashlib.sha256(root + struct.pack("<4i", 1, 2, 3, 4)).digest()
    big = page_hash(bytes(32), [0, 1, 2**31 - 1])
    int32le = bytes.fromhex("00000000" "01000000" "ffffff7f")  # 0, 1, 2**31 - 1
    assert big == hashlib.sha256(bytes(32) + int32le).digest()


def test_hash_stable_across_processes():
    code = (
        "from inferscale_jax.prefix_cache import root_hash, page_hash;"
        f"print(page_hash(root_hash('acme', {FP!r}), (1, 2, 3, 4)).hex())"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed}, cwd=REPO,
        ).stdout.strip()
        assert out == ACME_PAGE_HEX


def test_hashes_for_chains_full_pages_only():
    _, cache = make(4, page_size=4)
    root = root_hash("acme", FP)
    toks = list(range(11))  # 2 full pages + 3 tokens
    hs = cache.hashes_for(root, toks)
    assert len(hs) == 2
    assert hs[0] == page_hash(root, toks[0:4])
    assert hs[1] == page_hash(hs[0], toks[4:8])
    assert cache.hashes_for(root, toks[:3]) == []
    # Same page content after a different prefix -> different key.
    assert cache.hashes_for(root, [9, 9, 9, 9] + toks[4:8])[1] != hs[1]


def test_root_isolation_and_validation():
    roots = {
        root_hash("acme", FP), root_hash("globex", FP), root_hash("acme", FP + "-bf16"),
        public_root(FP), root_hash("ab", "c"), root_hash("a", "bc"),
    }
    assert len(roots) == 6
    assert public_root(FP) == root_hash(PUBLIC_TENANT, FP)
    for bad in ("", None):
        with pytest.raises(ValueError, match="tenant"):
            root_hash(bad, FP)
    with pytest.raises(ValueError, match="fingerprint"):
        root_hash("acme", "")
    with pytest.raises(ValueError, match="parent_hash must be 32 bytes"):
        page_hash(b"short", (1,))
    with pytest.raises(ValueError, match="out of range"):
        page_hash(bytes(32), (-1,))
    with pytest.raises(ValueError, match="out of range"):
        page_hash(bytes(32), (2**31,))


def test_tenant_isolation_no_cross_tenant_hit():
    pool, cache = make(8)
    toks = list(range(8))
    acme = cache.hashes_for(root_hash("acme", FP), toks)
    globex = cache.hashes_for(root_hash("globex", FP), toks)
    assert not set(acme) & set(globex)
    pages = pool.allocate(2)
    assert pages == [1, 2]
    assert [cache.insert(h, p) for h, p in zip(acme, pages)] == [True, True]
    assert cache.lookup(globex) == []
    assert cache.lookup(cache.hashes_for(public_root(FP), toks)) == []
    assert cache.lookup(acme) == [1, 2]
    assert cache.stats.hit_pages == 2 and cache.stats.queries == 3


# ------------------------------------------------------ ownership and eviction
def test_lookup_longest_prefix_and_ownership():
    pool, cache = make(8)
    hs = cache.hashes_for(root_hash("acme", FP), list(range(16)))  # 4 pages
    assert pool.allocate(3) == [1, 2, 3]
    cache.insert(hs[0], 1)
    cache.insert(hs[1], 2)
    cache.insert(hs[3], 3)  # hs[2] missing: hs[3] is unreachable from the start
    assert cache.peek(hs) == [1, 2] and pool.refcount(1) == 1  # peek takes no refs
    assert cache.lookup(hs) == [1, 2]
    assert [pool.refcount(p) for p in (1, 2, 3)] == [2, 2, 1]
    assert cache.lookup(hs[2:]) == []  # a run must start with a hit
    s = cache.stats
    assert (s.queries, s.query_pages, s.hit_pages, s.hit_tokens, s.inserts) == (2, 6, 2, 8, 3)
    assert s.page_hit_rate == pytest.approx(2 / 6)
    pool.decref([2, 1])  # the lookup's references
    pool.decref([3, 2, 1])  # the writer's references
    assert pool.num_used == 0
    assert pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]


def test_freed_cached_pages_hit_and_are_evicted_only_when_reached():
    pool, cache = make(6)  # usable pages 1..5
    root = root_hash("acme", FP)
    a = cache.hashes_for(root, list(range(12)))  # request A: 3 pages
    assert pool.allocate(3) == [1, 2, 3]
    for h, p in zip(a, [1, 2, 3]):
        assert cache.insert(h, p)
    pool.decref([3, 2, 1])  # A done; reverse order: chain tail evicted first
    assert pool.free_queue() == [4, 5, 3, 2, 1] and len(cache) == 3
    # Uncached pages go first: no eviction yet.
    assert pool.allocate(2) == [4, 5] and len(cache) == 3
    # A repeated prompt hits the free cached pages: refcount 0 -> 1, out of the queue.
    assert cache.lookup(a[:2]) == [1, 2]
    assert pool.free_queue() == [3] and pool.refcount(1) == 1
    pool.decref([2, 1])
    assert pool.free_queue() == [3, 2, 1]
    # Now the queue reaches cached pages: 3 (A's tail) is evicted first.
    assert pool.allocate(1) == [3]
    assert 3 not in cache.peek(a) and cache.get(a[2]) is None and len(cache) == 2
    assert cache.lookup(a) == [1, 2]  # the root of the chain survives
    pool.decref([2, 1])
    assert pool.allocate(2) == [2, 1]
    assert len(cache) == 0 and cache.stats.evictions == 3
    assert cache.lookup(a) == []


def test_insert_duplicates_keep_first():
    pool, cache = make(6)
    hs = cache.hashes_for(root_hash("acme", FP), list(range(8)))
    assert pool.allocate(3) == [1, 2, 3]
    assert cache.insert(hs[0], 1) is True
    assert cache.insert(hs[0], 1) is True  # idempotent
    assert cache.insert(hs[0], 2) is False  # hash already maps to page 1: keep first
    assert cache.get(hs[0]) == 1 and pool.cache_key(2) is None
    with pytest.raises(ValueError, match="already cached under another hash"):
        cache.insert(hs[1], 1)
    with pytest.raises(ValueError, match="page 4 is free"):
        cache.insert(hs[1], 4)
    with pytest.raises(ValueError, match="null page"):
        cache.insert(hs[1], 0)
    with pytest.raises(ValueError, match="32 bytes"):
        cache.insert(b"x", 3)
    pool.decref([1, 2, 3])  # 2, 3 uncached -> head; 1 cached -> tail
    assert pool.free_queue() == [2, 3, 4, 5, 1]
    assert cache.stats.inserts == 1


def test_one_cache_per_pool_and_clear():
    pool, cache = make(4)
    with pytest.raises(ValueError, match="one PrefixCache per pool"):
        PrefixCache(pool._target, 4)
    with pytest.raises(ValueError, match="page_size"):
        PrefixCache(PagePool(4), 0)
    hs = cache.hashes_for(root_hash("acme", FP), list(range(8)))
    assert pool.allocate(2) == [1, 2]
    cache.insert(hs[0], 1)
    cache.insert(hs[1], 2)
    pool.decref([1])
    assert pool.free_queue() == [3, 1]
    cache.clear()
    assert len(cache) == 0 and pool.free_queue() == [1, 3]
    assert cache.lookup(hs) == []


# ---------------------------------------------------- randomized state machine
PAGE = 2
NUM_PAGES = 7  # usable 1..6: small, so evictions are frequent
_CONTENTS = [(0, 0), (0, 1), (1, 1)]


def _universe():
    """Chains of 1..3 pages over 3 page contents under 2 tenant roots."""
    hasher = PrefixCache(PagePool(2), PAGE)
    out = []
    for tenant in ("acme", "globex"):
        for a in _CONTENTS:
            for b in _CONTENTS:
                for c in _CONTENTS:
                    out.append(hasher.hashes_for(root_hash(tenant, FP), list(a + b + c)))
    return out


CHAINS = _universe()
HASHES = sorted({h for chain in CHAINS for h in chain})


class Oracle:
    """Plain-list model of the documented semantics (O(n), obviously correct)."""

    def __init__(self):
        self.free = list(range(1, NUM_PAGES))
        self.rc = dict.fromkeys(range(NUM_PAGES), 0)
        self.key: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}

    def allocate(self, n):
        if n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        for p in got:
            if p in self.key:
                del self.page_of[self.key.pop(p)]
            self.rc[p] = 1
        return got

    def decref(self, pages):
        uncached = []
        for p in pages:
            self.rc[p] -= 1
            if self.rc[p] == 0:
                (self.free.append(p) if p in self.key else uncached.append(p))
        self.free = uncached + self.free

    def lookup(self, hashes):
        got = []
        for h in hashes:
            if h not in self.page_of:
                break
            got.append(self.page_of[h])
        for p in got:
            if self.rc[p] == 0:
                self.free.remove(p)
            self.rc[p] += 1
        return got

    def insert(self, h, p):
        if h in self.page_of:
            return self.page_of[h] == p
        if p in self.key:
            return "raise"
        self.key[p], self.page_of[h] = h, p
        return True


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.raw_pool = PagePool(NUM_PAGES)
        self.raw_cache = PrefixCache(self.raw_pool, PAGE)
        self.pool = Checked(self.raw_pool, self.raw_cache.check_invariants)
        self.cache = Checked(self.raw_cache, self.raw_cache.check_invariants)
        self.oracle = Oracle()
        self.held: list[int] = []  # one entry per reference the test owns

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        referenced = {p for p in range(1, NUM_PAGES) if self.raw_pool.refcount(p) > 0}
        got = self.pool.allocate(n)
        assert got == self.oracle.allocate(n)
        if got is not None:
            assert not referenced & set(got), "allocate returned a referenced page"
            self.held += got

    @rule(pick=st.integers(0, 99), k=st.integers(1, 3))
    def release(self, pick, k):
        if not self.held:
            return
        i = pick % len(self.held)
        pages = self.held[i : i + k][::-1]  # release a run in reverse, like a request
        del self.held[i : i + k]
        self.pool.decref(pages)
        self.oracle.decref(pages)

    @rule(pick=st.integers(0, 99))
    def share(self, pick):
        if self.held:
            page = self.held[pick % len(self.held)]
            self.pool.incref([page])
            self.oracle.rc[page] += 1
            self.held.append(page)

    @rule(pick=st.integers(0, 99), h=st.sampled_from(HASHES))
    def insert(self, pick, h):
        if not self.held:
            return
        page = self.held[pick % len(self.held)]
        expect = self.oracle.insert(h, page)
        if expect == "raise":
            with pytest.raises(ValueError):
                self.cache.insert(h, page)
        else:
            assert self.cache.insert(h, page) is expect

    @rule(chain=st.sampled_from(CHAINS), n=st.integers(1, 3))
    def lookup(self, chain, n):
        got = self.cache.lookup(chain[:n])
        assert got == self.oracle.lookup(chain[:n])
        self.held += got

    @invariant()
    def matches_oracle(self):
        self.raw_cache.check_invariants()
        assert self.raw_pool.free_queue() == self.oracle.free
        assert all(self.raw_pool.refcount(p) == self.oracle.rc[p] for p in range(NUM_PAGES))
        assert all(self.raw_pool.refcount(p) == self.held.count(p) for p in range(1, NUM_PAGES))
        assert {h: self.raw_cache.get(h) for h in self.oracle.page_of} == self.oracle.page_of
        assert len(self.raw_cache) == len(self.oracle.page_of)


CacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestCacheMachine = CacheMachine.TestCase
