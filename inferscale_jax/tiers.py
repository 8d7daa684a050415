"""KV tiers: the HBM page pool -> pinned host memory -> disk, LRU, with pinning and promotion.

A registered segment's KV lives in exactly one place:

- **hbm**: its root chain node (``ChainNode`` with one uid) holds pages of the device pool;
- **host**: one array ``[L, 2, Hkv, nb, S, D]`` (all layers, K and V, ``nb = page_bucket(n)``
  pages) in pinned host memory (``memory_kind="pinned_host"``, so host -> device is one DMA;
  backends without that memory kind keep a numpy array: same code path), with the xxh3-64
  checksum of its bytes taken at demotion and checked at promotion (one pass over the bytes,
  its rate in bench/NOTES.md, "Figures moved from code comments"; a mismatch is an integrity
  error like a damaged disk file below);
- **disk**: the same array's raw bytes in one file under ``disk_dir`` (a cache, not a
  persistence format: the folder is wiped at startup; snapshots are ``snapshot.py``'s job),
  with the xxh3-64 checksum of those bytes kept beside the entry: a read checks the size and
  the checksum, and a file that is missing, short or different is never served - the KV is
  recomputed from the segment's token ids instead (an *integrity error*, logged and counted:
  ``stats()["integrity_errors"]``, ``inferscale_integrity_errors_total{tier}``);
- **recompute**: nowhere (disk tier full): promotion recomputes it from its token ids.

Life of an eviction (``KVManager.allocate`` found no free pages and no evictable chain node):

1. ``demote_lru_root`` picks the least recently used root that no request reads
   (``readers == 0``), that is not ``pin=True`` and that would free at least one page.
2. One jitted gather copies all its pages of every layer into one ``[L, 2, Hkv, nb, S, D]``
   device array; one ``jax.device_put`` moves it to pinned host memory.  The node is dropped
   and its page references released (its full pages stay in the prefix cache until reused).
3. If the host tier now holds more than ``host_pages`` pages, its LRU entries go to disk;
   if the disk tier holds more than ``disk_pages``, its LRU entries are dropped (recompute).
   A disk write that fails because the folder is full or read-only is ``StorageError`` naming
   the folder; during an eviction the entry is then dropped to the recompute tier instead (the
   disk tier is a cache: the KV is recomputed from its tokens) and the failure logged once.

Life of a promotion (``KVManager.walk_chain`` needs a root that is not in HBM): the entry leaves
its tier (so the allocation below cannot demote it again), pages are allocated (which may
demote other roots), the array is read from disk if needed, moved to the device in one
``device_put`` and scattered into the new pages by one jitted, cache-donating scatter.  The
root node is re-created and its full pages re-indexed in the prefix cache.

Shapes are bucketed (``page_bucket``: powers of two up to 8 pages, then 8 buckets per octave,
so at most 12.5% padding) so gather and scatter compile once per bucket, not per segment
length.  Gather padding reads the null page; scatter padding targets page id ``P`` (out of
range) and is dropped, so no page is written but the segment's own.

Counters: evictions per tier, promotions per source tier, promotion latency (allocation +
disk read + transfer) and host -> device bandwidth (bytes / transfer time).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from inferscale_jax.errors import StorageError
from inferscale_jax.kv_cache import gather_pages, page_bytes, scatter_pages
from inferscale_jax.prefix_cache import root_hash
from inferscale_jax.registry import storage_error
from inferscale_jax.segments import ChainNode, Segment, SegmentStore, is_literal
from pallas_kernels.quant import SCALE_BYTES

if TYPE_CHECKING:
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.kv_manager import KVManager
    from inferscale_jax.page_pool import PagePool
    from inferscale_jax.prefix_cache import PrefixCache
    from inferscale_jax.runner import ModelRunner
    from models import ModelConfig

log = logging.getLogger("inferscale.tiers")

LOWER_TIERS = ("host", "disk", "recompute")
TRANSFER_GROUP_BYTES = 256 << 20  # device bytes gathered at once when copying many segments out


def _remove(path: str | None) -> None:
    """Remove a disk tier file; one already gone (deleted by hand, a failed write) is fine."""
    if path:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def page_bucket(n: int) -> int:
    """Pages an array of ``n`` pages is padded to: 1, 2, 4, 8, then 8 buckets per octave."""
    if n <= 8:
        return 1 << max(0, n - 1).bit_length()
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def pinned_host_sharding(device) -> SingleDeviceSharding | None:
    """Pinned host memory of ``device`` when the backend has that memory kind, else None."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without memory introspection
        return None
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


@dataclasses.dataclass
class TierEntry:
    """A segment whose KV is not in HBM."""
    uid: int
    num_tokens: int
    num_pages: int  # real pages; arrays hold page_bucket(num_pages)
    tier: str  # "host" | "disk" | "recompute"
    kv: object = None  # host: [L, 2, Hkv, nb, S, D] pinned-host jax.Array (or np.ndarray)
    path: str | None = None  # disk: the same array's raw bytes
    checksum: int | None = None  # xxh3-64 of the block's bytes (host: in memory; disk: the file), checked when read
    hashes: list[bytes] | None = None  # prefix-cache keys of its full pages (hashed once, at demotion)

    @property
    def bucket(self) -> int:
        return page_bucket(self.num_pages)


class Tiers:
    """The host and disk tiers below one engine's HBM page pool."""

    def __init__(self, cfg: ModelConfig, config: EngineConfig, dtype, pool: PagePool, store: SegmentStore,
                 prefix_cache: PrefixCache, runner: ModelRunner, *, fingerprint: str, bos_prefix: list[int]):
        """The HBM side is the pool, store and prefix cache given here (``kv_manager.py`` owns
        them and these tiers); the runner holds the page pool's arrays."""
        ec = self.config = config
        self.dtype, self.pool, self.store, self.prefix_cache, self.runner = dtype, pool, store, prefix_cache, runner
        self.fingerprint, self.bos_prefix = fingerprint, bos_prefix
        cache = runner.cache
        if cache.mesh is None:
            self.device = next(iter(cache.k[0].devices()))
            self.host_sharding = pinned_host_sharding(self.device)
            self.device_sharding = SingleDeviceSharding(self.device)
            # Commit the pool to its device once (device_put aliases: no copy).  Promotions bring arrays
            # with an explicit sharding (committed); a cache that turned from uncommitted to committed
            # on the first promotion would recompile every jitted step that takes it.
            runner.place(self.device_sharding)
        else:  # tensor parallel: a block [L, 2, Hkv, n, S, D] is split on kv heads like the pool (replicated
            # when the pool repeats fewer real heads than devices)
            spec = PartitionSpec(None, None, "tp") if cache.k[0].shape[0] == cfg.num_kv_heads else PartitionSpec()
            self.device = cache.mesh.devices.flat[0]
            self.device_sharding = NamedSharding(cache.mesh, spec)
            pinned = pinned_host_sharding(self.device) is not None
            self.host_sharding = NamedSharding(cache.mesh, spec, memory_kind="pinned_host") if pinned else None
        self.rep = cache.k[0].shape[0] // cfg.num_kv_heads  # copies of each kv head in the pool
        # a mesh spanning processes (distributed.py): host arrays, disk files and snapshots hold this
        # process's shards only ([L, 2, Hkv / P, nb, S, D] when kv heads are split, else every head)
        self.multiprocess = cache.mesh is not None and not cache.k[0].is_fully_addressable
        split = self.multiprocess and self.device_sharding.spec != PartitionSpec()
        self.local_heads = cfg.num_kv_heads * len(jax.local_devices()) // len(cache.mesh.devices.flat) if split \
            else cfg.num_kv_heads
        # a block's rows: D values of the KV dtype, or (compressed KV) D bytes + the scale's 4 (quant.py)
        self.block_dtype = np.dtype(np.uint8) if cache.quantized else np.dtype(dtype)
        row = cfg.head_dim + SCALE_BYTES if cache.quantized else cfg.head_dim
        self.layout = (cfg.num_layers, 2, cfg.num_kv_heads, ec.page_size, row)  # + nb at axis 3
        self.page_nbytes = page_bytes(cfg, ec.page_size, cache.k[0].dtype)
        if ec.host_pages is not None:
            self.host_capacity = ec.host_pages
        else:  # 4x the HBM pool, at most a quarter of the machine's RAM
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.host_capacity = min(4 * pool.num_pages, ram // 4 // self.page_nbytes)
        self.disk_capacity = ec.disk_pages  # None: unbounded
        self._disk_dir = ec.disk_dir or (os.path.join(ec.snapshot_dir, "disk_tier") if ec.snapshot_dir else None)
        self._own_disk_dir = False
        if self._disk_dir and os.path.isdir(self._disk_dir):  # a cache: stale after a restart
            for name in os.listdir(self._disk_dir):
                if name.endswith((".kv", ".kv.tmp")):
                    os.remove(os.path.join(self._disk_dir, name))
        self._entries: OrderedDict[int, TierEntry] = OrderedDict()  # uid -> entry, LRU first
        self._in_flight: int | None = None  # uid being recomputed into HBM (in no tier meanwhile)
        self._disk_error: str | None = None  # the last disk write failure logged (each distinct one once)
        self.counters = dict(evictions_hbm=0, evictions_host=0, evictions_disk=0, integrity_errors_disk=0,
                             integrity_errors_host=0, integrity_errors_registry=0, integrity_errors_snapshot=0,
                             promotions_host=0,
                             promotions_disk=0, promotions_recompute=0, promotion_s=0.0, promotion_bytes=0,
                             transfer_s=0.0, last_promotion_s=0.0, last_promotion_gbps=0.0)

    # -- where is a segment ---------------------------------------------------------------
    def where(self, seg: Segment) -> str:
        if self.store.root(seg) is not None:
            return "hbm"
        if is_literal(seg):
            return "literal"  # (not resident: computed at admission)
        entry = self._entries.get(seg.uid)
        return entry.tier if entry else "missing"

    def disk_dir(self) -> str:
        if self._disk_dir is None:
            self._disk_dir = tempfile.mkdtemp(prefix="inferscale-disk-tier-")
            self._own_disk_dir = True
        os.makedirs(self._disk_dir, exist_ok=True)
        return self._disk_dir

    # -- eviction (HBM -> host -> disk -> recompute) --------------------------------------
    def demote_lru_root(self) -> bool:
        """Move the LRU unpinned, unread root that frees a page to the host tier (False: none)."""
        pool = self.pool
        for node in self.store.evictable_roots():
            if any(pool.refcount(p) == 1 for p in node.pages):
                self._demote_node(node)
                return True
        return False

    def demote(self, seg: Segment, to: str = "host") -> None:
        """Move ``seg`` down to tier ``to`` ("host", "disk" or "recompute"); for tests and benchmarks."""
        if to not in LOWER_TIERS:
            raise ValueError(f"to={to!r} is invalid: must be one of {LOWER_TIERS}")
        if seg.info.pin:
            raise ValueError(f"segment {seg.info.id!r} is pinned (pin=True): it never leaves HBM")
        node = self.store.root(seg)
        if node is not None:
            if node.readers:
                raise ValueError(f"segment {seg.info.id!r} is read by {node.readers} running request(s)")
            self._demote_node(node)
        entry = self._entries[seg.uid]
        if to in ("disk", "recompute") and entry.tier == "host":
            self._host_to_disk(entry)
        if to == "recompute" and entry.tier == "disk":
            self._drop(entry)

    def _demote_node(self, node: ChainNode) -> None:
        (uid,) = node.uids
        n = len(node.pages)
        pages = np.zeros(page_bucket(n), np.int32)  # padding gathers the null page
        pages[:n] = node.pages
        kv = gather_pages(self.runner.cache, jnp.asarray(pages), self.rep)
        host = jax.device_put(kv, self.host_sharding) if self.host_sharding else self.local(kv)
        jax.block_until_ready(host)
        seg = next(s for s in self.store.all_segments() if s.uid == uid)
        self.store.drop_node(node)
        self.pool.decref(reversed(node.pages))
        self._entries[uid] = TierEntry(uid, node.num_tokens, n, "host", kv=host, hashes=self.page_hashes(seg),
                                       checksum=self._checksum(host))
        self.counters["evictions_hbm"] += 1
        self._enforce_capacity()

    def _enforce_capacity(self) -> None:
        while self.pages_in("host") > self.host_capacity:
            entry = next(x for x in self._entries.values() if x.tier == "host")
            try:
                self._host_to_disk(entry)
            except StorageError as err:
                if str(err) != self._disk_error:
                    log.warning("%s; segments leaving the host tier are recomputed when next used instead", err)
                    self._disk_error = str(err)
                entry.tier, entry.kv = "recompute", None
                self.counters["evictions_host"] += 1
        while self.disk_capacity is not None and self.pages_in("disk") > self.disk_capacity:
            self._drop(next(x for x in self._entries.values() if x.tier == "disk"))

    def _host_to_disk(self, entry: TierEntry) -> None:
        arr = np.ascontiguousarray(self.local(entry.kv))
        folder = self._disk_dir or "the disk tier folder"
        try:
            folder = self.disk_dir()
            path = os.path.join(folder, f"{entry.uid}.kv")
            try:
                data = memoryview(arr.reshape(-1).view(np.uint8))
                checksum = xxhash.xxh3_64_intdigest(data)
                if entry.checksum is not None and checksum != entry.checksum:  # damaged in host memory
                    self._host_damaged(entry)
                    return
                with open(path + ".tmp", "wb") as f:
                    f.write(data)
                os.replace(path + ".tmp", path)
            except BaseException:
                if os.path.exists(path + ".tmp"):
                    os.remove(path + ".tmp")  # a partial file must not hold the space
                raise
        except OSError as err:
            raise storage_error(err, folder, f"writing the KV of segment uid {entry.uid} to the disk tier") or err
        entry.tier, entry.kv, entry.path, entry.checksum = "disk", None, path, checksum
        self.counters["evictions_host"] += 1

    def _drop(self, entry: TierEntry) -> None:
        _remove(entry.path)
        entry.tier, entry.kv, entry.path, entry.checksum = "recompute", None, None, None
        self.counters["evictions_disk"] += 1

    def _checksum(self, kv) -> int:
        """xxh3-64 of a block's bytes (this process's part of it)."""
        return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(self.local(kv)).reshape(-1).view(np.uint8)))

    def _host_damaged(self, entry: TierEntry) -> None:
        """A host-tier block whose bytes no longer match its checksum: never served or written
        to disk; the entry goes to the recompute tier (an integrity error: logged, counted)."""
        log.error("integrity error: the host tier copy of segment uid %d does not hold the bytes demoted "
                  "(checksum mismatch); its KV is recomputed from its tokens", entry.uid)
        self.counters["integrity_errors_host"] += 1
        entry.tier, entry.kv, entry.path, entry.checksum = "recompute", None, None, None

    def _read_disk(self, entry: TierEntry) -> np.ndarray | None:
        """The entry's block from its file, or None when the file is missing, short, longer or
        not the bytes written (an integrity error: logged, counted, the file removed)."""
        arr = np.empty(self.shape(entry.num_pages), self.block_dtype)
        buf = memoryview(arr.reshape(-1).view(np.uint8))
        try:
            with open(entry.path, "rb") as f:
                got = f.readinto(buf)
                extra = f.read(1)
        except FileNotFoundError:
            why = "is missing"
        else:
            if got != arr.nbytes or extra:
                why = f"holds {got + len(extra)}{'+' if extra else ''} bytes, expected {arr.nbytes}"
            elif xxhash.xxh3_64_intdigest(buf) != entry.checksum:
                why = "does not hold the bytes written (checksum mismatch)"
            else:
                return arr
        log.error("integrity error: disk tier file %s of segment uid %d %s; its KV is recomputed from its "
                  "tokens", entry.path, entry.uid, why)
        self.counters["integrity_errors_disk"] += 1
        _remove(entry.path)
        return None

    def shape(self, num_pages: int, local: bool = True) -> tuple[int, ...]:
        """A block's shape; ``local``: this process's part of it (all of it in one process)."""
        L, two, hkv, s, d = self.layout
        return (L, two, self.local_heads if local else hkv, page_bucket(num_pages), s, d)

    def local(self, kv) -> np.ndarray:
        """A block as this process's numpy array: the whole block in one process; across processes,
        the shards this process holds, in head order (one copy of replicated ones)."""
        if isinstance(kv, np.ndarray):
            return kv
        if kv.is_fully_addressable:
            return np.asarray(jax.device_get(kv))
        parts = {}
        for shard in kv.addressable_shards:
            parts.setdefault(shard.index[2].start or 0, shard.data)
        return np.concatenate([np.asarray(parts[k]) for k in sorted(parts)], axis=2)

    def to_device(self, kv) -> jax.Array:
        """A block (host jax.Array, or this process's numpy part) on the pool's devices."""
        if self.multiprocess and isinstance(kv, np.ndarray):
            shape = (*kv.shape[:2], self.layout[2], *kv.shape[3:])
            return jax.make_array_from_process_local_data(self.device_sharding, kv, shape)
        return jax.device_put(kv, self.device_sharding)

    # -- promotion (disk -> host -> HBM) --------------------------------------------------
    def promote(self, seg: Segment, kv: KVManager) -> ChainNode:
        """Bring ``seg``'s KV back into HBM pages (allocated by ``kv``, which may demote other
        roots) and return its root node."""
        entry = self._entries.get(seg.uid)
        if entry is None:
            raise AssertionError(f"segment {seg.info.id!r} (uid {seg.uid}) has no KV in any tier")
        t0 = time.perf_counter()
        del self._entries[seg.uid]  # out of its tier: the allocation below cannot demote it again
        if entry.tier == "recompute":
            self._in_flight = seg.uid
            try:
                node = kv.compute_root(seg)
            except BaseException:
                self._entries[seg.uid] = entry
                raise
            finally:
                self._in_flight = None
            self.counters["promotions_recompute"] += 1
            return node
        try:
            if entry.tier == "host":
                arr = entry.kv if entry.checksum is None or self._checksum(entry.kv) == entry.checksum else None
                if arr is None:
                    self._host_damaged(entry)
            else:
                arr = self._read_disk(entry)
            if arr is None:  # a damaged host or disk copy: recompute instead (never serve it)
                entry.tier, entry.kv, entry.path, entry.checksum = "recompute", None, None, None
                self._entries[seg.uid] = entry
                return self.promote(seg, kv)
            pages = kv.allocate(entry.num_pages)
        except BaseException:
            if entry.tier != "recompute":
                self._entries[seg.uid] = entry
            raise
        node = self._install(seg, entry.num_tokens, pages, arr, t0, entry.hashes)
        _remove(entry.path)
        self.counters[f"promotions_{entry.tier}"] += 1
        return node

    def _install(self, seg: Segment, num_tokens: int, pages: list[int], kv, t0: float,
                 hashes: list[bytes] | None = None, count: bool = True) -> ChainNode:
        """Move kv [L, 2, Hkv, nb, S, D] (host) into ``pages`` (allocated) and index the root node."""
        t1 = time.perf_counter()
        dev = self.to_device(kv)  # the one host -> device transfer
        jax.block_until_ready(dev)
        t2 = time.perf_counter()
        padded = np.full(page_bucket(len(pages)), self.runner.cache.num_pages, np.int32)  # padding: dropped
        padded[:len(pages)] = pages
        self.runner.write(scatter_pages, dev, jnp.asarray(padded), self.rep)
        node = ChainNode(seg.namespace, (seg.uid,), num_tokens, pages)
        self.store.add_node(node)
        for h, page in zip(hashes or self.page_hashes(seg), pages):  # as KVManager.materialize would have
            self.prefix_cache.insert(h, page)
        if not count:  # a restore, not a promotion
            return node
        c = self.counters
        c["promotion_s"] += t2 - t0
        c["transfer_s"] += t2 - t1
        c["promotion_bytes"] += kv.nbytes
        c["last_promotion_s"] = t2 - t0
        c["last_promotion_gbps"] = kv.nbytes / max(t2 - t1, 1e-9) / 1e9
        return node

    def page_hashes(self, seg: Segment) -> list[bytes]:
        """The prefix-cache keys of the segment's full pages."""
        return self.prefix_cache.hashes_for(root_hash(seg.namespace, self.fingerprint), self.bos_prefix + seg.token_ids)

    # -- restore and snapshots (snapshot.py) ----------------------------------------------
    def place(self, seg: Segment, num_tokens: int, kv: np.ndarray, headroom: int, manager: KVManager) -> str:
        """Put restored kv into HBM if the pool has ``headroom`` pages to spare, else the host
        tier; a pinned segment goes to HBM whatever it takes (``manager.allocate`` evicts)."""
        n = -(-num_tokens // self.config.page_size)
        pages = self.pool.allocate(n) if self.pool.num_free - n >= headroom else None
        if pages is None and seg.info.pin:
            pages = manager.allocate(n)
        if pages is not None:
            self._install(seg, num_tokens, pages, kv, time.perf_counter(), count=False)
            return "hbm"
        host = jax.device_put(self.to_device(kv), self.host_sharding) if self.host_sharding else kv
        self._entries[seg.uid] = TierEntry(seg.uid, num_tokens, n, "host", kv=host)
        self._enforce_capacity()
        return "host"

    def warm(self, page_counts) -> float:
        """Compile the scatter for the buckets of ``page_counts`` ahead of use; returns the seconds spent."""
        t0 = time.perf_counter()
        for nb in sorted({page_bucket(n) for n in page_counts}):
            kv = jax.ShapeDtypeStruct(self.shape(nb, local=False), self.block_dtype, sharding=self.device_sharding)
            scatter_pages.lower(self.runner.cache, kv, jax.ShapeDtypeStruct((nb,), jnp.int32), self.rep).compile()
        return time.perf_counter() - t0

    def host_copies(self, segs: list[Segment]) -> dict[int, np.ndarray]:
        """Every segment's KV as host arrays [L, 2, Hkv, nb, S, D] (recompute-tier ones are left out).
        HBM pages are gathered in groups of at most TRANSFER_GROUP_BYTES, each group's copies in flight
        together."""
        out: dict[int, np.ndarray] = {}
        group: list[tuple[int, jax.Array]] = []
        group_bytes = 0

        def flush():
            nonlocal group_bytes
            arrays = [a for _, a in group]
            if not self.multiprocess:
                arrays = jax.device_get(arrays)  # every copy in flight together
            for uid, arr in zip([u for u, _ in group], arrays):
                out[uid] = self.local(arr)
            group.clear()
            group_bytes = 0

        for seg in segs:
            node = self.store.root(seg)
            if node is not None:
                pages = np.zeros(page_bucket(len(node.pages)), np.int32)
                pages[:len(node.pages)] = node.pages
                group.append((seg.uid, gather_pages(self.runner.cache, jnp.asarray(pages), self.rep)))
                group_bytes += len(pages) * self.page_nbytes
                if group_bytes >= TRANSFER_GROUP_BYTES:
                    flush()
                continue
            entry = self._entries.get(seg.uid)
            if entry is not None and entry.tier == "host":
                arr = self.local(entry.kv)
                if entry.checksum is None or self._checksum(arr) == entry.checksum:
                    out[seg.uid] = arr
                else:  # damaged in memory: no copy to snapshot; recomputed when next used
                    self._host_damaged(entry)
            elif entry is not None and entry.tier == "disk":
                arr = self._read_disk(entry)
                if arr is None:  # damaged: no copy to snapshot; recomputed when next used
                    entry.tier, entry.path, entry.checksum = "recompute", None, None
                else:
                    out[seg.uid] = arr
        flush()
        return out

    # -- bookkeeping ----------------------------------------------------------------------
    def forget(self, uid: int) -> None:
        """A deleted segment: drop its lower-tier copy (its HBM pages are the store's)."""
        entry = self._entries.pop(uid, None)
        if entry is not None:
            _remove(entry.path)

    def pages_in(self, tier: str) -> int:
        return sum(x.bucket for x in self._entries.values() if x.tier == tier)

    def segments_in(self, tier: str) -> int:
        return sum(1 for x in self._entries.values() if x.tier == tier)

    def stats(self) -> dict:
        c = self.counters
        roots = [n for n in self.store.nodes() if n.is_root]
        promotions = c["promotions_host"] + c["promotions_disk"]
        s = self.config.page_size
        return {
            # KV bytes of one token (all layers, K and V; compressed KV: values + scales) and the tokens
            # each tier holds (pages x page size)
            "kv_bytes_per_token": self.page_nbytes // s,
            "tokens_resident": {"hbm": self.pool.num_used * s, "host": self.pages_in("host") * s,
                                "disk": self.pages_in("disk") * s},
            "hbm": {"segments": len(roots), "pages_used": self.pool.num_used,
                    "bytes_used": self.pool.num_used * self.page_nbytes, "pages_total": self.pool.num_pages - 1,
                    "evictions": c["evictions_hbm"]},
            "host": {"segments": self.segments_in("host"), "pages_used": self.pages_in("host"),
                     "bytes_used": self.pages_in("host") * self.page_nbytes, "pages_total": self.host_capacity,
                     "evictions": c["evictions_host"],
                     "memory_kind": "pinned_host" if self.host_sharding else "numpy"},
            "disk": {"segments": self.segments_in("disk"), "pages_used": self.pages_in("disk"),
                     "bytes_used": self.pages_in("disk") * self.page_nbytes, "pages_total": self.disk_capacity,
                     "evictions": c["evictions_disk"]},
            "recompute": {"segments": self.segments_in("recompute")},
            "integrity_errors": {"host": c["integrity_errors_host"], "disk": c["integrity_errors_disk"],
                                 "registry": c["integrity_errors_registry"],
                                 "snapshot": c["integrity_errors_snapshot"]},
            "promotions": {"host": c["promotions_host"], "disk": c["promotions_disk"],
                           "recompute": c["promotions_recompute"]},
            "promotion_latency_s_mean": c["promotion_s"] / promotions if promotions else 0.0,
            "promotion_latency_s_last": c["last_promotion_s"],
            "promotion_gbps_mean": c["promotion_bytes"] / c["transfer_s"] / 1e9 if c["transfer_s"] else 0.0,
            "promotion_gbps_last": c["last_promotion_gbps"],
        }

    def check_invariants(self) -> None:
        """Every registered segment's KV is in exactly one tier; no lower-tier entry is orphaned."""
        uids = set()
        for seg in self.store.all_segments():
            uids.add(seg.uid)
            if seg.uid == self._in_flight:
                continue
            in_hbm = self.store.root(seg) is not None
            in_lower = seg.uid in self._entries
            assert in_hbm != in_lower, (f"segment {seg.info.id!r} is in HBM: {in_hbm}, in a lower tier: "
                                        f"{in_lower} (exactly one expected)")
            if seg.info.pin:
                assert in_hbm, f"pinned segment {seg.info.id!r} left HBM"
        orphans = set(self._entries) - uids
        assert not orphans, f"lower-tier entries of deleted segments: uids {sorted(orphans)}"

    def close(self) -> None:
        if self._own_disk_dir and self._disk_dir:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
