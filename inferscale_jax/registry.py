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

- every segment write transaction also advances ``meta.write_seq``, and after its COMMIT the
  new value is written to ``registry.sqlite3.seq`` beside the file (fsynced).  Opening an
  existing registry whose ``write_seq`` is below that file's sets ``lost_writes``; the restore
  (``snapshot.py``) then rebuilds from the newest snapshot when that snapshot was taken after
  the last acknowledged write (its meta records ``write_seq``), and otherwise refuses to start (``SnapshotCorrupt``) counting the acknowledged writes
  missing and naming the two ways on (restore the files; or accept the loss by deleting the
  ``.seq`` file).  A registry created anew (the file deleted with its log) starts the count
  again;
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
import hashlib
import json
import os
import sqlite3
import threading

import numpy as np

from inferscale_jax.errors import SnapshotCorrupt, StorageError

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


class Registry:
    def __init__(self, path: str, identity: Identity):
        self.path, self.identity = path, identity
        self.folder = os.path.dirname(os.path.abspath(path))
        self._lock = threading.Lock()
        self._db = None
        self.damaged: list[tuple[str, str]] = []  # (namespace, id) of rows rows() found edited and dropped
        self.seq_path = path + ".seq"
        existed = os.path.exists(path)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
            self._db.executescript(SCHEMA)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(segments)").fetchall()}
            for column, decl in (("version", "INTEGER NOT NULL DEFAULT 1"), ("updated", "REAL NOT NULL DEFAULT 0"),
                                 ("digest", "TEXT")):
                if column not in have:  # a file from before segment versions / row digests
                    self._db.execute(f"ALTER TABLE segments ADD COLUMN {column} {decl}")
            self.acked_seq = self._acknowledged_seq()
            have = self._write_seq()
            # acknowledged writes this file lacks (0: none, or nothing to compare with)
            self.lost_writes = (self.acked_seq - have if existed and self.acked_seq is not None
                                and have < self.acked_seq else 0)
            if not self.lost_writes and self.acked_seq != have:
                self._record_seq(have)
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

    def _write_seq(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'write_seq'").fetchone()
        return int(row[0]) if row else 0

    def _acknowledged_seq(self) -> int | None:
        try:
            with open(self.seq_path) as f:
                return int(f.read().strip() or 0)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None  # unreadable: the check is skipped (the registry itself is intact)

    def _record_seq(self, seq: int) -> None:
        """``seq`` into the ``.seq`` file, fsynced (after the COMMIT that reached it)."""
        tmp = self.seq_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(seq))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.seq_path)

    def lost_writes_error(self) -> SnapshotCorrupt:
        """The refusal for ``lost_writes`` (module docstring, "Damage")."""
        return SnapshotCorrupt(
            f"the segment registry {self.path} is missing the last {self.lost_writes} acknowledged write(s) (it "
            f"holds write {self._write_seq()}, {os.path.basename(self.seq_path)} says {self.acked_seq} were "
            f"acknowledged): its write-ahead log {self.path}-wal was deleted, truncated or damaged after a crash, "
            f"so segments registered, updated or deleted last would be silently absent or reverted. Restore the "
            f"three registry files from a backup; or accept the loss: delete {self.seq_path} and start again (the "
            f"newest snapshot then rebuilds the segments it holds that the registry lacks, with a warning)")

    def write_seq(self) -> int:
        """Segment writes committed so far (``meta.write_seq``)."""
        with self._lock:
            return self._write_seq()

    def accept_loss(self) -> None:
        """The restore rebuilt what was lost: the current count becomes the acknowledged one."""
        with self._lock:
            self._record_seq(self._write_seq())
        self.lost_writes = 0

    @contextlib.contextmanager
    def _transaction(self, what: str, counted: bool = True):
        """One fsynced write transaction under the lock; ``counted`` (a segment write): advancing
        ``write_seq``, recorded in the ``.seq`` file once committed.  Storage failures become
        ``StorageError``."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    seq = self._write_seq() + 1 if counted else None
                    if counted:
                        self._db.execute("INSERT INTO meta VALUES ('write_seq', ?) ON CONFLICT(key) DO UPDATE SET "
                                         "value = excluded.value", (str(seq),))
                    self._db.execute("COMMIT")
                    if counted and not self.lost_writes:  # (while lost, the file keeps what was acknowledged)
                        try:
                            self._record_seq(seq)
                        except OSError as err:
                            raise storage_error(err, self.folder, f"{what}: recording write {seq}") or err
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
            with self._transaction(f"dropping {len(bad)} damaged row(s)") as db:
                for ns, sid in bad:
                    db.execute("DELETE FROM segments WHERE fingerprint = ? AND namespace = ? AND id = ?",
                               (self.identity.fingerprint, ns, sid))
                    db.execute("DELETE FROM segment_meta WHERE fingerprint = ? AND namespace = ? AND id = ?",
                               (self.identity.fingerprint, ns, sid))
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
        with self._transaction(what) as db:
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
        with self._transaction("mirroring the leader's segments") as db:
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

    def replace(self, old_uid: int, row: SegmentRow) -> None:
        """A new version of a segment: the row ``(namespace, id)`` recorded with ``old_uid`` takes
        ``row``'s uid, token ids, version and update time, and its meta rows go (they describe the
        old version), in one fsynced transaction.  ``KeyError`` if no such row (it was deleted or
        replaced meanwhile: nothing is written)."""
        key = (self.identity.fingerprint, row.namespace, row.id)
        blob = np.asarray(row.token_ids, "<i4").tobytes()
        with self._transaction(f"recording version {row.version} of segment {row.id!r}") as db:
            old = db.execute("SELECT tenant, parent, public, pin FROM segments WHERE fingerprint = ? AND namespace = ? "
                             "AND id = ? AND uid = ?", (*key, old_uid)).fetchone()
            if old is None:
                raise KeyError(f"segment {row.id!r} (uid {old_uid}) is not in the registry")
            digest = row_digest(row.namespace, row.id, row.uid, old[0], blob, old[1], old[2], old[3], row.version)
            cur = db.execute(
                "UPDATE segments SET uid = ?, token_ids = ?, version = ?, updated = ?, digest = ? "
                "WHERE fingerprint = ? AND namespace = ? AND id = ? AND uid = ?",
                (row.uid, blob, row.version, row.updated, digest, *key, old_uid))
            if cur.rowcount != 1:
                raise KeyError(f"segment {row.id!r} (uid {old_uid}) is not in the registry")
            db.execute("DELETE FROM segment_meta WHERE fingerprint = ? AND namespace = ? AND id = ?", key)
            self._advance_uid(db, row.uid)

    def delete(self, namespace: str, segment_id: str) -> None:
        key = (self.identity.fingerprint, namespace, segment_id)
        with self._transaction(f"deleting segment {segment_id!r}") as db:
            db.execute("DELETE FROM segments WHERE fingerprint = ? AND namespace = ? AND id = ?", key)
            db.execute("DELETE FROM segment_meta WHERE fingerprint = ? AND namespace = ? AND id = ?", key)

    def set_segment_meta(self, key: str, entries: list[tuple[str, str, int, str]]) -> None:
        """Record ``key`` for many segments, ``entries`` = ``(namespace, id, uid, value)``, in one
        fsynced transaction (the value replaces any earlier one)."""
        fp = self.identity.fingerprint
        with self._transaction(f"recording {key!r} of {len(entries)} segment(s)") as db:
            db.executemany(
                "INSERT INTO segment_meta VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(fingerprint, namespace, id, key) "
                "DO UPDATE SET uid = excluded.uid, value = excluded.value",
                [(fp, ns, sid, uid, key, value) for ns, sid, uid, value in entries])

    def set_meta(self, key: str, value: str) -> None:
        with self._transaction(f"recording {key}={value}", counted=False) as db:
            db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()
