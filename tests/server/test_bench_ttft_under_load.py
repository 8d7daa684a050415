"""bench/tools/ttft_under_load.py over the model-free paced engine with two API processes: every
request passes every point in both processes, the stretches are in order, and the engine's own
TTFT (one paced step) is reported beside them; over the default model with ``--segments``, every
kept request named a registered segment; bad options are refused before anything starts."""

import os
import re
import subprocess
import sys

from tests.support.server_util import REPO, cache_dir


def test_stretches_under_load_cover_every_api_process(tmp_path, tmp_path_factory):
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu")
    out = tmp_path / "load.md"
    proc = subprocess.run([sys.executable, "bench/tools/ttft_under_load.py", "--paced-step-ms", "20",
                           "--concurrency", "8", "--seconds", "6", "--skip-s", "1", "--max-tokens", "8",
                           "--out", os.path.relpath(out, REPO), "--", "--api-server-count", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    sent = int(re.search(r"\((\d+) requests in all", text).group(1))
    kept, named = map(int, re.search(r"^(\d+) requests \((\d+) naming a segment\); ms", text, re.M).groups())
    assert named == 0, text
    # the first second's requests are left out; a request answered by either API process has its points
    assert sent >= 20 and 0.5 * sent <= kept < sent, text
    rows = re.findall(r"^\| (.+?) \| (.+?) \| \**([\d.]+)\** \| \**([\d.]+)\** \|$", text, re.M)
    assert [r[0] for r in rows[:5]] == ["client_send", "stream_enter", "step_received", "first_delta", "first_body"]
    assert [r[1] for r in rows[:5]] == ["stream_enter", "step_received", "first_delta", "first_body", "client_first"]
    p50 = [float(r[2]) for r in rows]
    assert all(v >= 0 for v in p50) and all(float(r[3]) >= float(r[2]) for r in rows), rows
    engine, ttft = p50[5], p50[6]
    assert 0 < engine < 2 * 20 + 5, rows  # the paced engine: its next step admits and answers
    assert engine < p50[1] and engine < ttft, rows  # inside the core's stretch, and the client's TTFT
    assert 0.5 * ttft < sum(p50[:5]) < 2 * ttft, rows  # medians of the parts come close to the whole's


def run_tool(tmp_path_factory, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "bench/tools/ttft_under_load.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_segment_workload_names_a_segment_in_every_request(tmp_path, tmp_path_factory):
    out = tmp_path / "seg.md"
    proc = run_tool(tmp_path_factory, "--concurrency", "4", "--seconds", "8", "--skip-s", "1", "--max-tokens", "6",
                    "--max-tokens-spread", "3", "--segments", "2", "--segment-tokens", "40",
                    "--out", os.path.relpath(out, REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    kept, named = map(int, re.search(r"^(\d+) requests \((\d+) naming a segment\); ms", text, re.M).groups())
    assert kept > 0 and named == kept, text
    engine = float(re.search(r"^\| \(inside stream_enter -> step_received\) \| the engine's TTFT \| ([\d.]+) \|",
                             text, re.M).group(1))
    assert engine > 0, text


def test_bad_options_are_refused(tmp_path_factory):
    for args, says in ((["--paced-step-ms", "20", "--segments", "2"], "--segments needs a model"),
                       (["--max-tokens", "8", "--max-tokens-spread", "8"], "--max-tokens-spread 8 is out of range"),
                       (["--segments", "-1"], "--segments -1")):
        proc = run_tool(tmp_path_factory, *args)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr[-2000:])
