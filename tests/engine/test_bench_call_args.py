"""bench/tools/call_args.py runs as documented on the CPU (``--smoke``): every argument count is
timed, and the stacked weights' slices give the same matmul sums as separate arrays."""

import re
import subprocess
import sys

from tests.support.server_util import REPO


def test_call_args_smoke(tmp_path):
    run = subprocess.run([sys.executable, "bench/tools/call_args.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = (tmp_path / "call_args.md").read_text()
    calls = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \|$", report, re.M)
    assert [(int(w), int(c)) for w, c, _, _ in calls] == [(195, 64), (195, 2), (9, 64), (9, 2), (1, 1)], report
    assert all(int(n) == int(w) + 2 * int(c) and float(us) > 0 for w, c, n, us in calls)
    for form in ("separate arrays", "one stacked array, sliced"):
        assert re.search(rf"^\| {form} \| [\d.]+ \| \d+ \| [\d.]+ \|$", report, re.M), report
    diff = float(re.search(r"^\| max abs difference \(the two sums\) \| ([\d.e+-]+) \|", report, re.M).group(1))
    assert diff < 1e-2, report
