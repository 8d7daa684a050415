"""bench/kernels/mixed_shared.py runs end to end in its --smoke mode (tiny shapes, interpret mode): every
variant of the mixed step's shared part, and the ragged kernel over whole page lists, equal the engine's."""

import os
import subprocess
import sys

from tests.support import REPO


def test_smoke_run_writes_the_report(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "kernels", "mixed_shared.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "mixed_shared.md").read_text()
    assert "FAIL" not in report and "failed" not in proc.stdout
    for step in ("cohort", "spread"):
        for variant in ("engine", "ragged", "sp=1", "br=16,sp=2"):
            assert f"| {step} | {variant} |" in report
    assert proc.stdout.count("vs engine: rel err") == 6  # ragged and two variants, both steps
