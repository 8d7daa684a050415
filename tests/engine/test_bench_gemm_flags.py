"""bench/kernels/gemm_flags.py runs as documented on the CPU (``--smoke``): every flag set's process
starts, every shape is timed at every row count, and each point's last matmul (first row) matches
``jnp.dot``."""

import re
import subprocess
import sys

from tests.support.server_util import REPO


def test_gemm_flags_smoke(tmp_path):
    run = subprocess.run([sys.executable, "bench/kernels/gemm_flags.py", "--smoke", "--reps", "3", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = (tmp_path / "gemm_flags.md").read_text()
    points = re.findall(r"^\| (qkv|o|gate_up|down|lm_head) \| (\d+) \| (.+) \|$", report, re.M)
    assert sorted({(s, int(m)) for s, m, _ in points}) == sorted(
        (s, m) for s in ("qkv", "o", "gate_up", "down", "lm_head") for m in (1, 4)), report
    for _, _, cells in points:
        assert "n/a" not in cells and len(cells.split(" | ")) == 3, report
    sets = re.findall(r"^\| (default|exhaustive|cublas) \| .+ \| \d+ \| ([\d.e+-]+) \|  \|$", report, re.M)
    assert [s for s, _ in sets] == ["default", "exhaustive", "cublas"], report
    assert all(float(e) < 0.05 for _, e in sets), report
    steps = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", report, re.M)
    assert [int(m) for m, *_ in steps] == [1, 4], report
