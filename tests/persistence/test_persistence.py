"""Persistence: the durable registry, orbax snapshots, restore, and crash safety with real
processes killed by SIGKILL (``tiers_child.py``) right after acknowledged registrations and in
the middle of a snapshot write."""

import dataclasses
import json
import logging
import os
import queue
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import jax
import pytest

from inferscale_jax import Engine, EngineConfig, SnapshotMismatch
from inferscale_jax import snapshot as snapshot_mod
from models import init_params
from tests.support import REPO, SUPPORT, same_compiler
from tests.support.tiers_common import CFG, gen, make_engine, seg_tokens

CHILD = os.path.join(SUPPORT, "tiers_child.py")


class Child:
    """A ``tiers_child.py`` process whose stdout JSON lines are read with a timeout."""

    def __init__(self, snapshot_dir, mode, log_path):
        self._err = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, CHILD, str(snapshot_dir), mode], stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env=same_compiler())  # (log-probs to 1e-6)
        self.events, self._q = [], queue.Queue()
        threading.Thread(target=lambda: [self._q.put(line) for line in self.proc.stdout], daemon=True).start()
        self.log_path = log_path

    def wait_for(self, key, timeout=240):
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = json.loads(self._q.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"child sent no {key!r} within {timeout} s; stderr:\n"
                                     + open(self.log_path).read()[-3000:]) from None
            self.events.append(ev)
            assert "error" not in ev, ev
            if key in ev:
                return ev

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._err.close()
        assert self.proc.returncode == -signal.SIGKILL

    def generations(self):
        return {ev["gen"]: (ev["tokens"], [{int(k): v for k, v in d.items()} for d in ev["logprobs"]])
                for ev in self.events if "gen" in ev}


def same_generation(got, want):
    (ids, lps), (want_ids, want_lps) = got, want
    assert ids == want_ids
    for a, b in zip(lps, want_lps):
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) <= 1e-6


def test_kill_after_registration_before_any_snapshot(tmp_path):
    d = tmp_path / "snap"
    child = Child(d, "after_register", tmp_path / "child.log")
    child.wait_for("ready")
    child.kill()
    acked = [ev["ack"] for ev in child.events if "ack" in ev]
    assert acked == ["s0", "s1", "s2"] and os.listdir(d / "snapshots") == []  # no snapshot was taken
    e = make_engine(snapshot_dir=str(d))
    infos = e.list_segments("t")
    assert [s.id for s in infos] == acked and [s.pin for s in infos] == [True, False, False]
    assert e.stats()["snapshot"]["recomputed"] == 3  # from their durably recorded tokens
    for sid, want in child.generations().items():
        same_generation(gen(e, sid, tenant="t"), want)
    e.register_segment("s3", token_ids=seg_tokens(3), tenant="t")  # uids continue, nothing collides
    assert len({s.uid for s in e.store.all_segments()}) == 4
    e.check_invariants()
    e.close()


def test_kill_in_the_middle_of_a_snapshot(tmp_path):
    d = tmp_path / "snap"
    child = Child(d, "mid_snapshot", tmp_path / "child.log")
    assert child.wait_for("snapshot")["snapshot"] == 1
    child.wait_for("saving")
    marker = tmp_path / "paused"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline, open(tmp_path / "child.log").read()[-3000:]
        time.sleep(0.05)
    tmp_step = marker.read_text()
    assert os.path.basename(tmp_step).startswith("2.orbax-checkpoint-tmp")  # step 2's data, not committed
    assert os.path.isdir(os.path.join(tmp_step, "kv")) and os.path.isdir(os.path.join(tmp_step, "meta"))
    child.kill()
    assert sorted(os.listdir(d / "snapshots")) == ["1", os.path.basename(tmp_step)]

    e = make_engine(snapshot_dir=str(d))
    assert [s.id for s in e.list_segments("t")] == ["s0", "s2"]  # s1 was deleted after snapshot 1
    st = e.stats()["snapshot"]
    assert st["restored_step"] == 1 and st["restored_hbm"] + st["restored_host"] == 1 and st["recomputed"] == 1
    assert os.listdir(d / "snapshots") == ["1"]  # the unfinished step is cleaned up
    gens = child.generations()
    assert sorted(gens) == ["s0", "s2"]
    for sid, want in gens.items():
        same_generation(gen(e, sid, tenant="t"), want)
    e.close()


def test_registry_is_durable_before_the_ack_and_periodic_snapshots(tmp_path, monkeypatch):
    d = str(tmp_path / "snap")
    now = [1000.0]  # the periodic snapshots' clock, moved by hand: however long a registration takes here
    monkeypatch.setattr(snapshot_mod, "_clock", lambda: now[0])
    e = make_engine(snapshot_dir=d, snapshot_interval_s=0.05)
    reg = e.persistence.registry._db
    assert reg.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: fsync on every commit
    assert reg.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    e.register_segment("a", token_ids=seg_tokens(0), tenant="t", public=True)
    other = sqlite3.connect(os.path.join(d, "registry.sqlite3"))  # what a restarted process reads
    rows = other.execute("SELECT namespace, id, tenant, public, pin, length(token_ids) FROM segments").fetchall()
    assert rows == [("__public__", "a", "t", 1, 0, 4 * 20)]
    e.persistence.wait()
    assert e.stats()["snapshot"]["snapshots"] == 0  # "a" came before the interval passed
    now[0] += 0.06
    e.register_segment("b", token_ids=seg_tokens(1), tenant="t")  # interval passed: background snapshot
    e.persistence.wait()
    assert e.stats()["snapshot"]["snapshots"] == 1 and e.stats()["snapshot"]["last_step"] == 1
    e.delete_segment("a", tenant="t")
    assert other.execute("SELECT id FROM segments").fetchall() == [("b",)]
    e.close()  # segments changed since snapshot 1: a final snapshot
    e2 = make_engine(snapshot_dir=d)
    st = e2.stats()["snapshot"]
    assert [s.id for s in e2.list_segments("t")] == ["b"] and st["restored_step"] == 2 and st["recomputed"] == 0
    e2.close()


def test_snapshot_of_another_model_dtype_or_page_size_is_refused(tmp_path, caplog):
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0))
    ref = gen(e, "a")
    e.save_snapshot()
    e.close()
    for kw, named in [(dict(fingerprint="other-weights"), "model fingerprint"), (dict(dtype="bfloat16"), "dtype"),
                      (dict(page_size=16), "page size")]:
        with pytest.raises(SnapshotMismatch, match=named):
            make_engine(snapshot_dir=d, strict_restore=True, **kw)
    # not strict: logged; the other model starts without this snapshot's KV and this model's segments
    with caplog.at_level(logging.WARNING, logger="inferscale.snapshot"):
        other = make_engine(snapshot_dir=d, fingerprint="other-weights")
    assert "model fingerprint" in caplog.text and other.list_segments() == []
    other.register_segment("z", token_ids=seg_tokens(3))
    other.save_snapshot()
    other.close()
    # the newest snapshot is now the other model's: ours is refused, our registered segment recomputed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inferscale.snapshot"):
        e2 = make_engine(snapshot_dir=d)
    assert "model fingerprint" in caplog.text
    assert [s.id for s in e2.list_segments()] == ["a"] and e2.stats()["snapshot"]["recomputed"] == 1
    assert gen(e2, "a") == ref
    e2.close()


def snapshot_files(d):
    root = os.path.join(d, "snapshots")
    return {os.path.relpath(os.path.join(r, f), root): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(root) for f in fs}


RESTORE_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from tests.support.tiers_common import gen, make_engine
e = make_engine(snapshot_dir={d!r})
st = e.stats()
print(json.dumps(dict(snapshot=st["snapshot"], integrity=st["tiers"]["integrity_errors"], a=gen(e, "a")[0])))
e.close()
"""


def test_corrupted_snapshot_is_recomputed_never_served(tmp_path):
    """Flipped bytes in a KV data file, then a truncated meta record: the restart restores none of
    the damaged KV - those segments are recomputed from their token ids, with a logged, counted
    integrity error (tier ``snapshot``) - and answers as before.  Each damaged restore runs in a
    new process, as a restart does: in the process that wrote the snapshot, tensorstore's OCDBT
    cache can serve the data it wrote instead of the damaged file (a CI run once restored the
    undamaged bytes)."""
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    for i, sid in enumerate("ab"):
        e.register_segment(sid, token_ids=seg_tokens(i))
    ref = gen(e, "a")
    e.save_snapshot()
    e.close()
    files = snapshot_files(d)
    data = [f for f in files if f.startswith("1/kv/ocdbt.process_0/d/") and len(files[f]) > 1024]
    assert data, sorted(files)  # the arrays' data files (the small ones are b-tree nodes)
    meta = next(f for f in files if f.startswith("1/meta/") and files[f].startswith(b"{"))
    flip = lambda b: b[:len(b) // 2] + bytes(x ^ 0xFF for x in b[len(b) // 2:len(b) // 2 + 64]) + b[len(b) // 2 + 64:]  # noqa: E731
    for names, damage in [(data, flip), ([meta], lambda b: b[:len(b) // 2])]:
        for name in names:
            with open(os.path.join(d, "snapshots", name), "wb") as f:
                f.write(damage(files[name]))
        child = subprocess.run([sys.executable, "-c", RESTORE_CHILD.format(root=REPO, d=d)],
                               capture_output=True, text=True, timeout=300, env=same_compiler())
        assert child.returncode == 0, child.stdout + child.stderr[-3000:]
        got = json.loads(child.stdout.strip().splitlines()[-1])
        assert got["snapshot"]["recomputed"] >= 1 and got["integrity"]["snapshot"] >= 1, got
        assert got["a"] == ref[0]  # recomputed: the same answer, never the damaged KV
        assert "integrity error: snapshot" in child.stderr, child.stderr[-3000:]
        shutil.rmtree(os.path.join(d, "snapshots"))  # the next case starts from the undamaged snapshot
        for name, blob in files.items():
            os.makedirs(os.path.dirname(os.path.join(d, "snapshots", name)), exist_ok=True)
            with open(os.path.join(d, "snapshots", name), "wb") as f:
                f.write(blob)
        db = sqlite3.connect(os.path.join(d, "registry.sqlite3"))
        db.execute("UPDATE meta SET value = '1' WHERE key = 'snapshot_step'")  # (the child committed step 2)
        db.commit()
        db.close()
    e2 = make_engine(snapshot_dir=d)
    assert e2.stats()["snapshot"]["recomputed"] == 0 and gen(e2, "a") == ref
    e2.close()


def test_restore_throughput_cpu(tmp_path):
    """Restore MB/s of a 32 MB snapshot on this CPU (the figure the notes record)."""
    cfg = dataclasses.replace(CFG, num_heads=8, num_kv_heads=8, head_dim=64)  # 8 KiB of fp32 KV per token
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    conf = EngineConfig(dtype="float32", page_size=16, hbm_pages=300, prefill_chunk=512,
                        snapshot_dir=str(tmp_path / "snap"))
    e = Engine(params, cfg, None, conf)
    for i in range(8):
        e.register_segment(f"s{i}", token_ids=seg_tokens(i, 512))  # 32 pages of 128 KiB each
    saved = e.save_snapshot()
    e.close()
    e2 = Engine(params, cfg, None, conf)
    st = e2.stats()["snapshot"]
    assert st["restored_hbm"] + st["restored_host"] == 8 and st["restore_bytes"] == saved["bytes"] == 32 << 20
    print(f"\nsnapshot of {saved['bytes'] / 1e6:.1f} MB: save {saved['bytes'] / saved['duration_s'] / 1e6:.0f} MB/s; "
          f"restore {st['restore_mb_s']:.0f} MB/s without the one-time scatter compile "
          f"({st['restore_s'] * 1e3:.0f} ms in all: compiling {st['restore_compile_s'] * 1e3:.0f} ms, "
          f"reading {st['restore_read_s'] * 1e3:.0f} ms)")
    e2.close()


def test_snapshot_holds_every_tier_and_restores_to_host_when_hbm_is_short(tmp_path):
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    for i in range(5):
        e.register_segment(f"s{i}", token_ids=seg_tokens(i))  # 3 pages each
    ref = {f"s{i}": gen(e, f"s{i}") for i in range(5)}
    e.tiers.demote(e.store.resolve("s0", "default"), "host")
    e.tiers.demote(e.store.resolve("s1", "default"), "disk")
    e.save_snapshot()
    e.close()
    # 15 usable pages, 1/8 kept free: four segments fit in HBM, the least recently used goes to the host
    small = make_engine(pages=16, snapshot_dir=d)
    st = small.stats()["snapshot"]
    assert (st["restored_hbm"], st["restored_host"], st["recomputed"]) == (4, 1, 0)
    assert small.segment_tier("s0") == "host"  # demoted first: the least recently used
    for sid, want in ref.items():
        assert gen(small, sid) == want
    small.check_invariants()
    small.close()


def test_a_snapshot_is_used_only_once_committed_in_the_registry(tmp_path):
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0))
    e.save_snapshot()
    e.register_segment("b", token_ids=seg_tokens(1))
    assert e.save_snapshot()["step"] == 2
    e.close()
    # a kill between orbax's rename of step 2 and the registry's commit leaves step 1 committed
    db = sqlite3.connect(os.path.join(d, "registry.sqlite3"))
    db.execute("UPDATE meta SET value = '1' WHERE key = 'snapshot_step'")
    db.commit()
    db.close()
    e2 = make_engine(snapshot_dir=d)
    st = e2.stats()["snapshot"]
    assert st["restored_step"] == 1 and st["recomputed"] == 1  # b: registered after step 1
    assert e2.save_snapshot()["step"] == 3
    assert sorted(os.listdir(os.path.join(d, "snapshots"))) == ["1", "3"]  # committed 3 and its predecessor
    e2.close()
