"""bench/tools/exe_store_check.py: two fresh processes over one cache, the executable store on; the
second loads every step the first stored, over the same pool and fingerprint (run AL's question)."""

import os
import subprocess
import sys

from tests.support import REPO


def test_a_second_process_loads_the_first_ones_steps(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "tools", "exe_store_check.py"), "--cache",
                           str(tmp_path / "cache"), "--out", str(tmp_path / "check.md")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "check.md").read_text()
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2 and rows[0][2] == rows[1][2], report  # the same pool
    saved, loaded = int(rows[0][7]), int(rows[1][6])
    assert saved > 0 and loaded == saved and int(rows[1][7]) == 0, report  # all loaded, none compiled again
    assert "fingerprint parts that differ: none" in report and ": ok" in report, report
