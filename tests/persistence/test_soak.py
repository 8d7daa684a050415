"""The soak test (``bench/serving/soak.py``) for one minute (the long runs are ``bench/serving/soak.py`` itself): the real ``inferscale serve`` under mixed
tenants, streaming with disconnects, segment churn racing completions, periodic snapshots and a
two ``kill -9`` + restarts, with damage injected every 8 s (a disk-tier file or a snapshot's data
flipped; the registry's write-ahead log deleted, cut or flipped at each kill).  Passes only when the soak's own checks pass (no 5xx, no greedy
mismatch - the damage is never served -, no page leak, bounded RSS, acknowledged segments
restored) and its figures show that the run exercised those paths and the server found damage.  About 3 minutes on a 2-core CPU (server start, compiles,
warm-up and the restart included)."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.server_util import REPO, cache_dir

pytestmark = pytest.mark.alone  # (latency bounds over a minute: conftest.py)


def test_soak_one_minute(tmp_path, tmp_path_factory):
    cache = os.environ.get("INFERSCALE_CACHE") or cache_dir(tmp_path_factory)
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, INFERSCALE_CACHE=cache, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "serving", "soak.py"), "--minutes", "1", "--seed", "0",
                           "--kills", "2", "--damage-every", "8", "--host-pages", "8", "--out", str(out),
                           "--workdir", str(work)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    report = (out / "soak.md").read_text() if (out / "soak.md").exists() else "(no soak.md)"
    tail = f"\n--- soak output (tail) ---\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}\n--- soak.md ---\n{report}"
    summary = json.loads((out / "soak.json").read_text())
    assert summary["failures"] == {}, tail
    assert proc.returncode == 0 and summary["passed"], tail
    assert summary["5xx"] == 0 and summary["mismatches"] == 0 and not summary["leak"], tail
    assert summary["conn_errors_outside"] == 0, tail
    # the run did what it claims: timed minutes, many completions, answers compared, a restart
    assert summary["minutes"] >= 0.95 and summary["requests_timed"] >= 50, tail
    assert summary["checks"]["compared"] >= 20 and summary["checks"]["restart_verified"] >= 9, tail
    assert summary["final"]["pages_used"] == 0 and summary["final"]["segments"] == 0, tail
    assert summary["rss"] and not any(row[-1] == "GROWS" for row in summary["rss"]), tail
    assert summary["kills"] == 2 and sum(summary["damage"].values()) >= 4, tail
    assert all(r["lost_writes"] == 0 for r in summary["restored"]), tail
