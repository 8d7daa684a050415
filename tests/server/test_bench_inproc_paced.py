"""``bench/serving/inproc_paced.py`` as documented: ``AsyncEngine`` over the model-free paced engine
with closed-loop clients; its table counts every request's tokens, and a request's first token
comes in the step that admits it or the next (TTFT in steps), never from a missing stream."""

import os
import subprocess
import sys

from tests.support.server_util import REPO


def test_inproc_paced_reports_a_full_table():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "bench/serving/inproc_paced.py", "--concurrency", "4", "--step-ms", "10",
                          "--max-batch", "4", "--requests-per-client", "3", "--max-tokens", "5"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = out.stdout.strip().splitlines()[-1].strip("| ").split(" | ")
    tok_s, ceiling, rows = float(row[0]), float(row[1]), float(row[2])
    assert ceiling == 4 / 0.010  # min(clients, max_batch) rows per 10 ms step
    assert 0 < tok_s <= ceiling * 1.25 and 0 < rows <= 4  # (a short run: its first step is not paced)
    ttft_steps_p50 = int(row[5].split(" / ")[0])
    assert 1 <= ttft_steps_p50 <= 3  # a row for every client: admitted at the next step
