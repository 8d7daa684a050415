"""Named segments, tenant namespaces and the chain index.

A **segment** is named context registered once (``register_segment``): its token ids and the
KV computed for them.  Segments live in a namespace: the registering tenant's, or
``PUBLIC_TENANT`` for ``public=True`` ones (readable by every tenant).  A tenant resolving an id
looks in its own namespace first, then the public one; anything else is ``SegmentNotFound``,
exactly like an id that never existed, so existence leaks nothing.

The **chain index** caches KV of segment *sequences*, radix-tree style: the node for
``[a, b]`` holds the pages of the tokens of ``a`` followed by ``b``, where ``b``'s KV was
computed conditioned on ``a`` (exact mode).  Its pages are the full pages it shares with its
parent ``[a]`` plus its own (starting with a private copy of the parent's partially filled last
page).  A node is keyed by the namespace that may read it and the *uids* of its segments (a
deleted and re-registered id gets a new uid, so stale chains are never hit).  Each node holds
one pool reference on every page it lists; running requests take references of their own,
which is what defers the release of a deleted segment's pages until its readers finish.

Registered segments are the roots (``[a]``) and live until deleted; longer chains are a cache,
released least-recently-used first when the pool needs room (never while a request reads them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
import time
from collections import OrderedDict

from inferscale_jax.errors import SegmentExists, SegmentNotFound
from inferscale_jax.prefix_cache import PUBLIC_TENANT

# segment ids: what every route can carry unescaped in a path (docs/architecture.md, "Segments")
SEGMENT_ID_ALPHABET = "A-Z a-z 0-9 . _ - : /"
SEGMENT_ID_RE = re.compile(r"[A-Za-z0-9._:/-]{1,256}")
SESSION_PREFIX = "~session/"  # sessions are segments under this id prefix (sessions.py); "~" is no id character


def check_segment_id(segment_id) -> str:
    """``segment_id`` if it is 1-256 characters of ``SEGMENT_ID_ALPHABET``, else ``ValueError``."""
    if not isinstance(segment_id, str) or SEGMENT_ID_RE.fullmatch(segment_id) is None:
        shown = repr(segment_id) if not isinstance(segment_id, str) or len(segment_id) <= 80 \
            else repr(segment_id[:80]) + "..."
        raise ValueError(f"segment_id={shown} is invalid: use 1-256 characters of {SEGMENT_ID_ALPHABET} "
                         "(no spaces, newlines or other characters)")
    return segment_id


def check_tenant(tenant) -> str:
    """``tenant`` if it is a non-empty name other than the public namespace's, else ``ValueError``."""
    if not isinstance(tenant, str) or not tenant or tenant == PUBLIC_TENANT:
        raise ValueError(f"tenant={tenant!r} is invalid: use a non-empty name other than {PUBLIC_TENANT!r}")
    return tenant


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """What ``register_segment`` and ``list_segments`` return."""
    id: str
    tenant: str
    num_tokens: int
    public: bool = False
    pin: bool = False
    created: float = 0.0
    version: int = 1  # 1 at registration, +1 per update_segment / append_segment
    updated: float = 0.0  # when this version replaced the previous one (0.0: never updated)


@dataclasses.dataclass
class Segment:
    info: SegmentInfo
    uid: int
    namespace: str  # the tenant, or PUBLIC_TENANT
    token_ids: list[int]
    lineage: int = 0  # the uid of its first version (update_segment keeps it; a new registration starts one)

    def __post_init__(self):
        self.lineage = self.lineage or self.uid


@dataclasses.dataclass
class ChainNode:
    namespace: str  # who may read it: a tenant, or PUBLIC_TENANT when every segment is public
    uids: tuple[int, ...]
    num_tokens: int  # tokens through this node (the end position of its last segment)
    pages: list[int]  # covering positions [0, num_tokens); the node holds one ref on each
    readers: int = 0  # running requests using it
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    # the prefix-cache hashes of its full pages under each hash root that read it (a tenant's, or
    # the public one), computed at the first admission over it and kept (KVManager.page_hashes)
    page_hashes: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.namespace, self.uids)

    @property
    def is_root(self) -> bool:
        """A registered segment's own node (tiers demote these; other nodes are a cache)."""
        return len(self.uids) == 1 and isinstance(self.uids[0], int)


def literal(token_ids: list[int], namespace: str) -> Segment:
    """A run of literal tokens as a chain element (e.g. a chat template's text before a segment
    placed in a message: ``serving/chat.py``).  Not registered: its uid is ``("lit", digest)`` of
    its tokens, so chain nodes over ``[literal, segment, ...]`` are keyed by the tokens that
    precede the segment, and it is always live.  Its own node ``[literal]`` is computed when
    first needed and is a cache like any chain node."""
    ids = [int(t) for t in token_ids]
    digest = hashlib.sha256(b"inferscale-literal/v1" + struct.pack(f"<{len(ids)}i", *ids)).hexdigest()
    info = SegmentInfo(id=f"<{len(ids)} literal tokens>", tenant=namespace, num_tokens=len(ids))
    return Segment(info=info, uid=("lit", digest), namespace=namespace, token_ids=ids)


def is_literal(seg: Segment) -> bool:
    return isinstance(seg.uid, tuple)


class SegmentStore:
    def __init__(self):
        self._segments: dict[tuple[str, str], Segment] = {}  # (namespace, id) -> segment
        self._nodes: OrderedDict[tuple, ChainNode] = OrderedDict()  # LRU order: oldest first
        self._next_uid = 1

    # -- segments -------------------------------------------------------------------------
    def check_new(self, segment_id: str, tenant: str, public: bool) -> str:
        ns = PUBLIC_TENANT if public else tenant
        if (ns, segment_id) in self._segments:
            where = "public segments" if public else f"tenant {tenant!r}"
            raise SegmentExists(
                f"segment {segment_id!r} already exists in {where}; delete it first or choose another id")
        return ns

    def add(self, info: SegmentInfo, token_ids: list[int]) -> Segment:
        ns = self.check_new(info.id, info.tenant, info.public)
        seg = Segment(info=info, uid=self._next_uid, namespace=ns, token_ids=list(token_ids))
        self._next_uid += 1
        self._segments[(ns, info.id)] = seg
        return seg

    def get(self, namespace: str, internal_id: str) -> Segment | None:
        """The segment (or session: ``sessions.py``) stored under exactly this key."""
        return self._segments.get((namespace, internal_id))

    def resolve(self, segment_id: str, tenant: str) -> Segment:
        seg = self._segments.get((tenant, segment_id)) or self._segments.get((PUBLIC_TENANT, segment_id))
        if seg is None or segment_id.startswith(SESSION_PREFIX):
            raise SegmentNotFound(
                f"segment {segment_id!r} not found; list your segments with list_segments() / GET /v1/segments")
        return seg

    def replace(self, old: Segment, info: SegmentInfo, token_ids: list[int], uid: int | None = None
                ) -> tuple[Segment, list[ChainNode]]:
        """A new version of ``old`` (same namespace and id) under a new uid; returns it and the
        chain nodes that contained ``old`` (the caller releases their pages).  Requests holding
        ``old`` see it as no longer live (``is_live``): the scheduler re-resolves the ones not
        yet running (``current``), running ones keep their own page references to the end."""
        assert self.is_live(old), "replacing a segment that is not live"
        dead = self.remove(old)
        uid = self._next_uid if uid is None else uid
        self._next_uid = max(self._next_uid, uid + 1)
        seg = Segment(info=info, uid=uid, namespace=old.namespace, token_ids=list(token_ids), lineage=old.lineage)
        self._segments[(old.namespace, info.id)] = seg
        return seg, dead

    def peek_uid(self) -> int:
        """The uid the next ``add`` / ``replace`` hands out."""
        return self._next_uid

    def current(self, seg: Segment) -> Segment | None:
        """The live version of ``seg`` (``seg`` itself unless it was updated; ``None`` once
        deleted, even if the id was registered again: that is another segment)."""
        cur = self._segments.get((seg.namespace, seg.info.id))
        return cur if cur is not None and cur.lineage == seg.lineage else None

    def is_live(self, seg: Segment) -> bool:
        """Whether ``seg`` is still registered (not deleted, nor replaced by a new version); a
        literal always is."""
        return is_literal(seg) or self._segments.get((seg.namespace, seg.info.id)) is seg

    def owned(self, segment_id: str, tenant: str) -> Segment:
        """A segment the tenant may delete: its own, or a public one it registered."""
        seg = self._segments.get((tenant, segment_id))
        if seg is None:
            pub = self._segments.get((PUBLIC_TENANT, segment_id))
            if pub is not None and pub.info.tenant == tenant:
                seg = pub
        if seg is None or segment_id.startswith(SESSION_PREFIX):
            raise SegmentNotFound(f"segment {segment_id!r} not found for this tenant")
        return seg

    def remove(self, seg: Segment) -> list[ChainNode]:
        """Forget ``seg``; return the chain nodes that contain it (the caller releases their pages)."""
        del self._segments[(seg.namespace, seg.info.id)]
        dead = [n for n in self._nodes.values() if seg.uid in n.uids]
        for n in dead:
            del self._nodes[n.key]
        return dead

    def visible(self, tenant: str) -> list[SegmentInfo]:
        return [s.info for (ns, sid), s in sorted(self._segments.items())
                if (ns == tenant or ns == PUBLIC_TENANT) and not sid.startswith(SESSION_PREFIX)]

    def __len__(self) -> int:
        return len(self._segments)

    def all_segments(self) -> list[Segment]:
        return list(self._segments.values())

    # -- chain index ----------------------------------------------------------------------
    @staticmethod
    def chain_namespace(chain: list[Segment]) -> str:
        owners = {s.namespace for s in chain if s.namespace != PUBLIC_TENANT}
        assert len(owners) <= 1, "a chain mixes segments of several tenants"
        return owners.pop() if owners else PUBLIC_TENANT

    def node(self, chain: list[Segment], touch: bool = True) -> ChainNode | None:
        key = (self.chain_namespace(chain), tuple(s.uid for s in chain))
        node = self._nodes.get(key)
        if node is not None and touch:
            node.last_used = time.monotonic()
            self._nodes.move_to_end(key)
        return node

    def add_node(self, node: ChainNode) -> None:
        assert node.key not in self._nodes
        self._nodes[node.key] = node

    def evictable_nodes(self) -> list[ChainNode]:
        """Chain nodes (not registered roots: literal ones too) no request reads, least recently used first."""
        return [n for n in self._nodes.values() if not n.is_root and n.readers == 0]

    def drop_node(self, node: ChainNode) -> None:
        del self._nodes[node.key]

    def nodes(self) -> list[ChainNode]:
        return list(self._nodes.values())

    # -- tiers and persistence (tiers.py, snapshot.py) ------------------------------------
    def restore(self, info: SegmentInfo, token_ids: list[int], uid: int) -> Segment:
        """Re-add a segment from the durable registry under its recorded uid."""
        ns = self.check_new(info.id, info.tenant, info.public)
        seg = Segment(info=info, uid=uid, namespace=ns, token_ids=list(token_ids))
        self._segments[(ns, info.id)] = seg
        self._next_uid = max(self._next_uid, uid + 1)
        return seg

    def reserve_uids(self, next_uid: int) -> None:
        """Never hand out a uid below ``next_uid`` (uids recorded durably are not reused)."""
        self._next_uid = max(self._next_uid, next_uid)

    def root(self, seg: Segment) -> ChainNode | None:
        """The segment's own node if its KV is in HBM (no LRU update)."""
        return self._nodes.get((seg.namespace, (seg.uid,)))

    def evictable_roots(self) -> list[ChainNode]:
        """Registered roots no request reads and not pinned, least recently used first."""
        pinned = {s.uid for s in self._segments.values() if s.info.pin}
        return [n for n in self._nodes.values() if n.is_root and n.readers == 0 and n.uids[0] not in pinned]
