"""PagePool: exact page ids, all-or-nothing allocation, refcounts, free-queue order.

Every pool operation goes through ``Checked``, which runs ``check_invariants`` after it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale_jax.page_pool import NULL_PAGE, PagePool


class Checked:
    """Proxy that calls ``check()`` (default: the target's check_invariants) after
    every method call, including calls that raise."""

    def __init__(self, target, check=None):
        self._target = target
        self._check = check or target.check_invariants

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


def make_pool(num_pages: int) -> Checked:
    pool = PagePool(num_pages)
    pool.check_invariants()
    return Checked(pool)


def test_initial_state_and_null_page():
    pool = make_pool(5)
    assert pool.num_pages == 5
    assert pool.num_free == 4 and pool.num_used == 0
    assert pool.free_queue() == [1, 2, 3, 4]
    assert pool.refcount(NULL_PAGE) == 0 and not pool.is_free(NULL_PAGE)
    for op in (pool.incref, pool.decref, pool.touch):
        with pytest.raises(ValueError, match="null page"):
            op([NULL_PAGE])


@pytest.mark.parametrize("bad", [0, 1, -3, 2.0, None])
def test_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(bad)


def test_allocation_order_exact_ids():
    pool = make_pool(8)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [4, 5]
    assert pool.allocate(2) == [6, 7]
    assert pool.num_free == 0 and pool.num_used == 7
    assert [pool.refcount(p) for p in range(1, 8)] == [1] * 7


def test_all_or_nothing_returns_none_and_changes_nothing():
    pool = make_pool(5)
    assert pool.allocate(3) == [1, 2, 3]
    before = (pool.free_queue(), [pool.refcount(p) for p in range(5)])
    assert pool.allocate(2) is None
    assert (pool.free_queue(), [pool.refcount(p) for p in range(5)]) == before
    assert pool.allocate(1) == [4]
    assert pool.allocate(1) is None
    with pytest.raises(ValueError, match="n must be"):
        pool.allocate(-1)


def test_refcounts_back_to_zero():
    pool = make_pool(4)
    pages = pool.allocate(2)
    assert pages == [1, 2]
    pool.incref([1, 1, 2])
    assert (pool.refcount(1), pool.refcount(2)) == (3, 2)
    pool.decref([1, 2])
    assert (pool.refcount(1), pool.refcount(2)) == (2, 1)
    assert pool.num_used == 2
    pool.decref([2, 1, 1])
    assert (pool.refcount(1), pool.refcount(2)) == (0, 0)
    assert pool.num_used == 0 and pool.num_free == 3
    # Page 2 then page 1 came back uncached: they go to the head in the given order.
    assert pool.free_queue() == [2, 1, 3]


def test_decref_below_zero_raises_and_changes_nothing():
    pool = make_pool(4)
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(ValueError, match="refcount 1 but is being released 2"):
        pool.decref([2, 1, 1])  # validated as a whole: page 2 must not be freed
    assert (pool.refcount(1), pool.refcount(2)) == (1, 1)
    assert pool.free_queue() == [3]
    with pytest.raises(ValueError, match="refcount 0"):
        pool.decref([3])
    with pytest.raises(ValueError, match="out of range"):
        pool.decref([4])


def test_incref_and_touch_of_free_uncached_page_raise():
    pool = make_pool(4)
    with pytest.raises(ValueError, match="incref: page 1 is free"):
        pool.incref([1])
    with pytest.raises(ValueError, match="touch: page 2 is free and not cached"):
        pool.touch([2])
    assert pool.free_queue() == [1, 2, 3]


def test_uncached_pages_are_reused_first_in_given_order():
    pool = make_pool(7)
    assert pool.allocate(4) == [1, 2, 3, 4]
    pool.decref([3, 1])
    assert pool.free_queue() == [3, 1, 5, 6]
    assert pool.allocate(3) == [3, 1, 5]


def test_cached_pages_freed_to_tail_lru_order_and_evicted_with_callback():
    pool = make_pool(7)
    evicted = []
    pool._target.on_evict = lambda page, key: evicted.append((page, key))
    assert pool.allocate(4) == [1, 2, 3, 4]
    pool.set_cache_key(2, b"k2")
    pool.set_cache_key(1, b"k1")
    pool.set_cache_key(4, b"k4")
    pool.decref([4, 2])  # cached: tail, in release order
    pool.decref([1])  # cached, released later
    pool.decref([3])  # uncached: head
    assert pool.free_queue() == [3, 5, 6, 4, 2, 1]
    assert pool.allocate(3) == [3, 5, 6] and evicted == []
    # Reviving a free cached page takes it out of the queue without eviction.
    pool.touch([2])
    assert pool.refcount(2) == 1 and pool.free_queue() == [4, 1]
    assert pool.allocate(1) == [4]
    assert evicted == [(4, b"k4")] and pool.cache_key(4) is None
    pool.decref([2])  # 2 is still cached: goes behind 1
    assert pool.free_queue() == [1, 2]
    assert pool.allocate(2) == [1, 2]
    assert evicted == [(4, b"k4"), (1, b"k1"), (2, b"k2")]


def test_set_and_clear_cache_key():
    pool = make_pool(5)
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(ValueError, match="page 3 is free"):
        pool.set_cache_key(3, b"x")
    pool.set_cache_key(1, b"a")
    with pytest.raises(ValueError, match="already cached"):
        pool.set_cache_key(1, b"b")
    pool.decref([1, 2])
    assert pool.free_queue() == [2, 3, 4, 1]
    pool.clear_cache_key(1)  # no longer worth keeping: moves to the head
    assert pool.free_queue() == [1, 2, 3, 4] and pool.cache_key(1) is None


def test_numpy_page_ids_accepted():
    pool = make_pool(4)
    pages = np.asarray(pool.allocate(2), dtype=np.int32)  # [2]
    pool.incref(pages)
    pool.decref(pages)
    pool.decref(pages)
    assert pool.free_queue() == [1, 2, 3]


def test_check_invariants_detects_corruption():
    pool = PagePool(4)
    pool.allocate(1)
    pool._free[1] = None  # page 1 both referenced and free
    with pytest.raises(AssertionError, match="free queue with refcount 1"):
        pool.check_invariants()
    pool = PagePool(4)
    pool._free.popitem(last=False)  # page 1 leaked
    with pytest.raises(AssertionError, match="neither free nor referenced"):
        pool.check_invariants()


@settings(max_examples=300, deadline=None)
@given(
    num_pages=st.integers(2, 10),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "share"]), st.integers(0, 6), st.integers(0, 99)
        ),
        max_size=60,
    ),
)
def test_random_ops_keep_invariants(num_pages, ops):
    pool = make_pool(num_pages)
    held: list[int] = []  # one entry per reference the test owns
    for op, n, pick in ops:
        if op == "alloc":
            free_before = pool.num_free
            refs_before = [pool.refcount(p) for p in range(num_pages)]
            got = pool.allocate(n)
            if n > free_before:
                assert got is None and pool.num_free == free_before
                continue
            assert len(got) == n == len(set(got)) and NULL_PAGE not in got
            assert all(refs_before[p] == 0 for p in got), "allocated a referenced page"
            held += got
        elif held and op == "free":
            pool.decref([held.pop(pick % len(held))])
        elif held and op == "share":
            page = held[pick % len(held)]
            pool.incref([page])
            held.append(page)
        assert pool.num_used == len(set(held))
        assert all(pool.refcount(p) == held.count(p) for p in range(1, num_pages))
    pool.decref(held)
    assert pool.num_used == 0 and pool.num_free == num_pages - 1
