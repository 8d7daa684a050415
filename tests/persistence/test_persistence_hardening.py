"""Persistence under hostile conditions: relative folders, a damaged or emptied registry next to
an intact snapshot, and full or read-only storage (failed snapshots, failed registry writes)."""

import errno
import json
import logging
import os
import re
import sqlite3
import time

import numpy as np
import pytest

from inferscale_jax import EngineConfig, snapshot, tiers
from inferscale_jax.errors import SnapshotCorrupt, StorageError
from tests.support.tiers_common import gen, make_engine, seg_tokens
from tests.support.tiny_engine import assert_only_nodes_hold_pages


def test_relative_snapshot_dir_saves_and_restores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert EngineConfig(disk_dir="~/kv").disk_dir == os.path.join(os.path.expanduser("~"), "kv")
    e = make_engine(snapshot_dir="kv", disk_dir="tier")
    assert (e.config.snapshot_dir, e.config.disk_dir) == (str(tmp_path / "kv"), str(tmp_path / "tier"))
    e.register_segment("a", token_ids=seg_tokens(0))
    ref = gen(e, "a")
    assert e.save_snapshot()["step"] == 1
    e.close()
    assert os.listdir(tmp_path / "kv" / "snapshots") == ["1"]  # committed, no temporary folder left
    e2 = make_engine(snapshot_dir="kv")
    st = e2.stats()["snapshot"]
    assert st["restored_step"] == 1 and st["recomputed"] == 0  # the KV came from the snapshot
    assert gen(e2, "a") == ref
    e2.close()


# -- a damaged, emptied or stale registry next to an intact snapshot ----------------------------

def three_segments_and_a_snapshot(d):
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0), tenant="t", pin=True)
    e.register_segment("b", token_ids=seg_tokens(1), tenant="t", public=True)
    e.register_segment("c", token_ids=seg_tokens(2), tenant="u")
    ref = {sid: gen(e, sid, tenant) for sid, tenant in [("a", "t"), ("b", "t"), ("c", "u")]}
    e.tiers.demote(e.store.resolve("c", "u"), "recompute")  # in the snapshot's records, without KV
    infos = e.list_segments("t") + e.list_segments("u")
    e.save_snapshot()
    e.close()
    return ref, infos


def registry_files(d):
    return [os.path.join(d, "registry.sqlite3" + suffix) for suffix in ("", "-wal", "-shm")]


@pytest.mark.parametrize("damage", ["rows deleted", "file emptied"])
def test_emptied_registry_is_rebuilt_from_the_snapshot_loudly(tmp_path, caplog, damage):
    d = str(tmp_path / "snap")
    ref, infos = three_segments_and_a_snapshot(d)
    if damage == "rows deleted":
        db = sqlite3.connect(registry_files(d)[0])
        db.executescript("DELETE FROM segments; DELETE FROM meta;")
        db.close()
    else:
        for f in registry_files(d):
            if os.path.exists(f):
                os.remove(f)
        open(registry_files(d)[0], "wb").close()
    with caplog.at_level(logging.WARNING, logger="inferscale.snapshot"):
        e = make_engine(snapshot_dir=d)
    warning = [r for r in caplog.records if r.levelno >= logging.WARNING and "rebuilt" in r.getMessage()]
    assert len(warning) == 1 and registry_files(d)[0] in warning[0].getMessage()
    assert os.path.join(d, "snapshots", "1") in warning[0].getMessage() and "3 segment(s)" in warning[0].getMessage()
    assert e.list_segments("t") + e.list_segments("u") == infos  # tenant, public, pin, creation time
    st = e.stats()["snapshot"]
    assert (st["rebuilt"], st["recomputed"], st["restored_hbm"]) == (3, 1, 2)  # c had no KV in the snapshot
    for (sid, tenant), want in zip([("a", "t"), ("b", "t"), ("c", "u")], ref.values()):
        assert gen(e, sid, tenant) == want
    e.register_segment("d", token_ids=seg_tokens(3), tenant="t")  # uids continue past the rebuilt ones
    assert len({s.uid for s in e.store.all_segments()}) == 4
    e.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inferscale.snapshot"):
        e2 = make_engine(snapshot_dir=d)  # the rebuilt rows were written durably
    assert "rebuilt" not in caplog.text and e2.stats()["snapshot"]["rebuilt"] == 0
    assert sorted(s.id for s in e2.list_segments("t")) == ["a", "b", "d"]
    e2.close()


def test_registry_that_lost_its_last_segment_is_completed_from_the_snapshot(tmp_path, caplog):
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0))
    old = sqlite3.connect(str(tmp_path / "before_b.sqlite3"))
    sqlite3.connect(registry_files(d)[0]).backup(old)  # the registry as it was before "b"'s write
    e.register_segment("b", token_ids=seg_tokens(1))
    ref = gen(e, "b")
    e.save_snapshot()
    e.close()
    for f in registry_files(d):  # "b"'s transaction is lost (a damaged write-ahead log)
        if os.path.exists(f):
            os.remove(f)
    old.backup(sqlite3.connect(registry_files(d)[0]))
    old.close()
    with caplog.at_level(logging.WARNING, logger="inferscale.snapshot"):
        e2 = make_engine(snapshot_dir=d)
    assert "rebuilt from snapshot" in caplog.text and "bringing back 1: 'b'" in caplog.text
    assert [s.id for s in e2.list_segments()] == ["a", "b"] and e2.stats()["snapshot"]["recomputed"] == 0
    assert gen(e2, "b") == ref
    e2.close()


def test_registry_lacking_segments_of_a_snapshot_without_token_ids_is_refused(tmp_path):
    d = str(tmp_path / "snap")
    three_segments_and_a_snapshot(d)
    meta_dir = os.path.join(d, "snapshots", "1", "meta")
    (name,) = [f for f in os.listdir(meta_dir) if open(os.path.join(meta_dir, f), "rb").read(1) == b"{"]
    with open(os.path.join(meta_dir, name)) as f:
        meta = json.load(f)
    for rec in meta["segments"]:  # what an older version wrote: no token ids
        del rec["tokens_at"]
    with open(os.path.join(meta_dir, name), "w") as f:
        json.dump(meta, f)
    db = sqlite3.connect(registry_files(d)[0])
    db.executescript("DELETE FROM segments; DELETE FROM meta;")
    db.close()
    with pytest.raises(SnapshotCorrupt) as err:
        make_engine(snapshot_dir=d)
    msg = str(err.value)
    assert registry_files(d)[0] in msg and os.path.join(d, "snapshots", "1") in msg
    assert "missing 3 acknowledged write(s)" in msg and "tokens_at" in msg and "--repair" in msg


def test_garbage_registry_file_is_a_clear_error_naming_it(tmp_path):
    d = str(tmp_path / "snap")
    ref, infos = three_segments_and_a_snapshot(d)
    path = registry_files(d)[0]
    with open(path, "wb") as f:
        f.write(b"this is not a database " * 400)
    with pytest.raises(SnapshotCorrupt, match=f"registry {re.escape(path)} is damaged .*Move it aside"):
        make_engine(snapshot_dir=d)
    for f in registry_files(d):  # the fix the message gives
        if os.path.exists(f):
            os.rename(f, f + ".bad")
    e = make_engine(snapshot_dir=d)
    assert e.list_segments("t") + e.list_segments("u") == infos and e.stats()["snapshot"]["rebuilt"] == 3
    assert gen(e, "a", "t") == ref["a"]
    e.close()


# -- full or read-only storage ------------------------------------------------------------------

def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_snapshot_leaves_no_temp_folder_backs_off_and_is_a_storage_error(tmp_path, monkeypatch, caplog):
    d = str(tmp_path / "snap")
    snaps = os.path.join(d, "snapshots")
    e = make_engine(snapshot_dir=d, snapshot_interval_s=10.0)
    p = e.persistence
    e.register_segment("a", token_ids=seg_tokens(0))
    assert e.save_snapshot()["step"] == 1
    e.register_segment("b", token_ids=seg_tokens(1))
    attempts = []

    async def finalize(self):  # orbax wrote step 2's data into its temp folder; the rename fails
        attempts.append(os.listdir(snaps))
        no_space()

    monkeypatch.setattr(snapshot._RenameCommit, "finalize", finalize)
    with caplog.at_level(logging.DEBUG, logger="inferscale.snapshot"):
        with pytest.raises(StorageError, match=f"storage of {re.escape(snaps)} is full or read-only") as err:
            e.save_snapshot()
        assert err.value.errno == errno.ENOSPC
        assert any(n.startswith("2.orbax-checkpoint-tmp") for n in attempts[0])  # there was a temp folder...
        assert os.listdir(snaps) == ["1"]  # ...and it is gone at once
        wait = p._retry_at - time.monotonic()
        assert 15.0 < wait <= 20.0  # the next periodic attempt: 2x the interval
        p._last_save -= 100.0  # the interval has passed, the backoff has not
        assert not e.maybe_snapshot() and len(attempts) == 1
        for n in range(2, 5):
            p._retry_at, p._last_save = 0.0, p._last_save - 100.0
            assert e.maybe_snapshot()  # a background attempt, failing again
            p.wait()
            assert len(attempts) == n and os.listdir(snaps) == ["1"]
        assert 150.0 < p._retry_at - time.monotonic() <= 160.0  # 2 ** 4 x the interval
        st = e.stats()["snapshot"]
        assert st["failures"] == 4 and "full or read-only" in st["last_error"] and snaps in st["last_error"]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is None  # one line for four identical failures
        p.counters["failures"] = 20
        p._failed(None, OSError(errno.ENOSPC, "No space left on device"))
        assert p._retry_at - time.monotonic() <= snapshot.MAX_BACKOFF_S  # capped
    monkeypatch.undo()  # space again
    p._retry_at, p._last_save = 0.0, p._last_save - 100.0
    assert e.maybe_snapshot()
    p.wait()
    st = e.stats()["snapshot"]
    assert (st["failures"], st["last_error"], st["last_step"]) == (0, None, 2)
    assert sorted(os.listdir(snaps)) == ["1", "2"]
    e.close()


def test_stale_temp_folders_are_removed_at_startup(tmp_path):
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0))
    e.save_snapshot()
    e.close()
    for name in ("2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1234"):
        os.makedirs(os.path.join(d, "snapshots", name, "kv"))
    e2 = make_engine(snapshot_dir=d)
    assert os.listdir(os.path.join(d, "snapshots")) == ["1"] and e2.stats()["snapshot"]["recomputed"] == 0
    e2.close()


class FullDatabase:
    """A registry connection whose writes fail as SQLite's do on a full or read-only disk; a
    failed COMMIT has rolled the transaction back already (what SQLite does on SQLITE_FULL)."""

    def __init__(self, db, message):
        self.db, self.message = db, message

    def execute(self, sql, *args):
        if sql.startswith("COMMIT"):
            self.db.execute("ROLLBACK")
            raise sqlite3.OperationalError(self.message)
        return self.db.execute(sql, *args)

    def executemany(self, sql, *args):
        if sql.startswith(("INSERT", "DELETE")) and "readonly" in self.message:
            raise sqlite3.OperationalError(self.message)
        return self.db.executemany(sql, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)


@pytest.mark.parametrize("message", ["database or disk is full", "attempt to write a readonly database"])
def test_full_or_read_only_registry_is_a_storage_error_and_registers_nothing(tmp_path, message):
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0))
    reg = e.persistence.registry
    real = reg._db
    reg._db = FullDatabase(real, message)
    free = e.pool.num_free
    with pytest.raises(StorageError, match=f"recording segment 'b' in the segment registry .*storage of "
                                           f"{re.escape(d)} is full or read-only .*{message}"):
        e.register_segment("b", token_ids=seg_tokens(1, 40))
    assert [s.id for s in e.list_segments()] == ["a"] and not real.in_transaction
    assert reg.journal.read().acked == reg.write_seq() == 1  # the refused write's journal line went too
    assert_only_nodes_hold_pages(e)  # "b"'s pages were released (its full pages stay in the prefix cache)
    assert e.pool.num_free == free
    with pytest.raises(StorageError, match="deleting segment 'a'"):
        e.delete_segment("a")
    assert [s.id for s in e.list_segments()] == ["a"]  # still registered, still durable
    reg._db = real
    e.register_segment("b", token_ids=seg_tokens(1, 40))  # space again: the same id registers
    e.check_invariants()
    e.close()
    e2 = make_engine(snapshot_dir=d)
    assert [s.id for s in e2.list_segments()] == ["a", "b"]
    e2.close()


def test_full_disk_tier_is_a_storage_error_and_evictions_fall_back_to_recompute(tmp_path, monkeypatch, caplog):
    disk = str(tmp_path / "tier")
    e = make_engine(disk_dir=disk)
    e.register_segment("a", token_ids=seg_tokens(0))
    ref = gen(e, "a")
    monkeypatch.setattr(tiers, "open", no_space, raising=False)
    seg = e.store.resolve("a", "default")
    with pytest.raises(StorageError, match=f"storage of {re.escape(disk)} is full"):
        e.tiers.demote(seg, "disk")  # explicit: the error names the folder (the host tier held it meanwhile)
    assert e.segment_tier("a") == "host"
    e.tiers.host_capacity = 0
    e.tiers._enforce_capacity()  # an eviction past the host tier's capacity: dropped to recompute, logged
    assert e.segment_tier("a") == "recompute" and os.listdir(disk) == []
    assert "is full" in caplog.text and disk in caplog.text
    assert gen(e, "a") == ref
    e.close()


def test_registry_row_edited_outside_the_engine_is_dropped_never_served(tmp_path, caplog):
    """One token id of a row changed with sqlite (valid SQL, wrong content): its digest no longer
    matches, so the segment is dropped with a logged, counted integrity error, the others load,
    and the id can be registered again."""
    d = str(tmp_path / "snap")
    e = make_engine(snapshot_dir=d)
    e.register_segment("a", token_ids=seg_tokens(0))
    e.register_segment("b", token_ids=seg_tokens(1))
    want_b = gen(e, "b")
    e.close()
    db = sqlite3.connect(registry_files(d)[0])
    (blob,) = db.execute("SELECT token_ids FROM segments WHERE id = 'a'").fetchone()
    ids = list(np.frombuffer(blob, "<i4"))
    ids[3] = (ids[3] + 1) % 90 + 3
    db.execute("UPDATE segments SET token_ids = ? WHERE id = 'a'", (np.asarray(ids, "<i4").tobytes(),))
    db.commit()
    db.close()
    with caplog.at_level(logging.ERROR, logger="inferscale.snapshot"):
        e2 = make_engine(snapshot_dir=d)
    assert "no longer match their digest" in caplog.text and "/a" in caplog.text
    assert [s.id for s in e2.list_segments()] == ["b"] and gen(e2, "b") == want_b
    assert e2.stats()["tiers"]["integrity_errors"]["registry"] == 1
    e2.register_segment("a", token_ids=seg_tokens(0))
    e2.close()
