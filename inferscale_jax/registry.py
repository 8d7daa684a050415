"""The durable segment registry: one SQLite file, written before a registration is acknowledged.

``register_segment`` returns only after the segment's row -- id, tenant, namespace, uid, token
ids, chain parent, public/pin, creation time and the model identity -- is committed here, and
``delete_segment`` only after the row is gone.  The KV itself is not here (it is a cache of
the tokens: snapshots hold it, ``snapshot.py``); a row whose KV no snapshot holds is recomputed
from its token ids at startup, so an acknowledged segment survives ``kill -9``.

Durability: WAL journal with ``synchronous=FULL``, so every commit fsyncs the write-ahead log
before ``commit()`` returns; each write is one transaction (a crash leaves it whole or absent).

Schema
======

- ``segments``: one row per live segment, keyed by ``(fingerprint, namespace, id)``.  Rows carry
  their model identity (``fingerprint`` = model digest + dtype + page size, and the three parts
  separately), so one ``snapshot_dir`` can hold the segments of several models: an engine loads
  only its own rows, and a mismatch can name the part that differs.
- ``meta``: key/value pairs -- ``next_uid`` (uids are never reused, even across restarts, so
  a stale chain or snapshot entry can never be mistaken for a new segment) and
  ``snapshot_step`` (the last snapshot whose files were fsynced: the commit point that
  ``snapshot.py`` restores from).
- Versions: ``update_segment`` / ``append_segment`` (``segment_updates.py``) replace a row's
  ``uid``, ``token_ids``, ``version`` and ``updated`` in one transaction (``replace``), so after
  a crash the row is the old version or the new one, never a mix; the KV is keyed by uid, so a
  snapshot of the old version is never restored for the new one.  Files written before
  versions existed get the two columns added at open (``version`` 1).
- ``segment_meta``: optional key/value pairs per segment, keyed like ``segments`` plus ``key``
  and stamped with the segment's ``uid`` (a row whose uid is not the live segment's is stale
  and ignored).  ``precompute.py`` keeps each document's ``text_sha256`` here, so a re-run
  skips unchanged documents.  Deleting a segment deletes its meta rows in the same transaction.

The registry is shared by the engine thread and the snapshot writer thread (which records
``snapshot_step``); a lock serializes them.

Damage and full storage
=======================

Opening runs ``PRAGMA quick_check``; a file that is not a database or fails the check raises
``SnapshotCorrupt`` naming the file and the fix (move it aside: ``snapshot.py`` then rebuilds
the rows from the newest snapshot).

SQLite cannot see what its own damage hides: a write-ahead log deleted, truncated or changed
after a crash loses the transactions in it *silently* (their frames fail SQLite's checksums and
are ignored), and an edited row is valid SQL.  So:

- every segment write transaction also advances ``meta.write_seq``, and before its COMMIT the
  write is appended to ``registry.sqlite3.journal`` (``journal.py``: one checksummed line per
  write with what it takes to redo it, fsynced; a failed COMMIT cuts the line off again).  Opening a registry
  whose ``write_seq`` is below the journal's last acknowledged write sets ``lost_writes``; the
  restore (``snapshot.py``, ``recover``) then redoes the missing writes from the journal, on
  this registry or on the newest snapshot's rows when the journal no longer reaches back to
  this registry's state (it is compacted to what the committed snapshot lacks).  When some
  write can be redone from neither, the start is refused naming each lost write by id (or by
  its damaged journal line) and the fix; ``repair=True`` (``serve --repair``) rebuilds what
  can be rebuilt and reports the rest as lost, by id.  A registry file that fails its check
  is moved aside by ``repair`` and rebuilt the same way.  A journal deleted with nothing to
  compare against starts again from this registry;
- the registry's log is copied into its main file only by ``checkpoint`` (SQLite's automatic
  checkpoints are off): at each snapshot's commit and every ``CHECKPOINT_EVERY`` writes.  A crash
  in the middle of a checkpoint leaves the main file a mix of old and new pages that only the
  log can mend, so a marker file (``registry.sqlite3.checkpointing``) exists for the checkpoint's
  duration.  Opening with the marker present sets ``checkpoint_cut``: the restore
  (``recovery.py``) then rebuilds the rows from the snapshot the journal's header names and the
  journal's records, whatever the file says (a file that fails its check is moved aside for it);
- every row carries ``digest`` (SHA-256 of its namespace, id, uid, tenant, token ids, parent,
  flags and version).  ``rows()`` leaves out a row whose digest does not match (an edited
  row), deletes it and counts it in ``damaged`` (the caller logs it and counts an integrity
  error): it is never served with tokens nobody registered.  Rows from before digests existed
  (NULL) are not checked.  A write that fails because the folder is full or read-only
(``database or disk is full``, ``attempt to write a readonly database``, ENOSPC, EROFS,
EDQUOT) raises ``StorageError`` naming the folder; the transaction is rolled back (or was
already rolled back by SQLite), so the registry holds the write whole or not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time

import numpy as np

from inferscale_jax.errors import SnapshotCorrupt, SnapshotInUse, StorageError
from inferscale_jax.journal import Contents, Journal, decode_tokens, encode_tokens, fsync_dir

log = logging.getLogger("inferscale.snapshot")

CHECKPOINT_EVERY = 1000  # segment writes between checkpoints of the registry's log (besides snapshots)
LOCK_WAIT_S = 60.0  # how long a new engine waits for the snapshot folder's previous holder to exit
STORAGE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
STORAGE_MESSAGES = ("database or disk is full", "attempt to write a readonly database",
                    "no space left on device", "read-only file system", "disk quota exceeded")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    fingerprint TEXT NOT NULL,   -- combined model identity (Engine.fingerprint)
    model TEXT NOT NULL,         -- model digest: config + weights
    dtype TEXT NOT NULL,
    page_size INTEGER NOT NULL,
    namespace TEXT NOT NULL,     -- the tenant, or the public namespace
    id TEXT NOT NULL,
    uid INTEGER NOT NULL,
    tenant TEXT NOT NULL,        -- the registering tenant
    token_ids BLOB NOT NULL,     -- little-endian int32
    parent TEXT,                 -- chain parent segment id (NULL: a root segment)
    public INTEGER NOT NULL,
    pin INTEGER NOT NULL,
    created REAL NOT NULL,
    version INTEGER NOT NULL DEFAULT 1,  -- 1 at registration, +1 per update / append
    updated REAL NOT NULL DEFAULT 0,     -- when this version was acknowledged (0: never updated)
    digest TEXT,                         -- row_digest() of the row (NULL: written before digests)
    PRIMARY KEY (fingerprint, namespace, id)
);
CREATE TABLE IF NOT EXISTS segment_meta (
    fingerprint TEXT NOT NULL,
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    uid INTEGER NOT NULL,        -- the segment the value was recorded for
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (fingerprint, namespace, id, key)
);
"""


def storage_error(err: BaseException, folder: str, what: str) -> StorageError | None:
    """``err`` (or an exception it was raised from) as a ``StorageError`` naming ``folder`` when
    it says the storage is full or read-only; ``None`` for any other error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, StorageError):
            return err
        text = str(err).lower()
        if ((isinstance(err, OSError) and err.errno in STORAGE_ERRNOS)
                or (isinstance(err, (OSError, sqlite3.Error, ValueError, RuntimeError))
                    and any(m in text for m in STORAGE_MESSAGES))):
            mapped = StorageError(
                f"{what} failed: the storage of {folder} is full or read-only ({type(err).__name__}: {err}). "
                f"Free space on that file system or make {folder} writable (or move the folder elsewhere)")
            mapped.errno = err.errno if isinstance(err, OSError) and err.errno else (
                errno.EROFS if "read" in text else errno.ENOSPC)
            return mapped
        err = err.__cause__ or err.__context__
    return None


def _exclusive(path: str, wait_s: float = LOCK_WAIT_S) -> int:
    """An exclusive ``flock`` on ``path`` (holding this process's pid), waited for up to ``wait_s``
    (a restart may find the previous server finishing its last snapshot); ``SnapshotInUse``
    naming the holder after that.  Released when the fd closes or the process dies."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise storage_error(err, os.path.dirname(path), f"opening {path}") or err
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise SnapshotInUse(
                    f"the snapshot folder {os.path.dirname(path)} is in use by another engine (pid {holder}; "
                    f"{os.path.basename(path)} is locked): two engines writing one registry would corrupt it. "
                    f"Stop that one first, or give this engine another snapshot_dir") from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class RedoFailed(Exception):
    """``Registry.redo`` could not redo some writes (``failed``, each described by id)."""

    def __init__(self, failed: list[str]):
        super().__init__("; ".join(failed))
        self.failed = failed


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a snapshot or a registry row must match: the engine's model, dtype and page size."""
    fingerprint: str
    model: str
    dtype: str
    page_size: int

    def mismatch(self, other: "Identity") -> str | None:
        """Name the first differing part (``None`` when they match), for ``SnapshotMismatch``."""
        if self.model != other.model:
            return f"model fingerprint {other.model[:16]}... differs from this engine's {self.model[:16]}..."
        if self.dtype != other.dtype:
            return f"dtype {other.dtype} differs from this engine's {self.dtype}"
        if self.page_size != other.page_size:
            return f"page size {other.page_size} differs from this engine's {self.page_size}"
        if self.fingerprint != other.fingerprint:
            return f"fingerprint {other.fingerprint[:16]}... differs from this engine's {self.fingerprint[:16]}..."
        return None


def row_digest(namespace: str, segment_id: str, uid: int, tenant: str, token_blob: bytes, parent: str | None,
               public: bool, pin: bool, version: int) -> str:
    """The digest a row carries: SHA-256 over its identity, its token ids (int32 LE) and its flags."""
    head = json.dumps([namespace, segment_id, uid, tenant, parent, bool(public), bool(pin), version]).encode()
    return hashlib.sha256(len(head).to_bytes(4, "little") + head + token_blob).hexdigest()


@dataclasses.dataclass(frozen=True)
class SegmentRow:
    namespace: str
    id: str
    uid: int
    tenant: str
    token_ids: list[int]
    public: bool
    pin: bool
    created: float
    parent: str | None = None
    version: int = 1
    updated: float = 0.0

    def record(self) -> dict:
        """This row as a journal record's ``row`` (token ids base64 int32)."""
        return dict(ns=self.namespace, id=self.id, uid=self.uid, tenant=self.tenant,
                    tokens=encode_tokens(self.token_ids), public=self.public, pin=self.pin, created=self.created,
                    parent=self.parent, version=self.version, updated=self.updated)

    @classmethod
    def from_record(cls, r: dict) -> "SegmentRow":
        return cls(r["ns"], r["id"], int(r["uid"]), r["tenant"], decode_tokens(r["tokens"]), bool(r["public"]),
                   bool(r["pin"]), float(r["created"]), r.get("parent"), int(r["version"]), float(r["updated"]))


def describe(rec: dict) -> str:
    """One journal record in words, for logs and errors: the write and the segment it names."""
    op = rec.get("op")
    if op == "add":
        return "; ".join(f"write {rec['seq']}: registered {r['ns']}/{r['id']} (version {r['version']})"
                         for r in rec["rows"])
    if op == "replace":
        r = rec["row"]
        return f"write {rec['seq']}: version {r['version']} of {r['ns']}/{r['id']}"
    if op == "delete":
        return f"write {rec['seq']}: deleted " + ", ".join(f"{ns}/{sid}" for ns, sid in rec["keys"])
    if op == "meta":
        return f"write {rec['seq']}: {rec['key']!r} of {len(rec['entries'])} segment(s)"
    return f"write {rec.get('seq')}: {op}"


class Registry:
    def __init__(self, path: str, identity: Identity, repair: bool = False):
        self.path, self.identity = path, identity
        self.folder = os.path.dirname(os.path.abspath(path))
        self._lock = threading.Lock()
        self._db = None
        self.damaged: list[tuple[str, str]] = []  # (namespace, id) of rows rows() found edited and dropped
        self.journal = Journal(path + ".journal")
        self.moved_aside: str | None = None  # repair: where a damaged registry file went
        self.marker = path + ".checkpointing"  # exists while a checkpoint runs (module docstring)
        self._since_checkpoint = 0
        self._lock_fd = _exclusive(path + ".lock")
        # a checkpoint was cut short by a crash: the main file may mix old and new pages
        self.checkpoint_cut = os.path.exists(self.marker)
        try:
            try:
                self._open(path)
            except SnapshotCorrupt:
                if not (repair or self.checkpoint_cut and self._rebuildable()):
                    raise
                stamp = time.strftime("%Y%m%d-%H%M%S")
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(path + suffix):
                        os.replace(path + suffix, f"{path}{suffix}.damaged-{stamp}")
                self.moved_aside = f"{path}.damaged-{stamp}"
                self._open(path)
        except BaseException:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise

    def _open(self, path: str) -> None:
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA wal_autocheckpoint=0")  # only ``checkpoint`` copies the log
            problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
            self._db.executescript(SCHEMA)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(segments)").fetchall()}
            for column, decl in (("version", "INTEGER NOT NULL DEFAULT 1"), ("updated", "REAL NOT NULL DEFAULT 0"),
                                 ("digest", "TEXT")):
                if column not in have:  # a file from before segment versions / row digests
                    self._db.execute(f"ALTER TABLE segments ADD COLUMN {column} {decl}")
            self.journaled: Contents = self.journal.read()
            have = self._write_seq()
            # acknowledged writes this file lacks (0: none, or nothing to compare with)
            self.lost_writes = max(0, self.journaled.acked - have) if self.journaled.exists else 0
            if not self.journaled.exists:
                self.journal.reset(have)  # nothing to compare with: the count starts from this file
                self.journaled = self.journal.read()
            elif have > self.journaled.acked:  # the journal lost its last lines (cut or replaced): these
                self.journal.append(dict(seq=have, op="sync", first=self.journaled.acked + 1))  # are the file's
                self.journaled = self.journal.read()
        except OSError as err:
            if self._db is not None:
                self._db.close()
            raise storage_error(err, self.folder, f"opening the journal {self.journal.path}") or err
        except sqlite3.Error as err:
            if self._db is not None:
                self._db.close()
            mapped = storage_error(err, self.folder, f"opening the segment registry {path}")
            if mapped is None and isinstance(err, sqlite3.OperationalError) and not os.access(self.folder, os.W_OK):
                mapped = storage_error(OSError(errno.EROFS, "read-only file system"), self.folder,
                                       f"opening the segment registry {path}")
            if mapped is not None:
                raise mapped from err
            if isinstance(err, sqlite3.OperationalError):  # locked, unopenable: not damage
                raise
            raise SnapshotCorrupt(
                f"the segment registry {path} is damaged ({type(err).__name__}: {err}). Move it aside "
                f"together with its -wal and -shm files (e.g. rename them to *.bad); the next start rebuilds "
                f"the segments from the newest snapshot in {os.path.join(self.folder, 'snapshots')}") from err

    def _rebuildable(self) -> bool:
        """Whether the journal can rebuild the rows whole: its base is a snapshot's, or the
        journal starts at the registry's first write."""
        contents = self.journal.read()
        return contents.step is not None or (contents.exists and contents.base == 0)

    def _write_seq(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'write_seq'").fetchone()
        return int(row[0]) if row else 0

    def write_seq(self) -> int:
        """Segment writes committed so far (``meta.write_seq``)."""
        with self._lock:
            return self._write_seq()

    def contents(self) -> list[SegmentRow]:
        """Every row of this engine, digests unchecked (for a rebuild's base)."""
        with self._lock:
            cur = self._db.execute("SELECT namespace, id, uid, tenant, token_ids, public, pin, created, parent, "
                                   "version, updated FROM segments WHERE fingerprint = ?", (self.identity.fingerprint,))
            return [SegmentRow(ns, sid, uid, t, np.frombuffer(blob, "<i4").tolist(), bool(pub), bool(pin), c, par,
                               v, u) for ns, sid, uid, t, blob, pub, pin, c, par, v, u in cur.fetchall()]

    def redo(self, base: list[SegmentRow] | None, base_seq: int, records: list[dict],
             allow_failures: bool = False) -> list[str]:
        """Recovery (module docstring, "Damage"), one transaction: with ``base`` (a snapshot's rows
        at write ``base_seq``) this engine's rows become exactly those first; then ``records`` (the
        journal's, in seq order) are redone.  ``write_seq`` ends at the journal's last acknowledged
        write, which clears ``lost_writes``.  Returns the writes that could not be redone (their
        segment absent or present against the record), each described by id; unless
        ``allow_failures``, any such write raises ``RedoFailed`` and nothing is changed."""
        fp, failed = self.identity.fingerprint, []
        with self._transaction("redoing acknowledged writes from the journal", record=None) as db:
            if base is not None:
                db.execute("DELETE FROM segments WHERE fingerprint = ?", (fp,))
                db.execute("DELETE FROM segment_meta WHERE fingerprint = ?", (fp,))
                self._insert(db, base)
                if base:
                    self._advance_uid(db, max(r.uid for r in base))
            for rec in records:
                op = rec.get("op")
                if op == "add":
                    rows = [SegmentRow.from_record(r) for r in rec["rows"]]
                    clash = [r for r in rows if db.execute(
                        "SELECT 1 FROM segments WHERE fingerprint = ? AND namespace = ? AND id = ?",
                        (fp, r.namespace, r.id)).fetchone()]
                    for r in clash:
                        failed.append(f"write {rec['seq']}: registered {r.namespace}/{r.id}, but that id is taken")
                    if len(clash) < len(rows):
                        self._insert(db, [r for r in rows if r not in clash])
                    self._advance_uid(db, max(r.uid for r in rows))
                elif op == "replace":
                    row = SegmentRow.from_record(rec["row"])
                    if not self._replace_row(db, rec["old_uid"], row):
                        failed.append(describe(rec) + ", but the version it replaces is absent")
                        self._advance_uid(db, row.uid)  # (its uid was handed out: never again)
                elif op == "delete":
                    for ns, sid in rec["keys"]:
                        self._delete_row(db, ns, sid)
                elif op == "meta":
                    self._set_segment_meta(db, rec["key"], [tuple(e) for e in rec["entries"]])
            if failed and not allow_failures:
                raise RedoFailed(failed)  # rolled back
            db.execute("INSERT INTO meta VALUES ('write_seq', ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (str(max(self.journaled.acked, base_seq)),))
        self.lost_writes = 0
        return failed

    @contextlib.contextmanager
    def _transaction(self, what: str, record: dict | None):
        """One fsynced write transaction under the lock.  A segment write passes its journal
        ``record``: the transaction advances ``write_seq``, and the record (with that ``seq``) is
        appended to the journal before the COMMIT.  Storage failures become ``StorageError``."""
        counted = record is not None
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    if counted:
                        seq = self._write_seq() + 1
                        self._db.execute("INSERT INTO meta VALUES ('write_seq', ?) ON CONFLICT(key) DO UPDATE SET "
                                         "value = excluded.value", (str(seq),))
                        try:  # the journal line before the COMMIT (module docstring, "Damage")
                            at = self.journal.append(dict(seq=seq, **record))
                        except OSError as err:
                            raise storage_error(err, self.folder, f"{what}: journaling write {seq}") or err
                    try:
                        self._db.execute("COMMIT")
                    except BaseException:
                        if counted:
                            self._unjournal(at, seq, what)
                        raise
                    if counted:
                        self._since_checkpoint += 1
                        if self._since_checkpoint >= CHECKPOINT_EVERY:
                            self._checkpoint()
                except BaseException:
                    if self._db.in_transaction:  # a failed COMMIT may have rolled back already
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as err:
                mapped = storage_error(err, self.folder, f"{what} in the segment registry {self.path}")
                if mapped is not None:
                    raise mapped from err
                raise

    def _unjournal(self, at: int, seq: int, what: str) -> None:
        """The COMMIT of write ``seq`` failed: its journal line (from byte ``at``) goes, so no
        restart redoes a write that was refused.  If even that fails, the error says so."""
        try:
            self.journal.drop_from(at)
        except OSError as err:
            log.error("%s: the COMMIT of write %d failed and its journal line could not be removed from %s (%s): a "
                      "restart would redo that write", what, seq, self.journal.path, err)

    # -- reads ----------------------------------------------------------------------------
    def rows(self) -> list[SegmentRow]:
        """This engine's segments (its fingerprint), oldest uid first."""
        with self._lock:
            cur = self._db.execute(
                "SELECT namespace, id, uid, tenant, token_ids, public, pin, created, parent, version, updated, digest "
                "FROM segments WHERE fingerprint = ? ORDER BY uid", (self.identity.fingerprint,))
            good, bad = [], []
            for ns, sid, uid, tenant, blob, pub, pin, created, parent, version, updated, digest in cur.fetchall():
                if digest is not None and digest != row_digest(ns, sid, uid, tenant, blob, parent, pub, pin, version):
                    bad.append((ns, sid))
                    continue
                good.append(SegmentRow(ns, sid, uid, tenant, np.frombuffer(blob, "<i4").tolist(), bool(pub),
                                       bool(pin), created, parent, version, updated))
        if bad:
            with self._transaction(f"dropping {len(bad)} damaged row(s)",
                                   dict(op="delete", keys=[list(k) for k in bad])) as db:
                for ns, sid in bad:
                    self._delete_row(db, ns, sid)
            self.damaged += bad
        return good

    def foreign(self) -> tuple[Identity, int] | None:
        """The identity of rows written by another model / dtype / page size, and their count."""
        with self._lock:
            row = self._db.execute(
                "SELECT fingerprint, model, dtype, page_size, COUNT(*) FROM segments WHERE fingerprint != ? "
                "GROUP BY fingerprint ORDER BY COUNT(*) DESC LIMIT 1", (self.identity.fingerprint,)).fetchone()
        return None if row is None else (Identity(*row[:4]), row[4])

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def segment_meta(self, key: str) -> dict[tuple[str, str], tuple[int, str]]:
        """``(namespace, id) -> (uid, value)`` of this engine's segment meta rows for ``key``."""
        with self._lock:
            cur = self._db.execute("SELECT namespace, id, uid, value FROM segment_meta WHERE fingerprint = ? "
                                   "AND key = ?", (self.identity.fingerprint, key))
            return {(ns, sid): (uid, value) for ns, sid, uid, value in cur.fetchall()}

    def next_uid(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'next_uid'").fetchone()
            top = self._db.execute("SELECT MAX(uid) FROM segments").fetchone()[0] or 0
        return max(int(row[0]) if row else 1, top + 1)

    # -- writes (each one fsynced transaction) --------------------------------------------
    def add(self, row: SegmentRow) -> None:
        self.add_many([row], f"recording segment {row.id!r}")

    def add_many(self, rows: list[SegmentRow], what: str = "recording segments") -> None:
        """Insert ``rows`` and advance ``next_uid`` past them, in one transaction."""
        with self._transaction(what, dict(op="add", rows=[r.record() for r in rows])) as db:
            self._insert(db, rows)
            self._advance_uid(db, max(row.uid for row in rows))

    def _insert(self, db, rows: list[SegmentRow]) -> None:
        ident = self.identity
        values = []
        for row in rows:
            blob = np.asarray(row.token_ids, "<i4").tobytes()
            values.append((ident.fingerprint, ident.model, ident.dtype, ident.page_size, row.namespace, row.id,
                           row.uid, row.tenant, blob, row.parent, int(row.public), int(row.pin), row.created,
                           row.version, row.updated,
                           row_digest(row.namespace, row.id, row.uid, row.tenant, blob, row.parent, row.public,
                                      row.pin, row.version)))
        db.executemany(
            "INSERT INTO segments (fingerprint, model, dtype, page_size, namespace, id, uid, tenant, token_ids, "
            "parent, public, pin, created, version, updated, digest) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)

    @staticmethod
    def _advance_uid(db, uid: int) -> None:
        db.execute(
            "INSERT INTO meta VALUES ('next_uid', ?) ON CONFLICT(key) DO UPDATE SET "
            "value = MAX(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER))", (str(uid + 1),))

    def mirror(self, rows: list[SegmentRow], next_uid: int, snapshot_step: int | None) -> None:
        """Make this engine's rows exactly ``rows``, with ``next_uid`` and ``snapshot_step``, in one
        transaction: a follower's copy of the leader's registry across processes
        (``snapshot_processes.py``).  Segment meta rows of this engine go."""
        fp = self.identity.fingerprint
        with self._transaction("mirroring the leader's segments", record=None) as db:
            db.execute("DELETE FROM segments WHERE fingerprint = ?", (fp,))
            db.execute("DELETE FROM segment_meta WHERE fingerprint = ?", (fp,))
            self._insert(db, rows)
            db.execute("INSERT INTO meta VALUES ('next_uid', ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (str(next_uid),))
            if snapshot_step is None:
                db.execute("DELETE FROM meta WHERE key = 'snapshot_step'")
            else:
                db.execute("INSERT INTO meta VALUES ('snapshot_step', ?) ON CONFLICT(key) DO UPDATE SET "
                           "value = excluded.value", (str(snapshot_step),))
            self.journal.reset(self._write_seq())  # the leader's journal is the record; this copy starts over
            self.journaled, self.lost_writes = self.journal.read(), 0

    def replace(self, old_uid: int, row: SegmentRow) -> None:
        """A new version of a segment: the row ``(namespace, id)`` recorded with ``old_uid`` takes
        ``row``'s uid, token ids, version and update time, and its meta rows go (they describe the
        old version), in one fsynced transaction.  ``KeyError`` if no such row (it was deleted or
        replaced meanwhile: nothing is written)."""
        with self._transaction(f"recording version {row.version} of segment {row.id!r}",
                               dict(op="replace", old_uid=old_uid, row=row.record())) as db:
            if not self._replace_row(db, old_uid, row):
                raise KeyError(f"segment {row.id!r} (uid {old_uid}) is not in the registry")

    def _replace_row(self, db, old_uid: int, row: SegmentRow) -> bool:
        """``replace``'s statements (also ``redo``'s); False when no row of that uid exists."""
        key = (self.identity.fingerprint, row.namespace, row.id)
        blob = np.asarray(row.token_ids, "<i4").tobytes()
        old = db.execute("SELECT tenant, parent, public, pin FROM segments WHERE fingerprint = ? AND namespace = ? "
                         "AND id = ? AND uid = ?", (*key, old_uid)).fetchone()
        if old is None:
            return False
        digest = row_digest(row.namespace, row.id, row.uid, old[0], blob, old[1], old[2], old[3], row.version)
        cur = db.execute(
            "UPDATE segments SET uid = ?, token_ids = ?, version = ?, updated = ?, digest = ? "
            "WHERE fingerprint = ? AND namespace = ? AND id = ? AND uid = ?",
            (row.uid, blob, row.version, row.updated, digest, *key, old_uid))
        if cur.rowcount != 1:
            return False
        db.execute("DELETE FROM segment_meta WHERE fingerprint = ? AND namespace = ? AND id = ?", key)
        self._advance_uid(db, row.uid)
        return True

    def delete(self, namespace: str, segment_id: str) -> None:
        with self._transaction(f"deleting segment {segment_id!r}", dict(op="delete", keys=[[namespace, segment_id]])) \
                as db:
            self._delete_row(db, namespace, segment_id)

    def _delete_row(self, db, namespace: str, segment_id: str) -> None:
        key = (self.identity.fingerprint, namespace, segment_id)
        db.execute("DELETE FROM segments WHERE fingerprint = ? AND namespace = ? AND id = ?", key)
        db.execute("DELETE FROM segment_meta WHERE fingerprint = ? AND namespace = ? AND id = ?", key)

    def set_segment_meta(self, key: str, entries: list[tuple[str, str, int, str]]) -> None:
        """Record ``key`` for many segments, ``entries`` = ``(namespace, id, uid, value)``, in one
        fsynced transaction (the value replaces any earlier one)."""
        with self._transaction(f"recording {key!r} of {len(entries)} segment(s)",
                               dict(op="meta", key=key, entries=[list(e) for e in entries])) as db:
            self._set_segment_meta(db, key, entries)

    def _set_segment_meta(self, db, key: str, entries) -> None:
        fp = self.identity.fingerprint
        db.executemany(
            "INSERT INTO segment_meta VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(fingerprint, namespace, id, key) "
            "DO UPDATE SET uid = excluded.uid, value = excluded.value",
            [(fp, ns, sid, uid, key, value) for ns, sid, uid, value in entries])

    def set_meta(self, key: str, value: str) -> None:
        with self._transaction(f"recording {key}={value}", record=None) as db:
            db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (key, value))

    def compact_journal(self, base: int, step: int) -> None:
        """Snapshot ``step``, reflecting every write up to ``base``, committed: the registry's log
        is checkpointed into its main file, and the journal keeps only the later writes."""
        with self._lock:
            try:
                self._checkpoint()
                self.journal.compact(base, step)
                self.journaled = self.journal.read()
            except (OSError, sqlite3.Error) as err:
                raise storage_error(err, self.folder, f"compacting the journal {self.journal.path}") or err

    def checkpoint(self) -> None:
        with self._lock:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Copy the log into the main file, inside the marker's lifetime (module docstring)."""
        with open(self.marker, "wb") as f:
            os.fsync(f.fileno())
        fsync_dir(self.folder)
        busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:  # (one connection per registry: a reader cannot hold it; keep the marker if so)
            raise sqlite3.OperationalError(f"the checkpoint of {self.path} could not finish (busy)")
        os.remove(self.marker)
        fsync_dir(self.folder)
        self._since_checkpoint = 0
        self.checkpoint_cut = False

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # (releases the folder)
                self._lock_fd = None
