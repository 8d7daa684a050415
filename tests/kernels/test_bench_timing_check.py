"""bench/tools/timing_check.py runs end to end in its --smoke mode (tiny shapes, the CPU): the engine's shared
part timed by the harness, after the spin (skipped off the GPU) and chained in a fori_loop whose calls depend
on each other; the profiler's device column stays empty off the GPU."""

import re

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("tools/timing_check.py", tmp_path, "timing_check.md")
    assert "FAIL" not in report and "Traceback" not in stdout
    row = next(line for line in report.splitlines() if line.startswith("| smoke | engine |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    harness, spun, chained = (float(c) for c in cells[2:5])
    assert min(harness, spun, chained) > 0 and cells[5] == ""
    assert re.search(r"chained x2", report)
