"""bench/tools/serve_ready.py: ``inferscale serve`` started twice over one compilation cache (cold, then
warm), each ready, drained by SIGTERM with exit code 0, with the engine's load and warm-up lines."""

import json
import os
import re
import subprocess
import sys

from tests.support import REPO


def test_cold_then_warm_start_are_timed_with_the_engines_parts(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", INFERSCALE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "tools", "serve_ready.py"), "--runs", "2",
                           "--out", str(tmp_path / "ready.md")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["start"] for r in runs] == ["cold", "warm"], proc.stdout
    for r in runs:
        assert r["ready_s"] > 0 and r["rc"] == 0, r
        assert any(" loaded " in p for p in r["parts"]) and any(" warm-up: " in p for p in r["parts"]), r
        assert all(p.startswith("+") for p in r["parts"]), r  # each with its seconds from the launch
    # both starts name their KV pool, and it is the same (run AL: a moved pool made every step miss the caches)
    pools = [re.findall(r"KV pool of (\d+) pages", " ".join(r["parts"])) for r in runs]
    assert all(len(p) == 1 for p in pools) and pools[0] == pools[1], pools
    assert sorted(os.listdir(tmp_path / "ready_logs")) == ["serve_0.log", "serve_1.log"]  # (each start's whole log)
    report = (tmp_path / "ready.md").read_text()
    assert "| 1 | cold |" in report and "| 2 | warm |" in report and "the engine's log" in report
