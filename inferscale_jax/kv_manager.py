"""Page ownership of sequences and chain nodes: admission's chain walk, page preparation,
prefix-cache registration, allocation with eviction, and computing KV into pages.

The ``KVManager`` is the one object that changes who holds which page.  Its collaborators are
plain parts, none of which points back at it or at the engine: the page pool (refcounts),
the prefix cache, the segment store (segments and chain nodes), the tiers below HBM
(``tiers.py``: host, disk, recompute) and the runner (the copy, splice and step kernels).
The engine (segments, submit), the scheduler (admission, node jobs, decode pages) and
persistence (restore) hold it; it holds none of them.

What a request's pages go through (the scheduler, ``scheduler.py``, decides *when*):

1. **Chain** (``start`` -> ``walk_chain``, at admission): walk the chain index for ``[s1]``,
   ``[s1, s2]``, ... (``segments.py``), taking a reader on each node found.  A segment evicted
   to host or disk is promoted back first (``tiers.py``).  At the first missing node
   ``[s1..si]`` the walk stops and ``start`` returns it with its parent: the scheduler computes
   it as a *node job* inside its normal device steps, once for every request that needs it.
   The job's pages come from ``node_seq`` (the parent's full pages shared, its partially
   filled last page copied, ``si``'s tokens at their real positions over that context); when
   its last chunk is computed ``add_node`` caches it (unless one of its segments was deleted
   meanwhile: then its pages are released).  compose / blend take the segments' own nodes
   instead (``_start_composed``, ``blend.py``).
2. **Prepare** (``prepare``): share the final node's pages, look up the prompt's following
   full pages in the prefix cache (hash chain seeded with the tenant and the model
   fingerprint), allocate the rest, and note the copy-on-write of a partially filled shared
   page (its positions before the fork) as a KV chore of the sequence (``Seq.splices``; compose
   notes its splices there too): the plan with the sequence's first row carries it and the
   runner runs it before that step (``runner.StepPlan.splices``).  At least the last token is
   always computed (its logits give the first output token).
3. **Compute**: every page that fills is registered in the prefix cache
   (``register_full_pages``).  When pages run short (``allocate``): chain nodes are evicted,
   then unused segments demoted to host; the scheduler preempts the newest request after that.
4. **Release**: the holder's page references are dropped (full pages stay in the prefix cache,
   reusable until the pool needs them).

Shared pages are never written: a request or node job writes only pages it allocated
(including its private copy of a shared partial page).  Registered segments are computed
synchronously (``materialize``), as is a root segment brought back from the recompute tier.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from inferscale_jax.blend import blend
from inferscale_jax.config import EngineConfig
from inferscale_jax.errors import PoolExhausted
from inferscale_jax.page_pool import PagePool
from inferscale_jax.prefix_cache import PrefixCache, page_hash, root_hash
from inferscale_jax.runner import ModelRunner, Splice, StepResult, StepRow, page_copy
from inferscale_jax.segments import ChainNode, Segment, SegmentStore, is_literal
from inferscale_jax.tiers import Tiers
from models import ModelConfig

if TYPE_CHECKING:
    from inferscale_jax.request import Request


@dataclasses.dataclass
class Seq:
    """A sequence whose KV lives in pages the holder owns one reference on each of."""
    root: bytes
    tokens: list[int]
    pages: list[int]
    hashes: list[bytes]  # hash of each full page of ``tokens`` (extended as pages fill)
    first_own: int  # pages below this index were borrowed (shared node pages / prefix hits)
    computed: int  # tokens whose KV is in pages
    cached: int  # tokens whose KV was reused rather than computed
    cacheable: bool = True  # False for compose/blend: approximate KV never enters the prefix cache
    # cascade decode: the leading read-only pages it shares (a chain node's full pages, else its
    # prefix-cache hits) as a tuple, and that tuple's hash, set once; decode rows with equal keys
    # form one group
    shared_key: tuple = ()
    shared_hash: int = 0
    # KV chores its first row needs run first (a shared partial page's copy, compose's splices): the
    # scheduler puts them in the plan of the step with that row (``StepPlan.splices``)
    splices: list[Splice] = dataclasses.field(default_factory=list)


class KVManager:
    def __init__(self, config: EngineConfig, cfg: ModelConfig, runner: ModelRunner, dtype, *, num_pages: int,
                 fingerprint: str, bos_prefix: list[int]):
        self.config, self.runner, self.dtype = config, runner, dtype
        self.fingerprint, self.bos_prefix = fingerprint, bos_prefix
        self.pool = PagePool(num_pages)
        self.prefix_cache = PrefixCache(self.pool, config.page_size)
        self.store = SegmentStore()
        self.tiers = Tiers(cfg, config, dtype, self.pool, self.store, self.prefix_cache, runner,
                           fingerprint=fingerprint, bos_prefix=bos_prefix)
        self.debug_checks = False  # tests: check page accounting after every device step
        self._shared_keys: dict[tuple, tuple] = {}  # Seq.shared_key interned: equal keys, one tuple

    def root(self, namespace: str) -> bytes:
        """The prefix-cache hash chain's seed of a namespace (a tenant, or the public one:
        ``prefix_cache.public_root``)."""
        return root_hash(namespace, self.fingerprint)

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each of ``pages`` (last first, so the pool reuses them in order)."""
        self.pool.decref(reversed(pages))

    def allocate(self, n: int) -> list[int]:
        if n == 0:
            return []
        while True:
            pages = self.pool.allocate(n)
            if pages is not None:
                return pages
            victims = self.store.evictable_nodes()
            if not victims and self.tiers.demote_lru_root():  # tiers: LRU root segment -> host
                continue
            if not victims:
                raise PoolExhausted(
                    f"need {n} free KV pages but only {self.pool.num_free} of {self.pool.num_pages - 1} are free; "
                    "the rest are held by segments and running requests: delete segments or raise hbm_pages")
            self.release_node(victims[0])
            self.store.drop_node(victims[0])

    def release_node(self, node: ChainNode) -> None:
        self.pool.decref(reversed(node.pages))

    def prepare(self, root: bytes, tokens: list[int], base: ChainNode | None, want_logits: bool) -> Seq:
        """Pages for ``tokens``: share ``base``'s, take prefix-cache hits, copy a shared partial
        page, allocate the rest (module docstring, 3).  Nothing is computed yet: the returned
        sequence owns one reference on every page and has ``computed`` tokens in them."""
        s, n = self.config.page_size, len(tokens)
        fork = min(base.num_tokens, n - 1) if (base and want_logits) else (base.num_tokens if base else 0)
        k = fork // s
        hashes = self.prefix_cache.hashes_for(root, tokens, self.page_hashes(root, tokens, base))
        limit = (n - 1) // s if want_logits else n // s
        shared = base.pages[:k] if base else []
        self.pool.incref(shared)
        use_cache = self.config.prefix_caching and limit > k
        hits = self.prefix_cache.lookup(hashes[k:limit]) if use_cache else []
        pages = shared + hits
        pos = (k + len(hits)) * s
        cow = base.pages[k] if (base and not hits and fork % s) else None
        if cow is not None:
            pos = fork
        try:
            new = self.allocate(-(-n // s) - len(pages))
        except Exception:
            self.pool.decref(reversed(pages))
            raise
        pages += new
        # copy-on-write: the positions before the fork, run before the sequence's first row
        splices = [page_copy([cow], [new[0]], s, fork % s)] if cow is not None else []
        key = tuple(pages[:k or len(hits)])
        if len(self._shared_keys) >= 4096:  # (a bound: a key not interned only costs an equality test)
            self._shared_keys.clear()
        key = self._shared_keys.setdefault(key, key)
        return Seq(root, list(tokens), pages, hashes, first_own=k + len(hits), computed=pos, cached=pos,
                    shared_key=key, shared_hash=hash(key), splices=splices)

    def page_hashes(self, root: bytes, tokens: list[int], base: ChainNode | None) -> list[bytes]:
        """The hashes of ``base``'s full pages under ``root`` (``tokens`` begin with its tokens),
        hashed once per node and root and kept on the node: admission over a 4k-token segment
        then hashes only the request's own pages, not the segment's 256 again."""
        if base is None:
            return []
        full = min(base.num_tokens, len(tokens)) // self.config.page_size
        known = base.page_hashes.get(root)
        if known is None or len(known) < full:
            known = base.page_hashes[root] = self.prefix_cache.hashes_for(root, tokens[:base.num_tokens])
        return known[:full]

    def register_full_pages(self, seq: Seq, upto: int | None = None) -> None:
        """Insert every newly computed full page of ``seq`` into the prefix cache: the pages
        below ``upto`` tokens (default ``seq.computed``; the scheduler passes what a step it has
        read back computed, since ``computed`` already counts steps still in flight)."""
        if not seq.cacheable or not self.config.prefix_caching:
            return
        s = self.config.page_size
        full = (seq.computed if upto is None else upto) // s
        if full <= seq.first_own and full <= len(seq.hashes):
            return  # (most decode tokens: no page filled)
        while len(seq.hashes) < full:  # pages that filled with generated tokens
            i = len(seq.hashes)
            parent = seq.hashes[i - 1] if i else seq.root
            seq.hashes.append(page_hash(parent, seq.tokens[i * s:(i + 1) * s]))
        for i in range(seq.first_own, full):
            self.prefix_cache.insert(seq.hashes[i], seq.pages[i])
        seq.first_own = max(seq.first_own, full)

    def materialize(self, root: bytes, tokens: list[int], base: ChainNode | None) -> Seq:
        """Prepare and compute ``tokens`` now, one chunk per step (registered segments)."""
        seq = self.prepare(root, tokens, base, want_logits=False)
        chunk = self.config.prefill_chunk
        try:
            for c in range(seq.computed, len(tokens), chunk):
                self.step([StepRow(tokens[c:c + chunk], c, seq.pages)], 0, splices=seq.splices)
                seq.splices = []
            if seq.splices:  # nothing left to compute (all of it in ``base``): the copy alone
                self.runner.run_splices(seq.splices)
                seq.splices = []
        except BaseException:
            self.release(seq.pages)
            raise
        seq.computed = len(tokens)
        self.register_full_pages(seq)
        return seq

    def step(self, rows: list[StepRow], num_logprobs: int, groups: list[int] | None = None,
             splices: list[Splice] | None = None) -> StepResult:
        """One device step now (``splices`` first): registered segments, a row run alone."""
        result = self.runner.step(rows, num_logprobs, groups, splices)
        if self.debug_checks:
            self.check_invariants()
        return result

    def start(self, req: Request) -> tuple[list[Segment], ChainNode] | None:
        """Admission (``scheduler.py``, 2): chain nodes, then the request's pages.

        Returns ``(chain, parent)`` when the chain node ``chain`` is missing: the request then
        holds readers on the nodes before it (``req.nodes``, ``parent`` last) and no pages, and
        the scheduler computes the node.  Readers the request held on entry (the nodes found
        before it waited on a node job, and that node) are released once the walk has taken
        its own, so a node computed for the request cannot be evicted before it is admitted."""
        held, req.nodes = req.nodes, []
        try:
            if req.mode != "exact" and len(req.chain) > 1:
                self._start_composed(req)
                return None
            nodes: list[ChainNode] = []
            try:
                fresh = bool(req.chain) and is_literal(req.chain[0]) and self.store.node(req.chain[:1], False) is None
                node, missing = self.walk_chain(req.chain, nodes)
                if fresh:  # the literal's node was computed for this request: not cached tokens
                    req.chain_computed += nodes[0].num_tokens - len(self.bos_prefix)
                if missing is not None:
                    req.nodes = nodes
                    return missing, node
                tokens = req.prompt_tokens + req.out_ids
                seq = self.prepare(self.root(req.tenant), tokens, node, want_logits=True)
            except BaseException:
                for nd in nodes:
                    nd.readers -= 1
                raise
        finally:
            for nd in held:
                nd.readers -= 1
        req.seq, req.nodes, req.prefill_end = seq, nodes, len(tokens)
        if req.cached_tokens is None:
            req.cached_tokens = max(0, seq.cached - req.chain_computed)
        return None

    def _start_composed(self, req: Request) -> None:
        """compose / blend admission (``blend.py``): segment 1 exact, the others spliced from their
        standalone KV with a RoPE shift; blend then recomputes the most-deviating tokens."""
        s, lb = self.config.page_size, len(self.bos_prefix)
        nodes: list[ChainNode] = []
        pages: list[int] = []
        try:
            for seg in req.chain:
                node = self.store.node([seg]) or self.promote(seg)
                node.readers += 1
                nodes.append(node)
            tokens = req.prompt_tokens + req.out_ids
            n = len(tokens)
            first = nodes[0]
            fork = min(first.num_tokens, n - 1)
            pages = first.pages[:fork // s]
            self.pool.incref(pages)
            new = self.allocate(-(-n // s) - len(pages))
            pages = pages + new  # from here on the except below releases them all
            # the first segment's partial page copied up to the fork, the others' tokens spliced after it
            splices = [page_copy([first.pages[fork // s]], [new[0]], s, fork % s)] if fork % s else []
            src, dst, shift, blended = [], [], [], []
            pos = first.num_tokens
            for node, seg in zip(nodes[1:], req.chain[1:]):
                for j in range(len(seg.token_ids)):
                    sp, dp = lb + j, pos + j
                    src.append(node.pages[sp // s] * s + sp % s)
                    dst.append(pages[dp // s] * s + dp % s)
                    shift.append(dp - sp)
                    blended.append(dp)
                pos += len(seg.token_ids)
            if src:
                splices.append(Splice(*(np.asarray(x, np.int32) for x in (src, dst, shift))))
            computed = min(pos, n - 1)
            if req.mode == "blend":  # (blend reads the spliced KV now: its chores run at once)
                self.runner.run_splices(splices)
                splices = []
                cand = [p for p in blended if p < computed]
                blend(self.runner, tokens, cand, pages, computed, self.config.blend_ratio)
        except BaseException:
            self.pool.decref(reversed(pages))
            for nd in nodes:
                nd.readers -= 1
            raise
        req.seq = Seq(self.root(req.tenant), tokens, pages, [], first_own=0, computed=computed,
                       cached=computed, cacheable=False, splices=splices)
        req.nodes, req.prefill_end = nodes, n
        if req.cached_tokens is None:
            req.cached_tokens = computed

    def walk_chain(self, chain: list[Segment], nodes: list[ChainNode]
                    ) -> tuple[ChainNode | None, list[Segment] | None]:
        """Take a reader on each cached node ``[s1]``, ``[s1, s2]``, ... (appended to ``nodes``)
        up to the first missing one; returns (the last node found, the missing node's chain or
        ``None`` when the whole chain is cached)."""
        node = None
        for i in range(len(chain)):
            sub = chain[:i + 1]
            found = self.store.node(sub)
            if found is None and i == 0:
                found = self.promote(sub[0])  # tiers: an evicted segment comes back to HBM
            if found is None:
                assert node is not None, "a registered segment always has its root node"
                return node, sub
            found.readers += 1
            nodes.append(found)
            node = found
        return node, None

    def node_tokens(self, chain: list[Segment]) -> list[int]:
        return list(self.bos_prefix) + [t for seg in chain for t in seg.token_ids]

    def node_seq(self, chain: list[Segment], parent: ChainNode) -> Seq:
        """Pages for the missing chain node ``chain`` over its cached ``parent`` (``prepare``;
        ``PoolExhausted`` if the pool cannot hold them).  Its tokens from ``computed`` on are
        still to be computed (the scheduler's node job)."""
        ns = self.store.chain_namespace(chain)
        return self.prepare(self.root(ns), self.node_tokens(chain), parent, want_logits=False)

    def add_node(self, chain: list[Segment], seq: Seq) -> ChainNode | None:
        """A node job's computed ``seq`` becomes the chain node of ``chain`` (the node owns its
        page references).  If a segment of ``chain`` was deleted (or replaced) meanwhile, its
        pages are released instead and ``None`` is returned: nothing is cached under a dead uid."""
        if not all(self.store.is_live(seg) for seg in chain):
            self.pool.decref(reversed(seq.pages))
            return None
        existing = self.store.node(chain, touch=False)
        if existing is not None:  # cached by another path meanwhile: keep that one
            self.pool.decref(reversed(seq.pages))
            return existing
        self.register_full_pages(seq)
        node = ChainNode(self.store.chain_namespace(chain), tuple(seg.uid for seg in chain), len(seq.tokens),
                         seq.pages)
        self.store.add_node(node)
        return node

    def promote(self, seg: Segment) -> ChainNode:
        """Bring a segment evicted to host, disk or the recompute tier back into HBM pages; a
        literal chain element's node is computed now (``segments.literal``)."""
        if is_literal(seg):
            return self.compute_root(seg)
        return self.tiers.promote(seg, self)

    def compute_root(self, seg: Segment) -> ChainNode:
        """(Re)compute a segment's KV from its tokens into HBM as its root node, as
        ``Engine.register_segment`` does (the recompute tier, restore)."""
        seq = self.materialize(self.root(seg.namespace), self.bos_prefix + seg.token_ids, None)
        node = ChainNode(seg.namespace, (seg.uid,), len(seq.tokens), seq.pages)
        self.store.add_node(node)
        return node

    def check_invariants(self) -> None:
        """Pool and prefix cache consistent; every node's pages referenced; tiers consistent."""
        self.prefix_cache.check_invariants()
        for node in self.store.nodes():
            for p in node.pages:
                assert self.pool.refcount(p) > 0, f"chain node {node.key} lists unreferenced page {p}"
        self.tiers.check_invariants()

