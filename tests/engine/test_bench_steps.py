"""bench/engine/steps.py runs as documented on the CPU (``--quick``, the decode section): the report's decode row
divides the step by the larger of its two floors, both from rates measured in the same run (the read bandwidth and
the bf16 matmul rate), and says so."""

import json
import re
import subprocess
import sys

from tests.support.server_util import REPO


def test_decode_section_reports_the_step_against_measured_floors(tmp_path):
    run = subprocess.run([sys.executable, "bench/engine/steps.py", "--quick", "--sections", "decode", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "steps.json").read_text())
    floors = res["floors"]
    assert floors["read_GBps"] > 0 and floors["matmul_TFLOPs"] > 0, floors
    rows = res["decode"]
    assert [r["rows"] for r in rows] == [1], rows  # (--quick: max_batch 31, the 64 / 256 rows left out)
    for r in rows:
        assert r["steps"] > 0 and r["step_ms"] > 0 and r["compute_floor_ms"] > 0, r
        floor = max(r["weight_floor_ms"], r["compute_floor_ms"])
        assert abs(r["ratio"] - r["step_ms"] / floor) <= 0.02 * r["ratio"], r  # (the fields are rounded)
    report = (tmp_path / "steps.md").read_text()
    assert re.search(r"bf16 matmul [\d.]+ TFLOP/s \(both measured in this run", report), report
    assert re.search(r"^\| 1 \| 1 \| [\d.]+ \|", report, re.M), report
