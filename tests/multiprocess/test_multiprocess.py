"""Two local processes joined by ``jax.distributed`` (gloo CPU collectives) form a TP=2 mesh, one
CPU device each; process 0 leads a ``LockstepEngine`` and process 1 follows it
(``inferscale_jax/distributed.py``).  Their tokens equal a one-process TP=1 engine's - greedy and
seeded sampling, with an injected segment - and a call that fails (a deleted segment) fails alike
in both, which stay in step; a segment demoted under pool pressure to each process's pinned host
memory and on to its own disk tier (its own shards) is promoted back alike; segment versions and a
session turn run in lockstep too.  Snapshots: both processes write their shards into one checkpoint
in a shared ``snapshot_dir``, and a new pair of processes restores every segment from it (none
recomputed) with the one-process engine's tokens; so does one process alone."""

import json
import os
import subprocess
import sys

from tests.support import SUPPORT
from tests.support.mp_common import CASES, GREEDY, config, fill, model, segment
from tests.support.server_util import free_port

from inferscale_jax import Engine



def run_pair(tmp_path, *args, child: str = "mp_child.py") -> dict:
    """Both processes of ``child``; the leader's result line (and the follower's, if it prints one,
    under "follower")."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(SUPPORT, child), str(i), str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for i in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600))
    finally:
        for p in procs:
            p.kill()
    lead, follow = outs
    assert procs[1].returncode == 0 and ("FOLLOWER_DONE" in follow[0] or "MP_FOLLOWER" in follow[0]), \
        follow[1][-4000:]
    line = next((x for x in lead[0].splitlines() if x.startswith("MP_RESULT ")), None)
    assert line is not None, lead[1][-4000:]
    out = json.loads(line[len("MP_RESULT "):])
    other = next((x for x in follow[0].splitlines() if x.startswith("MP_FOLLOWER ")), None)
    if other is not None:
        out["follower"] = json.loads(other[len("MP_FOLLOWER "):])
    return out


def test_two_processes_tp2_equal_one_process_tp1(tmp_path):
    disk = str(tmp_path / "disk")
    got = run_pair(tmp_path, disk)
    assert got["mesh"] == 2
    params, cfg = model()
    ref = Engine(params, cfg, None, config(host_pages=0))
    ref.register_segment("a", token_ids=segment())
    want = [o.token_ids for o in ref.generate_batch(CASES)]
    assert got["tokens"] == want
    fill(ref)
    assert ref.segment_tier("a") == "disk"
    assert got["tiers"] == {"a_before": "disk", "a_after": "hbm"}  # each process's shards, on its disk
    assert got["promoted"] == ref.generate(prompt_token_ids=[9, 8, 7], segments=["a"], sampling=GREEDY).token_ids
    assert got["error"] == "SegmentNotFound"
    ref.delete_segment("a")
    assert got["again"] == ref.generate(prompt_token_ids=[5, 6, 7], sampling=GREEDY).token_ids
    ref.register_segment("b", token_ids=segment()[:9] + [4, 5, 6])
    assert got["appended"] == ref.generate(prompt_token_ids=[3, 2], segments=["b"], sampling=GREEDY).token_ids
    assert got["turn"] == ref.generate(prompt_token_ids=[7, 8, 9, 10, 11, 12], sampling=GREEDY).token_ids
    assert got["turn_cached"] == 4
    assert sorted(os.listdir(disk)) == ["process-0-of-2", "process-1-of-2"]


def test_two_processes_snapshot_and_restore_their_shards(tmp_path):
    snap = str(tmp_path / "snap")
    saved = run_pair(tmp_path, snap, "save", child="mp_snapshot_child.py")
    assert saved["first"] == 1 and saved["last_step"] == 2 and saved["follower"]["last_step"] == 2
    assert os.path.exists(os.path.join(snap, "registry.sqlite3"))  # the leader's record
    assert os.path.exists(os.path.join(snap, "process-1-of-2", "registry.sqlite3"))  # the follower's mirror
    assert sorted(os.listdir(os.path.join(snap, "snapshots"))) == ["1", "2"]
    got = run_pair(tmp_path, snap, "restore", child="mp_snapshot_child.py")
    for side in (got, got["follower"]):
        assert (side["restored_step"], side["restored_hbm"], side["recomputed"]) == (2, 3, 0)
    assert got["tiers"] == ["hbm"] * 3
    params, cfg = model()
    ref = Engine(params, cfg, None, config())
    ref.register_segment("a", token_ids=segment())
    ref.register_segment("c", token_ids=segment()[:11])
    assert got["a"] == ref.generate(prompt_token_ids=[9, 8, 7], segments=["a"], sampling=GREEDY).token_ids
    assert got["c"] == ref.generate(prompt_token_ids=[3, 2], segments=["c"], sampling=GREEDY).token_ids
    # one process reads every process's shards (each part checked against its own CRC-32)
    one = Engine(params, cfg, None, config(snapshot_dir=snap, snapshot_interval_s=None))
    snap_stats = one.stats()["snapshot"]
    assert (snap_stats["restored_step"], snap_stats["restored_hbm"], snap_stats["recomputed"]) == (2, 3, 0)
    assert one.generate(prompt_token_ids=[9, 8, 7], segments=["a"], sampling=GREEDY).token_ids == got["a"]
    one.close()
