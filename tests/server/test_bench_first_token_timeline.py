"""bench/tools/first_token_timeline.py over the model-free paced engine: every point of a request's
path through ``serve`` is reached in order, and the stretches add up to the client's TTFT."""

import os
import re
import subprocess
import sys

from tests.support.server_util import REPO, cache_dir


def test_the_timeline_covers_every_stretch_of_the_first_token(tmp_path, tmp_path_factory):
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu")
    out = tmp_path / "timeline.md"
    proc = subprocess.run([sys.executable, "bench/tools/first_token_timeline.py", "--paced-step-ms", "20",
                           "--requests", "8", "--skip", "2", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\| (\w+) \| (\w+)(?: \(TTFT\))? \| \**([\d.]+)\** \| \**([\d.]+)\** \|$",
                      out.read_text(), re.M)
    assert [r[0] for r in rows[:-1]] == ["client_send", "uvicorn_data", "asgi_enter", "route_job", "stream_enter",
                                         "tokenized", "submit_sent", "core_recv", "core_sent", "step_received",
                                         "first_delta", "first_body"]  # (the paced engine: no runner points)
    assert rows[-1][:2] == ("client_send", "client_first")
    medians, means = [float(r[2]) for r in rows[:-1]], [float(r[3]) for r in rows[:-1]]
    total_median, total_mean = float(rows[-1][2]), float(rows[-1][3])
    assert all(s >= 0 for s in medians + means) and total_median > 0
    # every request has every point, so the stretches' means add up to the TTFT's mean (to the 3 decimals
    # printed); medians need not add up (a stretch long in a few requests only moves the total's median)
    assert abs(sum(means) - total_mean) < 0.001 * len(means) + 1e-9, rows
    assert max(medians) <= total_median + 0.001, rows  # (each request's TTFT holds each of its stretches)
    assert "6 requests" in out.read_text()


def test_the_core_points_with_the_real_engine(tmp_path, tmp_path_factory):
    """With a model (the embedded default one), the core process's runner points are installed there (the
    spawned core imports the tool as its main module) and sit in order between submit and step message."""
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu")
    out = tmp_path / "timeline.md"
    proc = subprocess.run([sys.executable, "bench/tools/first_token_timeline.py", "--requests", "4", "--skip", "1",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\| (\w+) \| (\w+) \| (-?[\d.]+) \| (-?[\d.]+) \|$", out.read_text(), re.M)
    assert [r[0] for r in rows][6:13] == ["submit_sent", "core_recv", "dispatch_start", "dispatch_end",
                                          "collect_start", "collect_end", "core_sent"], rows
    assert all(float(r[2]) >= 0 for r in rows) and "3 requests" in out.read_text()
