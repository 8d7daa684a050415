"""Damage the soak injects into the server's stored state (``bench/serving/soak.py --damage-every``).

While the server runs, every ``--damage-every`` seconds one stored block is changed in place:

- ``disk``: 4096 bytes of a disk-tier file (``<snapshot dir>/disk_tier``) flipped, same size;
  the next read of that segment must find it (xxh3) and recompute, never serve it;
- ``snapshot``: 64 bytes of a committed snapshot's KV data file flipped; the next restart
  must find it (CRC-32) and recompute those segments, never restore them.

At each ``kill -9``, before the restart, the registry's write-ahead log is damaged (deleted, cut
by 100 bytes, or 32 bytes flipped): the restart must redo the writes it lost from the journal
(``inferscale_jax/recovery.py``), so that every acknowledged segment is listed with its
acknowledged content; and a data file of each snapshot step on disk is flipped, so the restart
must recompute what fails its CRC instead of restoring it.  The soak's own checks then catch any wrong answer or lost write; the
server's integrity counters (``/v1/stats``) show that the damage was found.
"""

from __future__ import annotations

import os
import random
import time


class Damage:
    def __init__(self, snapshot_dir: str, seed: int):
        self.dir = snapshot_dir
        self.rng = random.Random(seed * 104729 + 1)
        self.events: list[tuple[float, str, str]] = []  # (time, kind, what)

    def _files(self, sub: str, min_size: int, suffix: str = "") -> list[str]:
        root = os.path.join(self.dir, sub)
        out = []
        for r, _, fs in os.walk(root):
            out += [os.path.join(r, f) for f in fs if f.endswith(suffix) and "-tmp" not in r]
        return [f for f in out if os.path.exists(f) and os.path.getsize(f) >= min_size]

    def _flip(self, path: str, nbytes: int) -> bool:
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                at = self.rng.randrange(0, max(1, size - nbytes))
                f.seek(at)
                chunk = f.read(nbytes)
                f.seek(at)
                f.write(bytes(b ^ 0xFF for b in chunk))
            return True
        except OSError:  # removed meanwhile (an eviction, a newer snapshot)
            return False

    def _snapshot_data(self) -> list[str]:
        return [f for f in self._files("snapshots", 1024) if f"{os.sep}kv{os.sep}" in f and f"{os.sep}d{os.sep}" in f]

    def stored_block(self) -> str | None:
        """One disk-tier file or committed snapshot data file flipped; the kind, or None when
        there was nothing to damage."""
        disk = self._files("disk_tier", 4096)
        snap = self._snapshot_data()
        choices = [("disk", disk, 4096)] * bool(disk) + [("snapshot", snap, 64)] * bool(snap)
        if not choices:
            return None
        kind, files, n = self.rng.choice(choices)
        path = self.rng.choice(files)
        if not self._flip(path, n):
            return None
        self.events.append((time.time(), kind, os.path.relpath(path, self.dir)))
        return kind

    def snapshot_at_kill(self) -> bool:
        """A data file of every snapshot step on disk flipped (the server is down): the restart
        reads one of them (periodic snapshots replace steps every few seconds, so damage while
        the server runs rarely survives to a restart)."""
        steps: dict[str, list[str]] = {}
        for f in self._snapshot_data():
            steps.setdefault(os.path.relpath(f, self.dir).split(os.sep)[1], []).append(f)
        done = False
        for files in steps.values():
            path = self.rng.choice(files)
            if self._flip(path, 64):
                self.events.append((time.time(), "snapshot at a kill", os.path.relpath(path, self.dir)))
                done = True
        return done

    def registry_log(self) -> str | None:
        """The registry's write-ahead log deleted, cut or flipped (the server is down)."""
        wal = os.path.join(self.dir, "registry.sqlite3-wal")
        if not os.path.exists(wal) or os.path.getsize(wal) < 200:
            return None
        how = self.rng.choice(["deleted", "truncated", "flipped"])
        if how == "deleted":
            os.remove(wal)
        elif how == "truncated":
            with open(wal, "r+b") as f:
                f.truncate(os.path.getsize(wal) - 100)
        else:
            self._flip(wal, 32)
        self.events.append((time.time(), f"registry log {how}", "registry.sqlite3-wal"))
        return how

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind, _ in self.events:
            out[kind] = out.get(kind, 0) + 1
        return out
