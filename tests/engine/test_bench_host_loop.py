"""bench/tools/host_loop.py runs as documented (no device, no checkpoint) and its step-bucket table
counts what the scheduler planned: with spread answer lengths the round-down of a step's token
budget (``scheduler.ROUND_DOWN_MIN_TOKENS``) moves steps out of the bucket above 512 tokens, and
``--no-round-down`` brings them back."""

import re
import subprocess
import sys

from tests.support.server_util import REPO

ARGS = ["--concurrency", "256", "--segments", "2", "--segment-tokens", "256", "--max-tokens-spread", "32",
        "--warm-steps", "60", "--steps", "60"]


def buckets(tmp_path, *extra: str) -> dict[str, tuple[int, float]]:
    out = tmp_path / "host_loop.md"
    run = subprocess.run([sys.executable, "bench/tools/host_loop.py", *ARGS, *extra, "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = out.read_text()
    assert float(re.search(r"host ms per step: ([\d.]+)", report).group(1)) > 0
    rows = re.findall(r"^\| ((?:decode|mixed) \d+) \| (\d+) \| ([\d.]+) \| (\d+)% \|$", report, re.M)
    table = {name: (int(steps), float(real)) for name, steps, real, _ in rows}
    assert sum(steps for steps, _ in table.values()) == 60
    for name, (_, real) in table.items():
        assert real <= int(name.split()[1])
    return table


def test_host_loop_counts_steps_by_bucket_and_the_round_down_empties_the_one_above(tmp_path):
    rounded, plain = buckets(tmp_path), buckets(tmp_path, "--no-round-down")
    above = rounded.get("mixed 1024", (0, 0))[0]
    assert plain.get("mixed 1024", (0, 0))[0] > 2 * above + 3, (rounded, plain)
    assert rounded["mixed 512"][1] > plain["mixed 512"][1]  # (the 512 bucket fuller)
