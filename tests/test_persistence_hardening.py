"""Persistence under hostile conditions: relative folders, a damaged or emptied registry next to
an intact snapshot, and full or read-only storage (failed snapshots, failed registry writes)."""

import os

from inferscale_jax import EngineConfig
from tiers_common import gen, make_engine, seg_tokens


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
