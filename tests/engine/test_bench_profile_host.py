"""bench/tools/profile_host.py runs as documented on a tiny local checkpoint and reports what it claims:
per-step wall time, the host's share, the output rate and both cProfile tables; with ``--per-call``
each part of a step and the device's cadence."""

import re
import subprocess
import sys

import pytest
from tests.support.server_util import REPO

ARGS = ["--concurrency", "4", "--segments", "2", "--segment-tokens", "48", "--question-tokens", "8",
        "--max-tokens", "6", "--warm-steps", "12", "--steps", "10"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile_host") / "tiny"
    subprocess.run([sys.executable, "bench/tools/make_checkpoint.py", str(path), "--quick"], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    return path


def profile(ckpt, out, *extra: str) -> str:
    """Run the script as documented on the tiny checkpoint; its report."""
    run = subprocess.run([sys.executable, "bench/tools/profile_host.py", "--model", str(ckpt), *ARGS, *extra,
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out.read_text()


def test_profile_host_reports_host_time_and_profiles(ckpt, tmp_path):
    report = profile(ckpt, tmp_path / "report.md", "--top", "5")
    wall = float(re.search(r"plain: ([\d.]+) ms per step", report).group(1))
    host, waited = map(float, re.search(r"host time per step .*?: ([\d.]+) ms; waited ([\d.]+) ms", report).groups())
    assert wall > 0 and 0 <= host <= wall and abs(host + waited - wall) < 0.05 * wall + 0.05
    assert float(re.search(r"([\d.]+) outputs per step", report).group(1)) > 0
    assert "## by tottime" in report and "## by cumulative" in report and "step_loop.py" in report  # (the loop, on top)


def test_profile_host_per_call_reports_the_parts_and_the_device_cadence(ckpt, tmp_path):
    """``--per-call``: every part of a step timed, each step counted as decode or mixed, and the device's
    cadence (its step-to-step time and idle time) reported from the watched outputs."""
    report = profile(ckpt, tmp_path / "report.md", "--no-profile", "--per-call", "--fresh-inputs")
    decode, mixed = map(int, re.search(r"dispatched steps: (\d+) decode-only, (\d+) mixed", report).groups())
    # (an engine step that only reads back the step in flight dispatches nothing); 6-token requests replaced
    # as they finish: new prompt chunks every few steps
    assert 0 < decode + mixed <= 10 and mixed > 0
    for part in ("runner.dispatch (all)", "runner._pack", "runner._to_device", "runner.collect",
                 "call: step executable", "scheduler._apply_all", "scheduler._admit"):
        assert re.search(rf"\| {re.escape(part)} \| [\d.]+ \|", report), part
    p50 = float(re.search(r"device step to device step: p50 ([\d.]+) ms", report).group(1))
    idle = float(re.search(r"idle waiting for the host: mean ([\d.]+) ms", report).group(1))
    assert p50 > 0 and idle >= 0
    assert float(re.search(r"replayed on the device alone: ([\d.]+) ms", report).group(1)) > 0
    assert re.search(r"replayed on the device alone: [\d.]+ ms \(its bucket: `StepKey\(rows=\d+, tokens=\d+", report)
