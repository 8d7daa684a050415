"""Host-side page allocator for the HBM KV pool (after vLLM v1 ``BlockPool``).

The KV cache on the device is one array of ``num_pages`` fixed-size pages; this module
decides, on the host, which page ids are in use. It holds no arrays and imports no JAX.

Design
======

1. **Page 0 is the null page.** Padded page-table entries point at it. It is never
   allocated, never freed, never referenced and never in the free queue; ``incref`` /
   ``decref`` / ``touch`` on it raise. Usable pages are ``1 .. num_pages - 1``.

2. **Refcounts.** Every usable page is in exactly one of two states:

   - *referenced*: ``refcount > 0``, owned by one or more requests (shared pages are
     read-only; copy-on-write is the engine's job), not in the free queue;
   - *free*: ``refcount == 0`` and in the free queue.

   ``allocate`` moves pages free -> referenced (refcount 1); ``incref`` shares an
   already referenced page; ``decref`` releases one reference and, at 0, returns the page
   to the free queue; ``touch`` is ``incref`` that may also revive a *free but cached*
   page (a prefix-cache hit on a page nobody is using).

3. **The free queue** is an ``OrderedDict`` used as an O(1) doubly linked list:
   pop the head, append at the tail, insert at the head, remove from the middle.
   Allocation pops from the head. A page freed by ``decref`` goes

   - to the **tail** if it carries a cache key (its KV is a registered prefix page worth
     keeping: it is reused last, i.e. evicted in LRU order of release);
   - to the **head** if it carries none (its content is worthless: reuse it first).

   So the queue is always ``[uncached pages ...][cached pages, least recently freed
   first ...]`` and a cached page is evicted only when no uncached free page is left.
   This refines vLLM, which appends every freed block to the tail, so there a
   partially filled (uncached) block can outlive a cached one. As in vLLM, callers that
   release a request's whole chain should pass its pages in *reverse* order, so the
   chain's tail (the least shareable pages) is evicted before its root.

4. **Eviction.** Free cached pages stay in the cache and can be revived by ``touch``.
   When ``allocate`` pops a page that still carries a cache key, the pool clears the key
   and calls ``on_evict(page, key)`` (set by the ``PrefixCache``) so the cache forgets
   that page before it is handed out and overwritten.

5. **Never fail silently** (STYLE 5). ``allocate`` is all-or-nothing: when fewer than
   ``n`` pages are free it returns ``None`` and changes nothing (the scheduler then waits
   or preempts). Invalid calls (unknown page, null page, refcount below zero, touching a
   free page whose content is not cached) raise ``ValueError`` before mutating anything.

``check_invariants()`` verifies all of the above in O(num_pages); tests call it after
every operation. The pool is not thread-safe: the engine loop owns it.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

NULL_PAGE = 0

EvictCallback = Callable[[int, bytes], None]


class PagePool:
    """Refcounted pool of page ids ``1 .. num_pages - 1`` with an LRU free queue."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(
                f"num_pages must be an int >= 2 (page 0 is the reserved null page); got "
                f"{num_pages!r}. Give the pool at least one usable page."
            )
        self._num_pages = num_pages
        self._refcount: list[int] = [0] * num_pages
        self._cache_key: list[bytes | None] = [None] * num_pages
        # Keys are page ids; values unused. Head = next to allocate.
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._num_used = 0
        self.on_evict: EvictCallback | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_pages(self) -> int:
        """Total pages including the null page."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages that ``allocate`` can hand out now (includes free-but-cached pages)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with ``refcount > 0``."""
        return self._num_used

    def refcount(self, page: int) -> int:
        page = self._page(page, allow_null=True)
        return self._refcount[page]

    def cache_key(self, page: int) -> bytes | None:
        """The prefix-cache key the page's content is registered under, if any."""
        page = self._page(page, allow_null=True)
        return self._cache_key[page]

    def is_free(self, page: int) -> bool:
        page = self._page(page, allow_null=True)
        return page in self._free

    def free_queue(self) -> list[int]:
        """Snapshot of the free queue, head (next allocated) first. O(num_free)."""
        return list(self._free)

    # --------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages from the head of the free queue, each with refcount 1.

        Returns ``None`` and changes nothing when fewer than ``n`` pages are free.
        A popped page that still carries a cache key is evicted: its key is cleared and
        ``on_evict(page, key)`` is called before the page is returned.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate(n): n must be an int >= 0; got {n!r}")
        if n > len(self._free):
            return None
        pages: list[int] = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            key = self._cache_key[page]
            if key is not None:
                self._cache_key[page] = None
                if self.on_evict is not None:
                    self.on_evict(page, key)
            self._refcount[page] = 1
            pages.append(page)
        self._num_used += n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (repeats count twice). Each must be referenced:
        a free page's content is not owned by anyone (use ``touch`` for cache hits)."""
        pages = self._pages(pages)
        refs = self._refcount
        for page in pages if 0 in map(refs.__getitem__, pages) else ():
            if refs[page] == 0:
                raise ValueError(
                    f"incref: page {page} is free (refcount 0); only referenced pages can "
                    f"be shared. Use allocate() for new pages or touch() for cached ones."
                )
        for page in pages:
            self._refcount[page] += 1

    def touch(self, pages: Iterable[int]) -> None:
        """Add one reference to each page, reviving free pages that carry a cache key
        (they leave the free queue, refcount 0 -> 1). Used on prefix-cache hits.
        Touching a free page without a cache key raises: its content is garbage."""
        pages = self._pages(pages)
        for page in pages:
            if self._refcount[page] == 0 and self._cache_key[page] is None:
                raise ValueError(
                    f"touch: page {page} is free and not cached, so its KV is stale; "
                    f"allocate() a page and compute it instead."
                )
        for page in pages:
            if self._refcount[page] == 0:
                del self._free[page]
                self._num_used += 1
            self._refcount[page] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page (repeats count twice). Pages reaching 0 are
        freed: cached ones to the tail of the free queue in the given order, uncached
        ones to the head in the given order. Raises, changing nothing, if any refcount
        would go below zero. Pass a request's chain in reverse order (see module doc)."""
        pages = self._pages(pages)
        refs = self._refcount
        # (distinct pages all referenced: nothing to check one by one)
        distinct_ok = len(set(pages)) == len(pages) and 0 not in map(refs.__getitem__, pages)
        for page, count in () if distinct_ok else Counter(pages).items():
            if self._refcount[page] < count:
                raise ValueError(
                    f"decref: page {page} has refcount {self._refcount[page]} but is being "
                    f"released {count} time(s); a caller released a page it did not own."
                )
        uncached: list[int] = []
        for page in pages:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._num_used -= 1
                if self._cache_key[page] is None:
                    uncached.append(page)
                else:
                    self._free[page] = None  # tail
        for page in reversed(uncached):
            self._free[page] = None
            self._free.move_to_end(page, last=False)  # head, keeping the given order

    # ------------------------------------------------------- cache-key plumbing
    def set_cache_key(self, page: int, key: bytes) -> None:
        """Mark a referenced page as holding the cached content ``key`` (PrefixCache use)."""
        page = self._page(page)
        if self._refcount[page] == 0:
            raise ValueError(
                f"set_cache_key: page {page} is free; only a page the caller owns (and has "
                f"fully written) can be registered in the cache."
            )
        if self._cache_key[page] is not None:
            raise ValueError(f"set_cache_key: page {page} is already cached under another key")
        self._cache_key[page] = key

    def clear_cache_key(self, page: int) -> None:
        """Forget a page's cache key without calling ``on_evict`` (the caller is the
        cache). A free page is moved to the queue head, where uncached pages belong."""
        page = self._page(page)
        self._cache_key[page] = None
        if page in self._free:
            self._free.move_to_end(page, last=False)

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent. O(num_pages)."""

        def fail(msg: str) -> None:
            raise AssertionError(f"PagePool invariant violated: {msg}")

        if len(self._refcount) != self._num_pages or len(self._cache_key) != self._num_pages:
            fail("per-page arrays have the wrong length")
        if self._refcount[NULL_PAGE] != 0 or NULL_PAGE in self._free:
            fail("null page 0 is referenced or free")
        if self._cache_key[NULL_PAGE] is not None:
            fail("null page 0 carries a cache key")
        used = 0
        for page in range(1, self._num_pages):
            rc = self._refcount[page]
            if rc < 0:
                fail(f"page {page} has negative refcount {rc}")
            in_free = page in self._free
            if in_free and rc > 0:
                fail(f"page {page} is in the free queue with refcount {rc}")
            if not in_free and rc == 0:
                fail(f"page {page} is neither free nor referenced (leaked)")
            used += rc > 0
        if used != self._num_used:
            fail(f"num_used {self._num_used} != counted {used}")
        if used + len(self._free) != self._num_pages - 1:
            fail(f"used {used} + free {len(self._free)} != {self._num_pages - 1} usable pages")
        seen_cached = False
        for page in self._free:
            if not 0 < page < self._num_pages:
                fail(f"free queue holds invalid page id {page}")
            cached = self._cache_key[page] is not None
            if seen_cached and not cached:
                fail(f"uncached free page {page} queued behind a cached page")
            seen_cached |= cached

    # ----------------------------------------------------------------- helpers
    def _pages(self, pages: Iterable[int]) -> list[int]:
        """``_page`` of each id; plain in-range ints (a request's page list) are checked in one
        pass in C, the rest one by one (a chain node's 256 pages per admission add up)."""
        pages = list(pages)
        if pages and set(map(type, pages)) == {int} and min(pages) >= 1 and max(pages) < self._num_pages:
            return pages
        return [self._page(p) for p in pages]

    def _page(self, page: int, allow_null: bool = False) -> int:
        """Validate a page id (ints and numpy integers accepted) and return it as int."""
        if isinstance(page, bool):
            raise ValueError(f"page id must be an int; got {page!r}")
        try:
            page = operator.index(page)
        except TypeError:
            raise ValueError(f"page id must be an int; got {page!r}") from None
        lo = 0 if allow_null else 1
        if not lo <= page < self._num_pages:
            if page == NULL_PAGE:
                raise ValueError(
                    "page 0 is the reserved null page; it is never referenced or freed"
                )
            raise ValueError(f"page id {page} out of range [1, {self._num_pages - 1}]")
        return page

    def __repr__(self) -> str:
        return (
            f"PagePool(num_pages={self._num_pages}, used={self._num_used}, "
            f"free={len(self._free)})"
        )
