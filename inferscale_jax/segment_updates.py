"""Segment versions: ``update_segment`` and ``append_segment`` replace a segment's content atomically.

A new version is computed beside the old one, recorded durably, then swapped in:

1. **Compute** (``next_version``): the new token ids' KV goes into fresh pages while the old
   version stays registered and readable.  Only what changed is computed: the new tokens'
   longest common prefix with the old version is shared from the old root node (its full
   pages shared read-only, a partially filled page copied), and following full pages that the
   prefix cache holds are hits.  So an append computes exactly the appended tokens, and an
   edit near the end of a long segment recomputes only from the edit on.  For an append the
   old version is promoted back to HBM first if it was evicted; an update reuses it only when
   it is resident.
2. **Record** (``Persistence.on_updated`` -> ``Registry.replace``): the registry row takes the
   new uid, token ids and version in one fsynced SQLite transaction.  A ``kill -9`` before the
   commit leaves the old version, after it the new one, never a mix: KV in snapshots and tiers
   is keyed by uid, so the old version's snapshot KV is never restored for the new row (the
   new version is recomputed from its token ids at startup until a snapshot holds it).
3. **Swap** (``SegmentStore.replace``): new requests resolve the id to the new version from here
   on.  The old version's chain nodes (every ``[..., old, ...]`` chain) are dropped and its
   lower-tier copy forgotten; its pages are freed once the requests reading them finish, since
   every running request holds its own page references.  A request submitted before the swap
   but not yet admitted is re-resolved to the new version at admission
   (``Scheduler._check_segments``); a running one reads the old version to its end.  A node
   job for a chain with the old version is dropped and its requests re-admitted.

The prefix cache is content-addressed (token ids), so the old version's pages stay reusable
only for a prompt that spells out the old tokens itself; a request naming the segment builds
its tokens from the new version and can hit nothing but the common prefix.

Test hook: ``INFERSCALE_TEST_UPDATE_PAUSE=<stage>:<seconds>`` sleeps at ``computed`` (before
the registry commit) or ``committed`` (after it, before the swap and the acknowledgement),
first writing the stage to the file ``INFERSCALE_TEST_UPDATE_PAUSE_MARKER`` names, so a test
can ``kill -9`` an update mid-way.
"""

from __future__ import annotations

import dataclasses
import os
import time

from inferscale_jax.kv_manager import KVManager
from inferscale_jax.segments import ChainNode, Segment, SegmentInfo

PAUSE_ENV = "INFERSCALE_TEST_UPDATE_PAUSE"
PAUSE_MARKER_ENV = "INFERSCALE_TEST_UPDATE_PAUSE_MARKER"


@dataclasses.dataclass(frozen=True)
class VersionResult:
    info: SegmentInfo
    computed_tokens: int  # tokens whose KV this version computed (the rest was reused)


def _pause(stage: str) -> None:
    want = os.environ.get(PAUSE_ENV, "")
    if not want.startswith(stage + ":"):
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:  # written whole, then renamed: a test polling for it never reads it half-written
        with open(marker + ".tmp", "w") as f:
            f.write(stage)
        os.replace(marker + ".tmp", marker)
    time.sleep(float(want.split(":", 1)[1]))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def next_version(kv: KVManager, persistence, seg: Segment, token_ids: list[int], *, promote: bool,
                 now: float | None = None) -> VersionResult:
    """Compute, record and swap in ``token_ids`` as the next version of ``seg`` (module
    docstring, 1-3).  ``promote``: bring an evicted old version back to HBM to reuse its KV
    (appends).  Raises with nothing changed if the pool cannot hold the new version or the
    registry write fails."""
    store, s = kv.store, kv.config.page_size
    tokens = kv.bos_prefix + list(token_ids)
    shared = common_prefix(kv.bos_prefix + seg.token_ids, tokens)
    old = store.root(seg)
    if old is None and promote and shared > len(kv.bos_prefix):
        old = kv.promote(seg)
    view = None
    if old is not None and shared > 0:  # the old version's KV of the common prefix, read-only
        shared = min(shared, old.num_tokens)
        view = ChainNode(seg.namespace, (), shared, old.pages[:-(-shared // s)])
        old.readers += 1  # not evicted while the new version is computed over it
    try:
        seq = kv.materialize(kv.root(seg.namespace), tokens, view)
    finally:
        if view is not None:
            old.readers -= 1
    info = dataclasses.replace(seg.info, num_tokens=len(token_ids), version=seg.info.version + 1,
                               updated=time.time() if now is None else now)
    uid = store.peek_uid()
    try:
        _pause("computed")
        if persistence is not None:
            persistence.on_updated(seg, Segment(info, uid, seg.namespace, list(token_ids)))
    except BaseException:
        kv.release(seq.pages)
        raise
    _pause("committed")
    new, dead = store.replace(seg, info, token_ids, uid)
    kv.tiers.forget(seg.uid)
    for node in dead:
        kv.release_node(node)
    store.add_node(ChainNode(new.namespace, (new.uid,), len(seq.tokens), seq.pages))
    if persistence is not None:
        persistence.maybe_snapshot()
    return VersionResult(info, len(tokens) - seq.cached)
