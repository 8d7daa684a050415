"""Automatic prefix caching of full KV pages, keyed by a per-tenant hash chain.

Every full page of every prompt is cached, so a repeated prompt or a chat history that
grows turn by turn re-encodes only its new pages. This module is host-side bookkeeping
(hash -> page id); the KV itself lives in the device pool managed by ``PagePool``.

Hash chain
==========

A page's KV depends on its own tokens *and on every token before it*, so a page is keyed
by a chain::

    root    = root_hash(tenant, fingerprint)
    h[0]    = page_hash(root,     tokens[0 : S])
    h[i]    = page_hash(h[i - 1], tokens[i*S : (i+1)*S])

with ``S = page_size``. Two sequences share ``h[i]`` only if they agree on all tokens up
to the end of page ``i`` (up to a SHA-256 collision). Only full pages are hashed; a
partially filled last page is never cached (it is still being written).

- ``page_hash`` is SHA-256 over the 32-byte parent digest followed by the token ids as
  little-endian int32. The parent has a fixed length, so the encoding is unambiguous.
  Python's ``hash()`` is never used: it is salted per process and not collision
  resistant, and these keys must be stable across processes, tiers and snapshots.
- ``root_hash`` seeds the chain with the **tenant** and the **model fingerprint**
  (config + weights digest + dtype + page size). Identical tokens under two tenants
  therefore give unrelated keys, so no tenant can ever hit (or probe by timing) KV that
  another tenant computed; and KV from another model, dtype or page size can never be
  mistaken for this one's, even when restored from disk. Both strings are
  length-prefixed under a domain tag, so ``("ab", "c")`` and ``("a", "bc")`` differ.
- Public segments are the one sanctioned sharing: they hash under the reserved tenant
  ``PUBLIC_TENANT`` (``public_root``). The serving layer must refuse to map an API key
  to that name.

Ownership
=========

- ``lookup(hashes)`` returns the longest run of cached pages from the start of
  ``hashes`` and gives the **caller one reference on each returned page** (``touch``):
  a page that was free-but-cached leaves the free queue, so no later ``allocate`` can
  evict it. The caller must ``pool.decref`` every returned page when the request ends.
  ``peek`` answers the same question without taking references (for admission checks;
  the answer is only valid until the next ``allocate``).
- ``insert(hash, page)`` registers a full page the caller owns (refcount > 0) and has
  finished writing. The cache holds **no reference** of its own: when the last owner
  releases the page it stays in the pool's free queue, still cached, and is forgotten
  only when ``allocate`` pops it (the pool calls back ``_on_evict``).
- Duplicates follow vLLM and keep the first mapping: inserting a hash that already
  maps to another page changes nothing and returns ``False`` (the caller's page stays
  uncached and is recycled first once released). Inserting a page that is already
  registered under a *different* hash raises: a page holds exactly one chain's KV.

The engine caps a request's hits so that at least the last prompt token is recomputed
(the model needs its logits); that is a policy of the caller, not of this cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import struct
from collections.abc import Sequence

from inferscale_jax.page_pool import PagePool

HASH_BYTES = 32  # SHA-256 digest size
PUBLIC_TENANT = "__public__"
_ROOT_TAG = b"inferscale-jax/prefix-root/v1\x00"
_INT32_MAX = 2**31 - 1


def _lp(s: str, field: str) -> bytes:
    if not isinstance(s, str) or not s:
        raise ValueError(f"{field} must be a non-empty str; got {s!r}")
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def root_hash(tenant: str, fingerprint: str) -> bytes:
    """Chain seed for ``tenant`` under the model ``fingerprint`` (32 bytes)."""
    payload = _ROOT_TAG + _lp(tenant, "tenant") + _lp(fingerprint, "fingerprint")
    return hashlib.sha256(payload).digest()


def public_root(fingerprint: str) -> bytes:
    """Chain seed shared by all tenants, for public segments only."""
    return root_hash(PUBLIC_TENANT, fingerprint)


def page_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256(parent_hash || token_ids as little-endian int32), 32 bytes."""
    if not isinstance(parent_hash, bytes) or len(parent_hash) != HASH_BYTES:
        raise ValueError(
            f"parent_hash must be {HASH_BYTES} bytes (a root_hash or page_hash digest); "
            f"got {parent_hash!r:.80}"
        )
    ids = [operator.index(t) for t in token_ids]
    for t in ids:
        if not 0 <= t <= _INT32_MAX:
            raise ValueError(f"token id {t} out of range [0, {_INT32_MAX}]")
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(ids)}i", *ids)).digest()


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # lookup() calls
    query_pages: int = 0  # full pages asked for by lookup()
    hit_pages: int = 0  # pages returned by lookup()
    hit_tokens: int = 0  # hit_pages * page_size
    inserts: int = 0  # new hash -> page mappings
    evictions: int = 0  # mappings dropped because the pool reused the page

    @property
    def page_hit_rate(self) -> float:
        return self.hit_pages / self.query_pages if self.query_pages else 0.0


class PrefixCache:
    """Maps page-chain hashes to pool pages; see the module docstring for semantics."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1; got {page_size!r}")
        if pool.on_evict is not None:
            raise ValueError(
                "this PagePool already has an eviction callback (another PrefixCache?); "
                "use one PrefixCache per pool."
            )
        self.pool = pool
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._stats = PrefixCacheStats()
        pool.on_evict = self._on_evict

    # ------------------------------------------------------------------ hashing
    def hashes_for(self, root: bytes, token_ids: Sequence[int], head: Sequence[bytes] = ()) -> list[bytes]:
        """One chained hash per FULL page of ``token_ids`` (a trailing partial page is
        not hashed): ``len(result) == len(token_ids) // page_size``.  ``head``: the hashes of
        the first pages, already known (they are taken as they are; hashing goes on after them)."""
        S = self.page_size
        out: list[bytes] = list(head)
        parent = out[-1] if out else root
        for i in range(len(out), len(token_ids) // S):
            parent = page_hash(parent, token_ids[i * S : (i + 1) * S])
            out.append(parent)
        return out

    # ------------------------------------------------------------------ queries
    def peek(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest cached run from the start of ``hashes``; takes NO references."""
        pages: list[int] = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest cached run from the start of ``hashes``; the caller receives one
        reference on each returned page and must ``pool.decref`` them when done."""
        pages = self.peek(hashes)
        self.pool.touch(pages)
        st = self._stats
        st.queries += 1
        st.query_pages += len(hashes)
        st.hit_pages += len(pages)
        st.hit_tokens += len(pages) * self.page_size
        return pages

    def get(self, h: bytes) -> int | None:
        """Page cached under ``h`` (no reference taken), or None."""
        return self._page_of.get(h)

    def __contains__(self, h: object) -> bool:
        return h in self._page_of

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def stats(self) -> PrefixCacheStats:
        """A copy of the counters."""
        return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ updates
    def insert(self, h: bytes, page: int) -> bool:
        """Register full page ``page`` (owned by the caller, fully written) under ``h``.

        Returns True if ``h`` now maps to ``page`` (new, or already so), False if ``h``
        already maps to a different page (first mapping kept; nothing changes).
        Raises ValueError if ``page`` is free, is the null page, or is already cached
        under a different hash.
        """
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"hash must be {HASH_BYTES} bytes from hashes_for(); got {h!r:.80}")
        existing_key = self.pool.cache_key(page)  # validates the page id
        existing_page = self._page_of.get(h)
        if existing_page is not None:
            return existing_page == page  # keep the first mapping
        if existing_key is not None:
            raise ValueError(
                f"insert: page {page} is already cached under another hash; a page holds "
                f"one chain's KV. Allocate a new page for different content."
            )
        self.pool.set_cache_key(page, h)  # raises if the caller does not own the page
        self._page_of[h] = page
        self._stats.inserts += 1
        return True

    def clear(self) -> None:
        """Forget every mapping (e.g. after the device pool was reinitialised).
        Referenced pages stay referenced; free ones become plain free pages."""
        for page in self._page_of.values():
            self.pool.clear_cache_key(page)
        self._page_of.clear()

    def _on_evict(self, page: int, key: bytes) -> None:
        mapped = self._page_of.pop(key, None)
        if mapped != page:
            raise AssertionError(
                f"PrefixCache out of sync with pool: evicted page {page} under a key that "
                f"maps to {mapped}"
            )
        self._stats.evictions += 1

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Pool invariants plus: the hash -> page map and the pool's per-page keys
        describe the same bijection."""
        self.pool.check_invariants()
        for h, page in self._page_of.items():
            if self.pool.cache_key(page) != h:
                raise AssertionError(
                    f"PrefixCache invariant violated: hash maps to page {page} but the "
                    f"pool's key for it differs"
                )
        keyed = sum(
            self.pool.cache_key(p) is not None for p in range(1, self.pool.num_pages)
        )
        if keyed != len(self._page_of):
            raise AssertionError(
                f"PrefixCache invariant violated: pool has {keyed} keyed pages, cache maps "
                f"{len(self._page_of)}"
            )
