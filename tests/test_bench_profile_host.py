"""bench/profile_host.py runs as documented on a tiny local checkpoint and reports what it claims:
per-step wall time, the host's share, the output rate and both cProfile tables."""

import re
import subprocess
import sys

from server_util import REPO


def test_profile_host_reports_host_time_and_profiles(tmp_path):
    ckpt = tmp_path / "tiny"
    subprocess.run([sys.executable, "bench/make_checkpoint.py", str(ckpt), "--quick"], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    out = tmp_path / "report.md"
    run = subprocess.run([sys.executable, "bench/profile_host.py", "--model", str(ckpt), "--concurrency", "4",
                          "--segments", "2", "--segment-tokens", "48", "--question-tokens", "8", "--max-tokens", "6",
                          "--warm-steps", "12", "--steps", "10", "--top", "5", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = out.read_text()
    wall = float(re.search(r"plain: ([\d.]+) ms per step", report).group(1))
    host, waited = map(float, re.search(r"host time per step .*?: ([\d.]+) ms; waited ([\d.]+) ms", report).groups())
    assert wall > 0 and 0 <= host <= wall and abs(host + waited - wall) < 0.05 * wall + 0.05
    assert float(re.search(r"([\d.]+) outputs per step", report).group(1)) > 0
    assert "## by tottime" in report and "## by cumulative" in report and "scheduler.py" in report
