"""The journal of acknowledged segment writes: what survives when the registry's own log does not.

SQLite's write-ahead log can lose committed transactions *silently* when it is deleted, cut or
changed after a crash (their frames fail its checksums and are skipped).  So every segment write
is also appended here, before its COMMIT:

1. ``Registry`` runs the write's statements in its transaction and advances ``meta.write_seq``
   to ``seq``.
2. ``Journal.append`` writes one line ``<crc32 hex> <json>\\n`` - the record: ``seq``, the
   operation and everything needed to redo it (rows with their token ids, base64 int32) - and
   fsyncs the file.
3. The transaction commits, and the write is acknowledged.  A COMMIT that fails cuts its line off
   again (``drop_from``): a refused write is never redone.

The line comes first because a write committed without it (a crash between the two) is served
after the restart yet could be redone by nothing: a later damaged log would lose it silently.
With the line first, a crash between the two leaves a record the registry lacks, and the restart
redoes it: the write in flight comes back whole (it was not acknowledged, so absent would do too).

The first line is a header ``{"base": S, "step": N}``: the records that follow start after write
``S``, which snapshot step ``N`` reflects (``step`` is absent when no snapshot does: then ``S`` is
where this journal started).  A committed snapshot reflects every write up to its
``registry_write_seq``, so after it commits the journal is rewritten with that as its base and
only later records (``compact``; the registry's log is checkpointed into its main file first).  The
journal therefore holds every acknowledged write the newest snapshot lacks, and with that
snapshot's rows it rebuilds the registry whole (``recovery.py``, for a checkpoint cut short).

Reading (``read``) never trusts a line it cannot check: a line whose checksum or JSON fails is
*damaged* (its write is unknown: counted, and named by its line number); a last line without its
newline is a write torn by the crash before its COMMIT, and is dropped.  ``acked`` is the highest
write the journal holds (each one acknowledged, but for the one in flight at a crash).
``registry.py`` compares it with ``write_seq`` and ``snapshot.py`` replays what the registry lacks,
or refuses naming each lost write by id.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import zlib

import numpy as np


def fsync_dir(path: str) -> None:
    """Make a rename or creation in ``path`` durable (also ``snapshot.py``'s)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_tokens(token_ids) -> str:
    return base64.b64encode(np.asarray(token_ids, "<i4").tobytes()).decode()


def decode_tokens(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), "<i4").tolist()


def _line(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def _parse(line: bytes) -> dict | None:
    """The record of one line, ``None`` when its checksum or JSON does not hold."""
    crc, _, body = line.partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        obj = json.loads(body)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _claims(line: bytes) -> dict | None:
    """What a damaged line says, unverified (for naming a lost write), or ``None``."""
    try:
        obj = json.loads(line.partition(b" ")[2])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("seq"), int) else None


@dataclasses.dataclass
class Contents:
    """What ``read`` found: the base, the intact records by seq, the damaged lines."""
    base: int = 0
    step: int | None = None  # the snapshot step that reflects the writes up to ``base`` (None: none)
    records: dict[int, dict] = dataclasses.field(default_factory=dict)
    # damaged lines: (line number, 1-based; what the line claims, unverified: its parsed JSON or None)
    damaged: list[tuple[int, dict | None]] = dataclasses.field(default_factory=list)
    exists: bool = False

    @property
    def acked(self) -> int:
        """The highest write proven acknowledged."""
        return max([self.base, *self.records])

    def missing(self, after: int) -> list[int]:
        """Acknowledged seqs in ``(after, acked]`` the journal has no intact record of.  A
        ``sync`` record (the registry held writes ``first..seq`` the journal had lost: a cut or
        replaced journal) covers its range: nothing can redo them."""
        unacked = {s for rec in self.records.values() if rec.get("op") == "sync"
                   for s in range(int(rec["first"]), rec["seq"] + 1)}
        return [s for s in range(after + 1, self.acked + 1) if s not in self.records and s not in unacked]

    def after(self, seq: int) -> list[dict]:
        """The intact records past ``seq``, in order (``sync`` markers left out)."""
        return [self.records[s] for s in sorted(self.records) if s > seq and self.records[s].get("op") != "sync"]


class Journal:
    """One append-only file of acknowledged writes (module docstring).  Not thread-safe: the
    registry's lock serializes its callers."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> Contents:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return Contents()
        out = Contents(exists=True)
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            lines.pop()  # torn by a crash mid-append: never acknowledged
        for number, line in enumerate(lines, 1):
            rec = _parse(line)
            if rec is None:
                out.damaged.append((number, _claims(line)))
            elif number == 1 and "base" in rec:
                out.base = int(rec["base"])
                out.step = int(rec["step"]) if rec.get("step") is not None else None
            elif isinstance(rec.get("seq"), int):
                out.records[rec["seq"]] = rec
            else:
                out.damaged.append((number, rec))
        return out

    def append(self, record: dict) -> int:
        """``record`` (with its ``seq``) as one line, fsynced; returns the byte it starts at.  A
        torn last line (a crash mid-append) is cut first so the new line starts on its own."""
        if not os.path.exists(self.path):
            self.reset(0)
        with open(self.path, "r+b") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    data = (f.seek(0), f.read())[1]
                    f.truncate(data.rfind(b"\n") + 1)
            at = f.seek(0, os.SEEK_END)
            f.write(_line(record))
            f.flush()
            os.fsync(f.fileno())
        return at

    def drop_from(self, at: int) -> None:
        """Cut the journal back to byte ``at`` (the line ``append`` wrote there: its write was
        not committed), fsynced."""
        with open(self.path, "r+b") as f:
            f.truncate(at)
            f.flush()
            os.fsync(f.fileno())

    def reset(self, base: int, records: list[dict] = (), step: int | None = None) -> None:
        """Rewrite the journal as header ``base`` (reflected by snapshot ``step``) plus ``records``
        (atomically: temp, fsync, rename, fsync of the folder)."""
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_line({"base": base} if step is None else {"base": base, "step": step}))
            for rec in records:
                f.write(_line(rec))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def compact(self, base: int, step: int) -> None:
        """Drop the records at or below ``base`` (committed snapshot ``step`` reflects them)."""
        now = self.read()
        if not now.exists or now.base > base or (now.base == base and now.step == step):
            return
        self.reset(base, [now.records[s] for s in sorted(now.records) if s > base], step)
