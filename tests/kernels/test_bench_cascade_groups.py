"""bench/kernels/cascade_groups.py runs end to end in its --smoke mode (tiny shapes, interpret mode)."""

import os
import subprocess
import sys

from tests.support import REPO


def test_smoke_run_writes_the_report(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "kernels", "cascade_groups.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "cascade_groups.md").read_text()
    assert "FAIL" not in report
    for name in ("plain", "single", "multi", "multi BR=16", "ragged", "ragged + multi"):
        for n in (1, 3):  # every strategy at 6 rows over 1 and 3 segments
            assert f"| 6 | {n} | {name} |" in report
