"""bench/kernels/shared_ceiling.py runs end to end in its --smoke mode (tiny shapes, the CPU): the engine's
shared part, dense jnp attention and the head-folded rows the Mosaic GPU form is fed agree, and the Mosaic GPU
call lowers for CUDA."""

import os
import subprocess
import sys

from tests.support import REPO


def test_smoke_run_writes_the_report(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "kernels", "shared_ceiling.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "shared_ceiling.md").read_text()
    assert "FAIL" not in report and "failed" not in proc.stdout
    for form in ("engine", "xla (dense jnp)", "folded rows (jnp)"):
        assert f"| smoke | {form} |" in report
    assert proc.stdout.count("vs engine: rel err") == 2 and "mosaic: lowers for CUDA" in proc.stdout
