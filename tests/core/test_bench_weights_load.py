"""bench/tools/weights_load.py times the checkpoint read at each worker count (CPU, a tiny checkpoint)."""

import os
import subprocess
import sys

from tests.support import REPO
from tests.support.hf_tiny import build_hf_model


def test_weights_load_reports_each_worker_count(tmp_path):
    build_hf_model("llama", str(tmp_path / "ckpt"), max_shard_size="100KB")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "tools", "weights_load.py"), "--model",
                           str(tmp_path / "ckpt"), "--workers", "1,3", "--repeat", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"], proc.stdout
    assert all(float(r.split("|")[2]) > 0 for r in rows), proc.stdout
    first = [line for line in proc.stdout.splitlines() if line.startswith("| default, the first load")]
    assert len(first) == 1 and float(first[0].split("|")[2]) > 0, proc.stdout  # what a starting server pays
