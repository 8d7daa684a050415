"""The journal of acknowledged writes (journal.py, recovery.py): a registry whose write-ahead log
was deleted, cut or changed after ``kill -9`` gets every acknowledged write back (registrations,
new versions, deletions); what cannot be redone is refused by id, or reported lost by ``repair``;
and a loop of >= 20 kills at random points loses no acknowledged write."""

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from inferscale_jax.errors import SnapshotCorrupt
from tests.support import SUPPORT
from tests.support.tiers_common import PROMPT, SP, make_engine

CHILD = os.path.join(SUPPORT, "journal_child.py")


class Child:
    """``journal_child.py`` with its stdout lines collected by a thread; always killed at the end."""

    def __init__(self, folder: str, mode: str, arg: str):
        self.lines: list[dict] = []
        self.proc = subprocess.Popen([sys.executable, CHILD, folder, mode, arg], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def wait_for(self, pred, timeout: float = 240.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                if pred(line):
                    return line
            if self.proc.poll() is not None and not any(pred(x) for x in self.lines):
                break
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"child: no expected line; exit {self.proc.poll()}; stderr tail:\n"
                             + "".join(self.err[-30:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def children():
    started: list[Child] = []

    def start(*args) -> Child:
        started.append(Child(*args))
        return started[-1]

    yield start
    for child in started:
        child.kill()


def model_after(acked: list[list], start: dict | None = None) -> dict:
    """id -> [version, tokens] after the acknowledged writes ``acked``."""
    have = {k: [v[0], list(v[1])] for k, v in (start or {}).items()}
    for kind, sid, tokens in acked:
        if kind == "register":
            have[sid] = [1, tokens]
        elif kind == "update":
            have[sid] = [have[sid][0] + 1, tokens]
        elif kind == "append":
            have[sid] = [have[sid][0] + 1, have[sid][1] + tokens]
        elif kind == "delete":
            del have[sid]
    return have


def damage_wal(folder: str, how: str, rng: random.Random) -> None:
    wal = os.path.join(folder, "registry.sqlite3-wal")
    if how == "deleted":
        os.remove(wal)
    elif how == "truncated":
        size = os.path.getsize(wal)
        with open(wal, "r+b") as f:
            f.truncate(max(0, size - 100))
    elif how == "flipped":
        with open(wal, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            at = rng.randrange(32, max(33, size - 32))
            f.seek(at)
            chunk = f.read(32)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in chunk))


def state(engine) -> dict:
    return {i.id: [i.version, list(engine.store.resolve(i.id, "t").token_ids)] for i in engine.list_segments("t")}


def toks(i: int, n: int = 20) -> list[int]:
    return [(5 * i + 3 * j) % 89 + 1 for j in range(n)]


SCRIPT = [["register", "a", toks(0)], ["register", "b", toks(1)], ["register", "c", toks(2)], ["snapshot", "", []],
          ["update", "a", toks(3, 26)], ["delete", "b", []], ["register", "d", toks(4)], ["append", "c", toks(5, 6)]]


def script_then_kill(folder: str, children) -> dict:
    child = children(folder, "script", json.dumps(SCRIPT))
    child.wait_for(lambda x: "idle" in x)
    child.kill()
    return model_after(SCRIPT)


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped"])
def test_writes_lost_with_the_write_ahead_log_are_redone_from_the_journal(tmp_path, children, how, caplog):
    """After kill -9 the registry's log is damaged: the update of a, the delete of b, the
    registration of d and the append to c (all acknowledged after the snapshot) are back, and each
    segment's answer equals a full prefill of its current tokens."""
    folder = str(tmp_path / "snap")
    want = script_then_kill(folder, children)
    damage_wal(folder, how, random.Random(0))
    e = make_engine(snapshot_dir=folder)
    assert state(e) == want
    st = e.stats()["snapshot"]
    assert st["lost_writes"] == 0 and st["redone"] == 4 if how == "deleted" else st["redone"] >= 1
    for sid, (_, tokens) in want.items():
        inj = e.generate(prompt_token_ids=PROMPT, segments=[sid], tenant="t", sampling=SP).token_ids
        assert inj == e.generate(prompt_token_ids=tokens + PROMPT, tenant="t", sampling=SP).token_ids
    e.register_segment("e", token_ids=toks(6), tenant="t")  # and writes go on, durably
    e.close()
    e2 = make_engine(snapshot_dir=folder)
    assert sorted(state(e2)) == ["a", "c", "d", "e"] and e2.stats()["snapshot"]["redone"] == 0
    e2.close()


def test_a_damaged_journal_line_is_refused_by_id_and_repair_reports_it_lost(tmp_path, children, caplog):
    folder = str(tmp_path / "snap")
    want = script_then_kill(folder, children)
    os.remove(os.path.join(folder, "registry.sqlite3-wal"))  # writes 5.. lost by the registry
    journal = os.path.join(folder, "registry.sqlite3.journal")
    with open(journal, "rb") as f:
        lines = f.read().split(b"\n")
    at = next(i for i, line in enumerate(lines) if b'"op":"delete"' in line)
    lines[at] = (b"0" if lines[at][:1] != b"0" else b"1") + lines[at][1:]  # its checksum no longer holds
    with open(journal, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(SnapshotCorrupt) as err:
        make_engine(snapshot_dir=folder)
    msg = str(err.value)
    assert "registry.sqlite3" in msg and "--repair" in msg and "Nothing was changed" in msg
    assert "write 5: deleted t/b (journal line" in msg  # named by id
    e = make_engine(snapshot_dir=folder, repair_registry=True)
    got = state(e)
    assert got["a"] == want["a"] and got["c"] == want["c"] and got["d"] == want["d"]
    assert "b" in got  # its deletion was the lost write: reported, not silently absent
    st = e.stats()
    assert st["snapshot"]["lost_writes"] == 1
    assert st["tiers"]["integrity_errors"]["registry"] == 1
    assert any("lost" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    e.close()
    e2 = make_engine(snapshot_dir=folder)  # repaired: starts plainly
    assert state(e2) == got
    e2.close()


def test_a_registry_file_that_fails_its_check_is_rebuilt_by_repair(tmp_path, children):
    folder = str(tmp_path / "snap")
    want = script_then_kill(folder, children)
    path = os.path.join(folder, "registry.sqlite3")
    with open(path, "wb") as f:
        f.write(b"this is not a database " * 400)
    with pytest.raises(SnapshotCorrupt, match="registry.sqlite3 is damaged"):
        make_engine(snapshot_dir=folder)
    e = make_engine(snapshot_dir=folder, repair_registry=True)
    assert state(e) == want  # the snapshot's rows plus the journal's later writes
    assert any(n.startswith("registry.sqlite3.damaged-") for n in os.listdir(folder))
    e.close()


@pytest.mark.parametrize("at", ["journaled", "committed"])
def test_a_crash_at_a_commit_leaves_a_write_the_journal_redoes(tmp_path, children, at):
    """kill -9 right before or right after a write's COMMIT: the restart serves the write whole
    (redone from its journal line, or committed), and when a later crash also loses the registry's
    log, the journal brings it back again - a write once served is never lost silently (found by
    the 20-kill loop: a write committed before its journal line, lost with the log)."""
    folder = str(tmp_path / "snap")
    ops = SCRIPT[:4] + [["append", "a", toks(7, 5)]]
    crash = children(folder, "crash", json.dumps({"ops": ops, "at": at}))
    assert crash.proc.wait(timeout=240) == 9, "".join(crash.err[-30:])
    assert [x["begin"] for x in crash.lines if "begin" in x] == ops and len([x for x in crash.lines if "ack" in x]) == 4
    want = model_after(ops)
    child = children(folder, "script", json.dumps([["register", "e", toks(8)]]))
    first = child.wait_for(lambda x: "state" in x)
    assert first["state"] == model_after(ops[:-1]) | {"a": want["a"]}
    assert first["restore"]["redone"] == (1 if at == "journaled" else 0) and first["restore"]["lost_writes"] == 0
    child.wait_for(lambda x: "idle" in x)
    child.kill()
    os.remove(os.path.join(folder, "registry.sqlite3-wal"))  # the append and e's registration, if not checkpointed
    e = make_engine(snapshot_dir=folder)
    assert state(e) == want | {"e": [1, toks(8)]}
    assert e.stats()["snapshot"]["lost_writes"] == 0
    inj = e.generate(prompt_token_ids=PROMPT, segments=["a"], tenant="t", sampling=SP).token_ids
    assert inj == e.generate(prompt_token_ids=want["a"][1] + PROMPT, tenant="t", sampling=SP).token_ids
    e.close()


def test_kill_9_loop_loses_no_acknowledged_write(tmp_path, children):
    """>= 20 kills at random points of registrations, updates, appends, deletions and snapshots;
    every fourth kill also damages the registry's write-ahead log.  After each restart every
    acknowledged write is present and the write in flight is either whole or absent; a restored
    segment answers as a full prefill of its tokens."""
    folder = str(tmp_path / "snap")
    rng = random.Random(31)
    expected: dict = {}
    kills = exact = redone = 0
    child_lines: list[dict] = []  # the killed child's lines, and the writes it acknowledged
    acked: list = []
    kinds: dict[str, int] = {}
    for round_ in range(20):
        child = children(folder, "loop", str(round_ + 1))
        first = child.wait_for(lambda x: "state" in x)
        got = first["state"]
        assert first["restore"]["lost_writes"] == 0
        redone += first["restore"]["redone"]
        if round_:
            inflight = [x["begin"] for x in child_lines if "begin" in x][len(acked):]
            allowed = [expected] + [model_after(inflight[:1], expected)] if inflight else [expected]
            assert got in allowed, (round_, first["restore"], inflight[:1], {
                k: (got.get(k), expected.get(k)) for k in set(got) | set(expected) if got.get(k) != expected.get(k)})
        expected = got
        if got:
            check = child.wait_for(lambda x: "exact" in x)
            assert check["exact"], check
            exact += 1
        time.sleep(rng.uniform(0.1, 1.2))
        child.kill()
        kills += 1
        child_lines = list(child.lines)
        acked = [x["ack"] for x in child_lines if "ack" in x]
        for op in acked:
            kinds[op[0]] = kinds.get(op[0], 0) + 1
        expected = model_after(acked, expected)
        if round_ % 4 == 3 and os.path.exists(os.path.join(folder, "registry.sqlite3-wal")):
            damage_wal(folder, ["deleted", "truncated", "flipped"][round_ // 4 % 3], rng)
    child = children(folder, "loop", "99")
    last = child.wait_for(lambda x: "state" in x)
    inflight = [x["begin"] for x in child_lines if "begin" in x][len(acked):]
    assert last["state"] in ([expected] + ([model_after(inflight[:1], expected)] if inflight else []))
    child.kill()
    assert kills >= 20 and exact >= 10 and len(expected) >= 3, (kills, exact, expected)
    assert redone > 0, "no restart needed the journal: the damage did not lose a write"
    assert all(kinds.get(k, 0) >= 2 for k in ("register", "update", "append", "delete", "snapshot")), kinds


def tear_checkpoint(folder: str, share: float) -> None:
    """What a crash part-way through a checkpoint leaves once the log is gone too: the first
    ``share`` of the log's pages (page order, as SQLite copies them) written into the main file,
    the rest old, the log and its index deleted, and the registry's checkpoint marker present."""
    path = os.path.join(folder, "registry.sqlite3")
    with open(path + "-wal", "rb") as f:
        wal = f.read()
    page = int.from_bytes(wal[8:12], "big")
    salts = wal[16:24]
    latest, at = {}, 32
    while at + 24 + page <= len(wal):
        if wal[at + 8:at + 16] == salts:
            latest[int.from_bytes(wal[at:at + 4], "big")] = wal[at + 24:at + 24 + page]
        at += 24 + page
    pages = sorted(latest)
    assert len(pages) >= 2, "the log holds too little to tear"
    with open(path, "r+b") as f:
        for pgno in pages[:max(1, int(len(pages) * share))]:
            f.seek((pgno - 1) * page)
            f.write(latest[pgno])
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    open(path + ".checkpointing", "wb").close()


def raw_state(folder: str) -> dict | None:
    """The rows a plain SQLite read of the registry file finds (None: it does not open)."""
    import numpy as np
    try:
        db = sqlite3.connect(f"file:{os.path.join(folder, 'registry.sqlite3')}?mode=ro&immutable=1", uri=True)
        got = {sid: [v, np.frombuffer(blob, "<i4").tolist()]
               for sid, v, blob in db.execute("SELECT id, version, token_ids FROM segments")}
        db.close()
        return got
    except sqlite3.DatabaseError:
        return None


@pytest.mark.parametrize("share", [0.2, 0.34, 0.5])
def test_a_checkpoint_cut_short_with_its_log_lost_is_rebuilt_whole(tmp_path, children, share, caplog):
    """kill -9 in the middle of a checkpoint, then the log deleted: the main file mixes pages from
    before and after the writes in the log, which no count in the file can reveal.  The checkpoint
    marker makes the restore rebuild the rows from the journal's snapshot and records: every
    acknowledged write is back, and each segment answers as a full prefill of its tokens."""
    folder = str(tmp_path / "snap")
    want = script_then_kill(folder, children)
    tear_checkpoint(folder, share)
    assert raw_state(folder) != {k: [v[0], [*v[1]]] for k, v in want.items()}  # the file alone is wrong
    e = make_engine(snapshot_dir=folder)
    assert state(e) == want
    assert e.stats()["snapshot"]["lost_writes"] == 0
    assert any("cut short" in r.getMessage() for r in caplog.records)
    assert not os.path.exists(os.path.join(folder, "registry.sqlite3.checkpointing"))
    for sid, (_, tokens) in want.items():
        inj = e.generate(prompt_token_ids=PROMPT, segments=[sid], tenant="t", sampling=SP).token_ids
        assert inj == e.generate(prompt_token_ids=tokens + PROMPT, tenant="t", sampling=SP).token_ids
    e.close()
    e2 = make_engine(snapshot_dir=folder)
    assert state(e2) == want and e2.stats()["snapshot"]["redone"] == 0
    e2.close()
