"""Persistence: the durable registry plus orbax snapshots of every segment's KV, and restore.

Nothing acknowledged is lost: the registry (``registry.py``) records each segment's token ids
before ``register_segment`` returns, so its KV can always be recomputed; snapshots only make
restarts fast.  Files under ``snapshot_dir``::

    registry.sqlite3                 durable segment rows + the committed snapshot step
    registry.sqlite3.journal         the acknowledged writes the committed snapshot lacks (journal.py)
    snapshots/<step>/                orbax: item "kv" {u<uid>: [L, 2, Hkv, nb, S, D]}, item "meta" (JSON),
                                     item "tokens" {"ids": [T] int32: every segment's token ids, concatenated}
    snapshots/<step>.orbax-checkpoint-tmp    a save that never committed (removed at startup)
    disk_tier/                       the disk KV tier (tiers.py): a cache, wiped at startup

Life of a snapshot (``save``):

1. Engine thread: every segment's KV is copied to host arrays (``Tiers.host_copies``: HBM pages
   gathered and copied out in groups, host entries as they are, disk entries read back) and
   checksummed (CRC-32 per array).  ``meta`` records the identity (model digest, dtype, page
   size, fingerprint, layout) and per segment: namespace, id, uid, tenant, public, pin, creation
   time, token digest, token and page counts, where its token ids lie in the "tokens" item, and
   for segments with KV (all but the recompute tier) the "kv" key, checksum and LRU rank.  With
   the token ids the snapshot alone can rebuild the registry's rows.
2. Writer (the caller's thread, or a background thread for periodic snapshots): an orbax
   ``Checkpointer`` writes both items into ``<step>.orbax-checkpoint-tmp`` and renames it to
   ``<step>`` (``AtomicRenameTemporaryPath``: atomic on local file systems).
3. Every file and directory of the step is fsynced (orbax renames but does not fsync, so a
   power cut could otherwise leave a renamed step with missing data).
4. Commit: the registry's ``snapshot_step`` is set to ``step`` (one fsynced transaction).
5. Steps other than this one and the previously committed one are deleted.

A kill before 4 leaves the previous committed step referenced and intact, and segments
registered since are recomputed from the registry.  A save that fails (full or read-only
storage: ``StorageError`` naming the folder) removes its temporary folder (and its renamed but
uncommitted step) at once.  Periodic saves then back off: the next attempt waits the interval
times 2, 4, 8... (at most ``MAX_BACKOFF_S``); the first failure of a run of identical ones is
logged as an error (without traceback), the repeats at debug level.  Test hook: with
``INFERSCALE_TEST_SNAPSHOT_PAUSE_S`` set, the save sleeps between 2's data and its rename (and
first writes the temp path to ``INFERSCALE_TEST_SNAPSHOT_PAUSE_MARKER`` if set), so a test can
``kill -9`` it mid-snapshot.

Restore (engine construction with ``snapshot_dir``), all reads and checks before any change:

1. Remove unfinished temp steps.  Acknowledged writes the registry lost (its journal proves
   them) are redone, or the start is refused naming them (``recovery.py``).  Rows of this
   engine's fingerprint are loaded from the registry (a damaged registry file is
   ``SnapshotCorrupt``, ``registry.py``, unless ``repair_registry``); rows of another
   model/dtype/page size are left alone (``strict_restore``: raise ``SnapshotMismatch`` naming
   the part that differs; else log it).
2. The committed step's ``meta`` is read; another identity is ``SnapshotMismatch`` (strict) or
   a logged warning and no KV restored (segments are then all recomputed).  The registry is
   cross-checked against it: uids only grow and a deletion never lowers ``next_uid``, so a
   snapshot segment whose uid is at or past the registry's ``next_uid`` was registered but its
   row is gone (an emptied or replaced registry file, a lost write-ahead log).  Those rows are
   rebuilt from the snapshot's records and token ids (checked against the token digest) and
   logged as a warning naming both files; a snapshot without token ids (older format) cannot
   rebuild them and the start is refused with ``SnapshotCorrupt`` naming both files and the fix.
3. The KV item is read into host memory; each registry row whose (namespace, id, uid, token
   digest) matches a snapshot record gets that array after its shape, dtype and CRC-32 are
   checked.  A record that fails (or every record, when the item or the meta cannot be read)
   is a logged, counted integrity error and its segment is recomputed instead (``_load``);
   across processes any failure is ``SnapshotCorrupt`` naming the file and the fix, with
   nothing changed yet.
4. Rebuilt rows are written to the registry; segments are re-added under their uids. Pinned
   ones go to HBM; segments with no snapshot KV are recomputed; the rest fill HBM
   most-recently-used first while 1/8 of the pool stays free for requests, then the host tier
   (and disk, by its capacity).

Periodic snapshots: ``maybe_snapshot()`` (called after registrations and deletions, and by any
serving loop) saves in the background when segments changed and ``snapshot_interval_s`` has
passed; ``close()`` (also at interpreter exit) takes a final one.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hashlib
import logging
import os
import shutil
import threading
import time
import weakref
import zlib
from typing import TYPE_CHECKING

import jax
import numpy as np
import orbax.checkpoint as ocp

from inferscale_jax.errors import SnapshotCorrupt, SnapshotMismatch, StorageError
from inferscale_jax.journal import fsync_dir
from inferscale_jax.recovery import recover
from inferscale_jax.registry import Identity, Registry, SegmentRow, storage_error
from inferscale_jax.segments import Segment, SegmentInfo
from inferscale_jax.snapshot_processes import Spread

if TYPE_CHECKING:
    from inferscale_jax.kv_manager import KVManager

log = logging.getLogger("inferscale.snapshot")
_clock = time.monotonic  # the periodic snapshots' clock (interval, backoff); tests set their own
FORMAT = "inferscale-jax/snapshot/v1"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
PAUSE_ENV = "INFERSCALE_TEST_SNAPSHOT_PAUSE_S"
PAUSE_MARKER_ENV = "INFERSCALE_TEST_SNAPSHOT_PAUSE_MARKER"
HEADROOM_FRACTION = 8  # restore leaves 1/8 of the pool free
MAX_BACKOFF_S = 600.0  # longest wait between periodic attempts after failed snapshots
if logging.getLogger("absl").level == logging.NOTSET:
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs ~20 absl INFO lines per save


class _RenameCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """orbax's atomic-rename commit, plus the test hook that pauses just before the rename."""

    async def finalize(self):
        pause = os.environ.get(PAUSE_ENV)
        if pause:
            marker = os.environ.get(PAUSE_MARKER_ENV)
            if marker:  # written whole, then renamed: a test polling for it never reads it half-written
                with open(marker + ".tmp", "w") as f:
                    f.write(str(self.get()))
                os.replace(marker + ".tmp", marker)
            log.warning("%s=%s: pausing before committing %s", PAUSE_ENV, pause, self.get())
            await asyncio.sleep(float(pause))
        await super().finalize()


def _checkpointer(alone: bool = False) -> ocp.Checkpointer:
    """The orbax checkpointer: of every process (its barriers wait for all), or with ``alone``, of
    this process only (the leader reading a snapshot's meta and token ids by itself)."""
    if alone:
        opts = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={jax.process_index()})
        handler = ocp.CompositeCheckpointHandler(composite_options=ocp.CompositeOptions(
            multiprocessing_options=opts))
        return ocp.Checkpointer(handler, multiprocessing_options=opts)
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(), temporary_path_class=_RenameCommit)


def token_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, "<i4").tobytes()).hexdigest()


def crc32(arr: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))


def crc32_many(arrays: list[np.ndarray]) -> list[int]:
    """CRC-32 of each array, in parallel threads (zlib releases the GIL on large buffers)."""
    if len(arrays) < 2:
        return [crc32(a) for a in arrays]
    with concurrent.futures.ThreadPoolExecutor(min(len(arrays), os.cpu_count() or 1, 16)) as pool:
        return list(pool.map(crc32, arrays))


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


class Persistence:
    """The registry and snapshots of one engine (``EngineConfig.snapshot_dir``)."""

    def __init__(self, kv: KVManager, model_fingerprint: str):
        """``kv``: the engine's pages, store and tiers (what restore fills and snapshots read);
        ``model_fingerprint``: the part of the identity a mismatch names (the model alone)."""
        self.kv = kv
        self.dir = kv.config.snapshot_dir
        self.snap_dir = os.path.join(self.dir, "snapshots")
        try:
            os.makedirs(self.snap_dir, exist_ok=True)
        except OSError as err:
            raise storage_error(err, self.dir, f"creating {self.snap_dir}") or err
        self.identity = Identity(kv.fingerprint, model_fingerprint, kv.config.storage_label, kv.config.page_size)
        # several processes (snapshot_processes.py): one global checkpoint; process 0's registry is
        # the record, every other process keeps a mirror in its own folder
        self.spread = Spread(kv.tiers) if kv.tiers.multiprocess else None
        folder = self.dir
        if self.spread is not None and not self.spread.leader:
            folder = os.path.join(self.dir, f"process-{self.spread.index}-of-{self.spread.count}")
            os.makedirs(folder, exist_ok=True)
        self.registry = Registry(os.path.join(folder, "registry.sqlite3"), self.identity,
                                 repair=kv.config.repair_registry)
        self._writer: threading.Thread | None = None
        self._dirty = False
        self._last_save = _clock()
        self._retry_at = 0.0  # periodic saves wait until then after a failure (backoff)
        self._closed = False
        self.counters = dict(snapshots=0, last_step=None, last_duration_s=0.0, last_capture_s=0.0, last_bytes=0,
                             last_disk_bytes=0, last_error=None, failures=0, restored_step=None, restore_s=0.0,
                             restore_read_s=0.0, restore_compile_s=0.0, restore_bytes=0, restored_hbm=0,
                             restored_host=0, recomputed=0, rebuilt=0, redone=0,
                             lost_writes=0)
        self.lost_writes: list[str] = []  # acknowledged writes a repair could not redo (recovery.py), by id
        if self.spread is None:  # across processes a final save needs every process: close() takes it
            atexit.register(_close_at_exit, weakref.ref(self))

    # -- registry hooks -------------------------------------------------------------------
    def on_registered(self, seg: Segment) -> None:
        """Record ``seg`` durably; on failure forget it again and raise (it was never acknowledged)."""
        i = seg.info
        try:
            self.registry.add(SegmentRow(seg.namespace, i.id, seg.uid, i.tenant, seg.token_ids, i.public, i.pin,
                                         i.created, version=i.version, updated=i.updated))
        except BaseException:
            for node in self.kv.store.remove(seg):
                self.kv.release_node(node)
            raise
        self._dirty = True
        self.maybe_snapshot()

    def on_updated(self, old: Segment, new: Segment) -> None:
        """Record ``new`` as the next version of ``old``'s row (one fsynced transaction:
        ``Registry.replace``); raises, with nothing recorded, if that fails.  The caller swaps
        the versions in memory after this returns, then calls ``maybe_snapshot``."""
        i = new.info
        self.registry.replace(old.uid, SegmentRow(new.namespace, i.id, new.uid, i.tenant, new.token_ids, i.public,
                                                  i.pin, i.created, version=i.version, updated=i.updated))
        self._dirty = True

    def on_deleted(self, seg: Segment) -> None:
        self.registry.delete(seg.namespace, seg.info.id)
        self._dirty = True
        self.maybe_snapshot()

    # -- saving ---------------------------------------------------------------------------
    def due(self) -> bool:
        """Segments changed, ``snapshot_interval_s`` has passed (and any failure's backoff), and no
        write is running."""
        interval = self.kv.config.snapshot_interval_s
        if interval is None or not self._dirty or (self._writer is not None and self._writer.is_alive()):
            return False
        now = _clock()
        return now - self._last_save >= interval and now >= self._retry_at

    def maybe_snapshot(self) -> bool:
        """Start a background snapshot when ``due()``; never raises: a periodic snapshot's failure is
        logged.  Across processes the leader decides instead (``LockstepEngine.maybe_snapshot``)."""
        if self.spread is not None or not self.due():
            return False
        try:
            self.save(wait=False)
        except Exception as err:  # noqa: BLE001 - the capture failed; the caller's own work succeeded
            self._failed(None, err)
            return False
        return True

    def _failed(self, path: str | None, err: BaseException) -> None:
        """Count a failed snapshot, schedule the next periodic attempt, log it (once per distinct error)."""
        c = self.counters
        c["failures"] += 1
        base = self.kv.config.snapshot_interval_s or 1.0
        delay = min(MAX_BACKOFF_S, base * 2.0 ** c["failures"])
        self._retry_at = _clock() + delay
        self._dirty = True
        text = str(err) if isinstance(err, StorageError) else (
            f"snapshot {path or '(capture)'} failed: {type(err).__name__}: {err}")
        level = logging.DEBUG if text == c["last_error"] else logging.ERROR
        log.log(level, "%s (%d failed in a row). The previous snapshot stays in use; the next periodic attempt "
                "is in %.0f s", text, c["failures"], delay)
        c["last_error"] = text

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def save(self, wait: bool = True) -> dict:
        """Snapshot every segment's KV; returns the step's summary (``wait=False``: the capture's;
        across processes the write is always waited for: snapshot_processes.py)."""
        self.wait()
        sp = self.spread
        wait = wait or sp is not None
        e = self.kv
        t0 = time.perf_counter()
        segs = e.store.all_segments()
        arrays = e.tiers.host_copies(segs)
        order = [n.uids[0] for n in reversed(e.store.nodes()) if n.is_root]
        order += [uid for uid in reversed(e.tiers._entries) if uid not in order]
        rank = {uid: r for r, uid in enumerate(order)}
        records, tree = [], {}
        kept = [seg for seg in segs if seg.uid in arrays]  # the rest are in the recompute tier
        sums = dict(zip([seg.uid for seg in kept], crc32_many([arrays[seg.uid] for seg in kept])))
        if sp is not None:  # every process's checksums of its own shards, process order
            per = sp.gather([sums[seg.uid] for seg in kept])
            sums = {seg.uid: [row[i] for row in per] for i, seg in enumerate(kept)}
        ids, at = [], 0
        for seg in segs:
            tokens = e.bos_prefix + seg.token_ids
            i = seg.info
            rec = dict(key=None, namespace=seg.namespace, id=i.id, uid=seg.uid, tenant=i.tenant, public=i.public,
                       pin=i.pin, created=i.created, version=i.version, updated=i.updated, num_tokens=len(tokens),
                       num_pages=-(-len(tokens) // e.config.page_size), digest=token_digest(tokens),
                       tokens_at=[at, at + len(seg.token_ids)])
            ids.append(np.asarray(seg.token_ids, np.int32))
            at += len(seg.token_ids)
            if seg.uid in arrays:
                rec.update(key=f"u{seg.uid}", crc32=sums[seg.uid], rank=rank.get(seg.uid, len(rank)))
                tree[rec["key"]] = arrays[seg.uid] if sp is None else sp.to_global(arrays[seg.uid], rec["num_pages"])
            records.append(rec)
        token_ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)  # [T]
        ident = self.identity
        meta = dict(format=FORMAT, fingerprint=ident.fingerprint, model=ident.model, dtype=ident.dtype,
                    page_size=ident.page_size, layout=list(e.tiers.layout), created=time.time(), segments=records,
                    processes=sp.count if sp is not None else 1,
                    registry_write_seq=self.registry.write_seq())  # the segment writes it reflects
        self._dirty = False
        self._last_save = _clock()
        capture_s = time.perf_counter() - t0
        steps = self._steps(include_tmp=True)
        step = max(steps, default=0) + 1
        if sp is not None:
            step = sp.agree(step)  # the leader's: the others may list the folder while it writes
        args = (step, tree, token_ids, meta, t0, capture_s)
        if wait:
            return self._write(*args)
        self._writer = threading.Thread(target=self._write, args=(*args, False), name="inferscale-snapshot",
                                        daemon=True)
        self._writer.start()
        return dict(step=step, segments=len(records), capture_s=capture_s, bytes=sum(_nbytes(a) for a in tree.values()))

    def _write(self, step: int, tree: dict, token_ids: np.ndarray, meta: dict, t0: float, capture_s: float,
               reraise: bool = True) -> dict:
        path = os.path.join(self.snap_dir, str(step))
        committed = False
        try:
            prev = self.registry.get_meta("snapshot_step")
            items = dict(meta=ocp.args.JsonSave(meta))
            if tree:
                items["kv"] = ocp.args.PyTreeSave(tree)
            if token_ids.size:
                items["tokens"] = ocp.args.PyTreeSave({"ids": token_ids})
            _checkpointer().save(path, args=ocp.args.Composite(**items))
            _fsync_tree(path)
            fsync_dir(self.snap_dir)
            self.registry.set_meta("snapshot_step", str(step))  # the commit point
            committed = True
            self.registry.compact_journal(int(meta["registry_write_seq"]), step)  # it reflects the writes up to there
            keep = {str(step), prev}
            for name in os.listdir(self.snap_dir) if self.spread is None or self.spread.leader else []:
                if name not in keep:
                    shutil.rmtree(os.path.join(self.snap_dir, name), ignore_errors=True)
        except BaseException as err:
            self._remove_failed(step, committed)
            mapped = storage_error(err, self.snap_dir, f"snapshot {path}") if isinstance(err, Exception) else None
            self._failed(path, mapped or err)
            if reraise:
                if mapped is not None and mapped is not err:
                    raise mapped from err
                raise
            return {}
        c = self.counters
        if c["failures"]:
            log.info("snapshot %d succeeded after %d failed attempt(s)", step, c["failures"])
        self._retry_at = 0.0
        c.update(snapshots=c["snapshots"] + 1, last_step=step, last_duration_s=time.perf_counter() - t0,
                 last_capture_s=capture_s, last_bytes=sum(_nbytes(a) for a in tree.values()),
                 last_disk_bytes=_dir_bytes(path), last_error=None, failures=0)
        log.info("snapshot %d: %d segments, %.1f MB in %.2f s", step, len(meta["segments"]), c["last_bytes"] / 1e6,
                 c["last_duration_s"])
        return dict(step=step, segments=len(meta["segments"]), bytes=c["last_bytes"],
                    disk_bytes=c["last_disk_bytes"], duration_s=c["last_duration_s"], capture_s=capture_s)

    def _remove_failed(self, step: int, committed: bool) -> None:
        """Delete what a failed save of ``step`` left: its temporary folder, and the renamed
        step itself unless the registry committed it (a full disk must not fill up further)."""
        if self.spread is not None and not self.spread.leader:
            return
        try:
            names = os.listdir(self.snap_dir)
        except OSError:
            return
        for name in names:
            if name.startswith(f"{step}{TMP_SUFFIX}") or (name == str(step) and not committed):
                shutil.rmtree(os.path.join(self.snap_dir, name), ignore_errors=True)

    def _steps(self, include_tmp: bool = False) -> list[int]:
        out = []
        for name in os.listdir(self.snap_dir):
            base = name.split(TMP_SUFFIX)[0] if include_tmp else name
            if base.isdigit() and (include_tmp or os.path.exists(os.path.join(self.snap_dir, name,
                                                                                "commit_success.txt"))):
                out.append(int(base))
        return sorted(out)

    # -- restoring ------------------------------------------------------------------------
    def restore(self) -> None:
        try:
            self._restore()
        except BaseException:
            self.registry.close()
            self._closed = True
            raise

    def _committed_step(self) -> int | None:
        finals = self._steps()
        ptr = self.registry.get_meta("snapshot_step")
        if ptr is None:
            return finals[-1] if finals else None
        if int(ptr) in finals:
            return int(ptr)
        older = [s for s in finals if s < int(ptr)]
        log.warning("snapshot %s recorded in the registry is missing from %s; %s", ptr, self.snap_dir,
                    f"using the older snapshot {older[-1]}" if older else "recomputing every segment")
        return older[-1] if older else None

    def read_meta(self, path: str) -> dict:
        """A step's ``meta`` item; ``SnapshotCorrupt`` when it cannot be read."""
        try:
            meta = _checkpointer(alone=True).restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ValueError(f"meta is not an {FORMAT} record")
            self.meta_identity(meta)
        except Exception as err:  # noqa: BLE001 - any failure to read is corruption
            raise self._corrupt(path, f"its meta cannot be read ({type(err).__name__}: {err})") from err
        return meta

    @staticmethod
    def meta_identity(meta: dict) -> Identity:
        return Identity(meta["fingerprint"], meta["model"], meta["dtype"], int(meta["page_size"]))

    def _corrupt(self, path: str, what: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(
            f"snapshot {path} is unreadable: {what}. Nothing was restored. Restore the files, or delete {path} "
            "to start from the previous snapshot (segments it lacks are recomputed from the registry)")

    def _plan(self) -> tuple[list[SegmentRow], list[SegmentRow], int | None, str | None, dict | None]:
        """Restore 1-2 (module docstring), reading only (but unfinished temp steps go): the registry's
        rows, the rows the snapshot proves lost, the committed step, its path and meta (None when
        there is no step or it is another engine's and ``strict_restore`` is off)."""
        strict = self.kv.config.strict_restore
        for name in os.listdir(self.snap_dir):
            if TMP_SUFFIX in name:
                log.warning("removing unfinished snapshot %s (a save was interrupted)", name)
                shutil.rmtree(os.path.join(self.snap_dir, name), ignore_errors=True)
        recover(self)  # acknowledged writes the registry lost: redone from the journal, or refused
        rows = self.registry.rows()
        if self.registry.damaged:  # edited rows (their digest): dropped, never served
            self.kv.tiers.counters["integrity_errors_registry"] += len(self.registry.damaged)
            log.error("integrity error: %d row(s) of the segment registry %s no longer match their digest (edited "
                      "outside the engine): dropped, never served (%s); register them again",
                      len(self.registry.damaged), self.registry.path,
                      ", ".join(f"{ns}/{sid}" for ns, sid in self.registry.damaged[:5]))
        foreign = self.registry.foreign()
        if foreign is not None:
            other, count = foreign
            msg = (f"{self.registry.path} holds {count} segment(s) registered by another engine: "
                   f"{self.identity.mismatch(other)}")
            if strict:
                raise SnapshotMismatch(f"{msg}; use another snapshot_dir, or strict_restore=False to start "
                                       "without them")
            log.warning("%s; they are kept but not loaded", msg)
        step = self._committed_step()
        if step is None:
            return rows, [], None, None, None
        path = os.path.join(self.snap_dir, str(step))
        try:
            meta = self.read_meta(path)
        except SnapshotCorrupt as err:
            if self.spread is not None:
                raise
            self._damaged(path, f"its meta cannot be read ({err.__cause__ or err})", max(1, len(rows)))
            return rows, [], step, path, None
        other = self.meta_identity(meta)
        why = self.identity.mismatch(other)
        theirs, mine = int(meta.get("processes", 1)), self.spread.count if self.spread is not None else 1
        if why is None and theirs != mine and min(theirs, mine) > 1:  # one process reads any; P reads P's
            why = (f"it holds the shards of {theirs} processes and this engine runs in {mine} (restore it with "
                   f"{theirs} processes, or with one, which reads every shard)")
        if why is not None:
            msg = f"snapshot {path} was written by another engine: {why}"
            if strict:
                raise SnapshotMismatch(f"{msg}; point snapshot_dir elsewhere, or set strict_restore=False to "
                                       "start without its KV")
            log.warning("%s; starting without its KV (registered segments of this model are recomputed)", msg)
            return rows, [], step, path, None
        return rows, self._lost_rows(path, meta, rows), step, path, meta

    def _restore(self) -> None:
        e, sp = self.kv, self.spread
        t0 = time.perf_counter()
        if sp is None:
            rows, lost, step, path, meta = self._plan()
            arrays, rank = self._load(path, meta, rows + lost) if meta is not None else ({}, {})
            if meta is not None:
                self.counters["restored_step"] = step
        else:  # the leader plans, every process reads its own shards (snapshot_processes.py)
            plan = None
            if sp.leader:
                try:
                    plan = ("ok", self._plan(), self.registry.next_uid())
                except Exception as err:  # noqa: BLE001 - sent to the others, then raised here too
                    plan = ("error", err)
            plan = sp.agree(plan)
            if plan[0] == "error":
                raise plan[1]
            (rows, lost, step, path, meta), next_uid = plan[1], plan[2]
            if not sp.leader:  # the leader records the lost rows below; a mirror takes them now
                rows, lost = sorted(rows + lost, key=lambda r: r.uid), []
                self.registry.mirror(rows, next_uid, step)
            failure = None
            try:
                arrays, rank = self._load(path, meta, rows + lost) if meta is not None else ({}, {})
            except SnapshotCorrupt as err:
                failure, arrays, rank = err, {}, {}
            if not sp.all_ok(failure is None):
                raise failure or SnapshotCorrupt(
                    f"snapshot {path}: another process could not read or check its shards (its log names the "
                    "file). Nothing was restored. Restore the files, or delete the step to start from the "
                    "previous snapshot")
            if meta is not None:
                self.counters["restored_step"] = step
        t_read = time.perf_counter()
        # -- from here on the engine changes (everything above only read and checked) --
        if lost:
            self.registry.add_many(lost, f"rebuilding {len(lost)} segment(s) from snapshot {step}")
            log.warning("the segment registry %s held %d segment(s) but snapshot %s holds %d more, registered "
                        "before it and missing from the registry (an emptied or replaced registry file, or a lost "
                        "write-ahead log): rebuilt them from the snapshot (%s). Segments registered after that "
                        "snapshot cannot be rebuilt; per-segment metadata (precompute's text hashes) is not kept "
                        "in snapshots", self.registry.path, len(rows), path, len(lost),
                        ", ".join(repr(r.id) for r in lost[:5]) + (", ..." if len(lost) > 5 else ""))
            rows = sorted(rows + lost, key=lambda r: r.uid)
            self.counters["rebuilt"] = len(lost)
        e.store.reserve_uids(self.registry.next_uid())
        segs = []
        for row in rows:
            info = SegmentInfo(id=row.id, tenant=row.tenant, num_tokens=len(row.token_ids), public=row.public,
                               pin=row.pin, created=row.created, version=row.version, updated=row.updated)
            segs.append(e.store.restore(info, row.token_ids, row.uid))
        ntok = {seg.uid: len(e.bos_prefix) + len(seg.token_ids) for seg in segs}
        headroom = e.pool.num_pages // HEADROOM_FRACTION
        c = self.counters
        c["restore_compile_s"] = e.tiers.warm(a.shape[3] for a in arrays.values())  # one-time, timed apart
        for seg in segs:  # pinned: HBM, whatever it takes
            if seg.info.pin and seg.uid in arrays:
                e.tiers.place(seg, ntok[seg.uid], arrays[seg.uid], 0, e)
                c["restored_hbm"] += 1
        for seg in segs:  # registered after the snapshot (or not in it): recompute
            if seg.uid not in arrays:
                e.compute_root(seg)
                c["recomputed"] += 1
        rest = sorted((s for s in segs if s.uid in arrays and not s.info.pin), key=lambda s: rank[s.uid])
        for seg in rest:  # most recently used first
            c["restored_" + e.tiers.place(seg, ntok[seg.uid], arrays[seg.uid], headroom, e)] += 1
        jax.block_until_ready(e.runner.cache.k)
        t1 = time.perf_counter()
        nbytes = sum(a.nbytes for a in arrays.values())
        c.update(restore_s=t1 - t0, restore_read_s=t_read - t0, restore_bytes=nbytes)
        self._dirty = c["recomputed"] > 0
        if rows or step is not None:
            log.info("restored %d segments from %s (%d to HBM, %d to host, %d recomputed): %.1f MB in %.2f s",
                     len(segs), f"snapshot {step}" if step is not None else "the registry", c["restored_hbm"],
                     c["restored_host"], c["recomputed"], nbytes / 1e6, t1 - t0)

    def _lost_rows(self, path: str, meta: dict, rows: list[SegmentRow]) -> list[SegmentRow]:
        """The registry rows this snapshot proves were lost (module docstring, restore 2),
        rebuilt from its records and token ids; ``SnapshotCorrupt`` when it cannot rebuild them."""
        next_uid = self.registry.next_uid()
        have = {(r.namespace, r.id) for r in rows}
        try:
            recs = [r for r in meta["segments"] if int(r["uid"]) >= next_uid]
            clash = [r for r in recs if (r["namespace"], r["id"]) in have]
        except (KeyError, TypeError, ValueError) as err:
            raise self._corrupt(path, f"its segment records are malformed ({type(err).__name__}: {err})") from err
        for rec in clash:  # the registry's own row of that id wins
            log.warning("snapshot %s holds segment %r (uid %s) that the registry %s lacks, but the registry has "
                        "another segment of that id: keeping the registry's", path, rec["id"], rec["uid"],
                        self.registry.path)
        recs = [r for r in recs if r not in clash]
        if not recs:
            return []
        names = ", ".join(repr(r["id"]) for r in recs[:5]) + (", ..." if len(recs) > 5 else "")
        if any("tokens_at" not in r for r in recs):
            raise SnapshotCorrupt(
                f"the segment registry {self.registry.path} lacks {len(recs)} segment(s) that snapshot {path} holds "
                f"({names}), and that snapshot has no token ids to rebuild them (an older format). Nothing was "
                f"restored. Put back the registry file the snapshot was taken with, or move {self.snap_dir} aside "
                "to start with only the registry's segments")
        return self.snapshot_rows(path, recs)

    def snapshot_rows(self, path: str, recs: list[dict]) -> list[SegmentRow]:
        """Registry rows from the snapshot's segment records ``recs`` and its token ids (each
        checked against its digest); ``SnapshotCorrupt`` when they cannot be read."""
        e = self.kv
        try:
            if not recs:
                return []
            ids = _checkpointer(alone=True).restore(path, args=ocp.args.Composite(tokens=ocp.args.PyTreeRestore(
                restore_args={"ids": ocp.RestoreArgs(restore_type=np.ndarray)}))).tokens["ids"]
            out = []
            for rec in recs:
                lo, hi = rec["tokens_at"]
                tokens = [int(t) for t in ids[lo:hi]]
                if token_digest(e.bos_prefix + tokens) != rec["digest"]:
                    raise ValueError(f"the token ids of segment {rec['id']!r} do not match its digest")
                out.append(SegmentRow(rec["namespace"], rec["id"], int(rec["uid"]), rec["tenant"], tokens,
                                      bool(rec["public"]), bool(rec["pin"]), float(rec["created"]),
                                      version=int(rec.get("version", 1)), updated=float(rec.get("updated", 0.0))))
        except Exception as err:  # noqa: BLE001 - any failure to read is corruption
            raise self._corrupt(path, f"its token ids cannot be read ({type(err).__name__}: {err})") from err
        return out

    def _load(self, path: str, meta: dict, rows: list[SegmentRow]) -> tuple[dict[int, np.ndarray], dict[int, int]]:
        """Read the KV item and check every record a registry row needs.  One process: a record
        whose KV is missing, misshapen or fails its CRC-32 (or all of them, when the item cannot
        be read) is left out - that segment is recomputed from its token ids - with a logged,
        counted integrity error; never restored.  Across processes any failure is
        ``SnapshotCorrupt`` (every process must restore the same segments)."""
        e = self.kv
        try:
            records = {int(r["uid"]): r for r in meta["segments"]}
            want = {}
            for row in rows:
                rec = records.get(row.uid)
                tokens = e.bos_prefix + row.token_ids
                if (rec is not None and rec.get("key") and rec["namespace"] == row.namespace and rec["id"] == row.id
                        and rec["digest"] == token_digest(tokens)):
                    want[row.uid] = rec
            if not want:
                return {}, {}
            sp = self.spread
            restore_args = {r["key"]: ocp.RestoreArgs(restore_type=np.ndarray) if sp is None
                            else sp.restore_args(int(r["num_pages"])) for r in meta["segments"] if r.get("key")}
            kv = _checkpointer().restore(
                path, args=ocp.args.Composite(kv=ocp.args.PyTreeRestore(restore_args=restore_args))).kv
            if sp is not None and isinstance(kv, dict):  # global arrays -> this process's shards
                kv = {k: None if v is None else e.tiers.local(v) for k, v in kv.items()}
        except Exception as err:  # noqa: BLE001
            if self.spread is not None or not want:
                raise self._corrupt(path, f"its KV cannot be read ({type(err).__name__}: {err})") from err
            self._damaged(path, f"its KV cannot be read ({type(err).__name__}: {err})", len(want))
            return {}, {}
        arrays, rank = {}, {}
        present = [rec["key"] for rec in want.values() if isinstance(kv, dict) and kv.get(rec["key"]) is not None]
        sums = dict(zip(present, crc32_many([kv[k] for k in present])))
        for uid, rec in want.items():
            arr = kv.get(rec["key"]) if isinstance(kv, dict) else None
            shape = e.tiers.shape(int(rec["num_pages"]))
            if arr is None:
                why = f"segment {rec['id']!r} (uid {uid}) is listed but its KV is missing"
            elif tuple(arr.shape) != shape or arr.dtype != e.tiers.block_dtype:
                why = (f"segment {rec['id']!r} has KV of shape {tuple(arr.shape)} {arr.dtype}, expected {shape} "
                       f"{e.tiers.block_dtype}")
            elif not self._crc_ok(arr, sums[rec["key"]], rec["crc32"]):
                why = f"segment {rec['id']!r} fails its CRC-32 checksum"
            else:
                arrays[uid] = arr
                rank[uid] = int(rec["rank"])
                continue
            if self.spread is not None:
                raise self._corrupt(path, why)
            self._damaged(path, why, 1)
        return arrays, rank

    def _damaged(self, path: str, why: str, segments: int) -> None:
        """A damaged snapshot block (``_load``): logged, counted, recomputed - never restored."""
        self.kv.tiers.counters["integrity_errors_snapshot"] += segments
        log.error("integrity error: snapshot %s: %s; recomputing %d segment(s) from their token ids (they are not "
                  "restored from it)", path, why, segments)

    def _crc_ok(self, arr: np.ndarray, crc: int, want) -> bool:
        """``want``: one CRC-32 of the block, or (written by several processes) one per process's
        shards.  Across processes each checks its own; one process holds the whole block and checks
        each process's part of it (its kv heads, or the whole block when every process held every head)."""
        if not isinstance(want, list):
            return crc == int(want)
        if self.spread is not None:
            return crc == int(want[self.spread.index])
        if len(set(want)) == 1 and crc == int(want[0]):
            return True
        n = len(want)
        return arr.shape[2] % n == 0 and crc32_many(np.split(arr, n, axis=2)) == [int(c) for c in want]

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Finish any background write, take a final snapshot if segments changed, close the registry."""
        if self._closed:
            return
        try:
            self.wait()
            if self._dirty:
                self.save(wait=True)
        finally:
            self._closed = True
            self.registry.close()

    def stats(self) -> dict:
        c = dict(self.counters)
        busy = c["restore_s"] - c["restore_compile_s"]  # reading, checking and placing, without compiles
        c["restore_mb_s"] = c["restore_bytes"] / busy / 1e6 if busy > 0 and c["restore_bytes"] else 0.0
        c["dirty"] = self._dirty
        c["writing"] = self._writer is not None and self._writer.is_alive()
        return c


def _nbytes(a) -> int:
    """Bytes of a block as this process holds it (a global array across processes: its shards)."""
    return a.nbytes if isinstance(a, np.ndarray) else sum(s.data.nbytes for s in a.addressable_shards)


def _close_at_exit(ref) -> None:
    p = ref()
    if p is not None and not p._closed:
        try:
            p.close()
        except Exception as err:  # noqa: BLE001 - interpreter shutdown: log, never raise
            log.error("final snapshot at exit failed: %s", err)
