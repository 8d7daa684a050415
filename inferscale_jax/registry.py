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
- ``segment_meta``: optional key/value pairs per segment, keyed like ``segments`` plus ``key``
  and stamped with the segment's ``uid`` (a row whose uid is not the live segment's is stale
  and ignored).  ``precompute.py`` keeps each document's ``text_sha256`` here, so a re-run
  skips unchanged documents.  Deleting a segment deletes its meta rows in the same transaction.

The registry is shared by the engine thread and the snapshot writer thread (which records
``snapshot_step``); a lock serializes them.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading

import numpy as np

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


class Registry:
    def __init__(self, path: str, identity: Identity):
        self.path, self.identity = path, identity
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    # -- reads ----------------------------------------------------------------------------
    def rows(self) -> list[SegmentRow]:
        """This engine's segments (its fingerprint), oldest uid first."""
        with self._lock:
            cur = self._db.execute(
                "SELECT namespace, id, uid, tenant, token_ids, public, pin, created, parent FROM segments "
                "WHERE fingerprint = ? ORDER BY uid", (self.identity.fingerprint,))
            return [SegmentRow(ns, sid, uid, tenant, np.frombuffer(blob, "<i4").tolist(), bool(pub), bool(pin),
                               created, parent)
                    for ns, sid, uid, tenant, blob, pub, pin, created, parent in cur.fetchall()]

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
        ident = self.identity
        blob = np.asarray(row.token_ids, "<i4").tobytes()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (ident.fingerprint, ident.model, ident.dtype, ident.page_size, row.namespace, row.id, row.uid,
                     row.tenant, blob, row.parent, int(row.public), int(row.pin), row.created))
                self._db.execute(
                    "INSERT INTO meta VALUES ('next_uid', ?) ON CONFLICT(key) DO UPDATE SET "
                    "value = MAX(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER))", (str(row.uid + 1),))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def delete(self, namespace: str, segment_id: str) -> None:
        key = (self.identity.fingerprint, namespace, segment_id)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM segments WHERE fingerprint = ? AND namespace = ? AND id = ?", key)
                self._db.execute("DELETE FROM segment_meta WHERE fingerprint = ? AND namespace = ? AND id = ?", key)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def set_segment_meta(self, key: str, entries: list[tuple[str, str, int, str]]) -> None:
        """Record ``key`` for many segments, ``entries`` = ``(namespace, id, uid, value)``, in one
        fsynced transaction (the value replaces any earlier one)."""
        fp = self.identity.fingerprint
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT INTO segment_meta VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(fingerprint, namespace, id, key) "
                    "DO UPDATE SET uid = excluded.uid, value = excluded.value",
                    [(fp, ns, sid, uid, key, value) for ns, sid, uid, value in entries])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                             (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()
