"""The serving benchmark (``bench/serving/serve.py``) run through ``inferscale bench serve`` against a real
server with a tiny load: every figure of its JSON is there, nothing failed, warm-segment requests
read cached tokens, and percentiles are ordered.  No timing thresholds (speed is measured by the
benchmark, not asserted here).  About 30-60 s on a 2-core CPU (server start and compiles included)."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys

from tests.support.server_util import REPO, cache_dir

_spec = importlib.util.spec_from_file_location("bench_report", os.path.join(REPO, "bench", "lib", "report.py"))
bench_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_report)  # (loaded from its file: bench/lib stays off sys.path)

DIST_KEYS = {"p50", "p90", "p99", "mean", "n"}
POINT_KEYS = {"mode", "rate", "concurrency", "requests", "completed", "errors", "error_samples", "wall_s",
              "request_throughput", "output_throughput", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "register_ms",
              "prompt_tokens", "cached_tokens", "completion_tokens", "cached_ratio", "tokens_per_chunk",
              "by_kind", "compiles", "first_runs", "steady_output_throughput", "cpu", "client_procs", "engine_steps",
              "ttft_split"}
KIND_KEYS = {"requests", "errors", "ttft_ms", "e2e_ms", "register_ms", "prompt_tokens", "cached_tokens",
             "cached_ratio"}


def ordered(d: dict) -> bool:
    return d["p50"] <= d["p90"] <= d["p99"]


def run_bench(tmp_path, tmp_path_factory, *load: str) -> tuple[str, str]:
    """``inferscale bench serve`` as a user types it, with the tiny load options and ``load``:
    (the results prefix, the output's tail); fails the test when it exits non-zero."""
    cache = os.environ.get("INFERSCALE_CACHE") or cache_dir(tmp_path_factory)
    env = dict(os.environ, INFERSCALE_CACHE=cache, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "jax-compile-cache"))
    prefix = tmp_path / "serve_test"
    cmd = [sys.executable, "-m", "inferscale_cli", "bench", "serve", *load,
           "--max-tokens", "4", "--tenants", "2", "--segments-per-tenant", "1", "--segment-tokens", "48",
           "--question-tokens", "8", "--warmup-requests", "1", "--warmup-burst", "2", "--hbm-pages", "256",
           "--seed", "3", "--device", "cpu", "--out", str(prefix), "--work-dir", str(tmp_path / "work")]
    # its own process group: a timeout takes the benchmark's server down with it
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (a server left by a failed run)
    tail = f"\n--- output (tail) ---\n{out[-4000:]}\n{err[-3000:]}"
    assert proc.returncode == 0, tail
    return prefix, tail


def assert_ttft_split(point, n, tail=""):
    """Every request's engine times were found (the server's log lines, or in-process the final
    output's), and they fit inside the client's TTFT."""
    split = point["ttft_split"]
    assert split is not None, tail
    for key in ("engine_ms", "queue_ms", "prefill_ms", "outside_ms"):
        assert split[key]["n"] == n and set(split[key]) == DIST_KEYS, (key, split[key])
    assert 0 < split["engine_ms"]["p50"] < point["ttft_ms"]["p50"], split
    assert 0 <= split["queue_ms"]["p50"] <= split["engine_ms"]["p50"], split
    assert split["outside_ms"]["p50"] > 0 and split["prefill_ms"]["p50"] > 0, split
    means = split["engine_ms"]["mean"] + split["outside_ms"]["mean"]
    assert abs(means - point["ttft_ms"]["mean"]) < 1e-6 * max(1.0, means), split  # the two parts add up


def test_bench_serve_tiny_load(tmp_path, tmp_path_factory):
    prefix, tail = run_bench(tmp_path, tmp_path_factory, "--rates", "4", "--num-requests", "4")
    summary = json.loads(prefix.with_suffix(".json").read_text())
    assert (tmp_path / "serve_test.md").read_text().count("| 4 req/s |") == 5, tail  # the point, its TTFT split, 3 kinds
    assert summary["device"] == "cpu" and summary["texts_inexact"] == 0, tail
    assert summary["warmup"]["errors"] == 0 and summary["warmup"]["compiles"] > 0, tail
    # the commit measured and the INFERSCALE_* switches set outside the command line are on record
    assert summary["code"] and f"; code {summary['code']}" in (tmp_path / "serve_test.md").read_text(), tail
    assert summary["switches"] == bench_report.switch_lines(), summary["switches"]  # (the child has this env)

    [point] = summary["points"]
    assert set(point) == POINT_KEYS, tail
    assert point["mode"] == "rate" and point["rate"] == 4.0 and point["concurrency"] is None
    assert point["requests"] == point["completed"] == 4 and point["errors"] == 0, point["error_samples"]
    assert point["completion_tokens"] == 4 * 4  # ignore_eos: every request makes max_tokens
    assert point["request_throughput"] > 0 and point["output_throughput"] > 0
    assert isinstance(point["compiles"], int) and point["compiles"] >= 0
    assert isinstance(point["first_runs"], int) and point["first_runs"] >= 0  # (stats' first_runs_left, before - after)
    assert point["steady_output_throughput"] is None  # (a Poisson point has no closed-loop window)
    assert point["cpu"]["bench"] > 0 and point["client_procs"] == 1
    steps = point["engine_steps"]  # the server's own step counts: 4 requests of 4 tokens, 3 decode rows each
    assert steps["steps"] >= 4 and steps["rows"] >= steps["decode_rows"] > 0 and steps["step_ms"] > 0, steps
    assert round(steps["decode_rows"] * steps["steps"]) == 4 * 3, steps
    assert steps["padded_tokens"] >= steps["tokens"] > 0, steps  # (each step padded to its bucket)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(point[key]) == DIST_KEYS and ordered(point[key]), (key, point[key])
    assert point["ttft_ms"]["n"] == point["e2e_ms"]["n"] == 4
    assert point["ttft_ms"]["p50"] <= point["e2e_ms"]["p50"]
    assert_ttft_split(point, 4, tail)

    # default mix 0.5 / 0.25 / 0.25 of 4 requests: 2 warm, 1 cold, 1 without a segment
    kinds = point["by_kind"]
    assert {k: v["requests"] for k, v in kinds.items()} == {"warm": 2, "cold": 1, "none": 1}
    for kind in kinds.values():
        assert set(kind) == KIND_KEYS and kind["errors"] == 0
    # a warm request's prompt is its 48-token segment (cached) + an 8-token question
    assert kinds["warm"]["cached_ratio"] > 0 and kinds["warm"]["cached_tokens"] >= 2 * 48 - 2 * 16
    assert kinds["cold"]["register_ms"]["n"] == 1 and kinds["warm"]["register_ms"] is None
    assert 0 < point["cached_ratio"] < 1


def test_bench_serve_closed_loop_over_client_processes(tmp_path, tmp_path_factory):
    """``--client-procs 2``: the clients of a closed loop in two benchmark processes, every request
    counted once, the CPU of both processes and the server's reported."""
    prefix, tail = run_bench(tmp_path, tmp_path_factory, "--concurrency", "2", "--num-requests", "6",
                             "--client-procs", "2", "--warm", "1.0", "--cold", "0")
    [point] = json.loads(prefix.with_suffix(".json").read_text())["points"]
    assert point["concurrency"] == 2 and point["client_procs"] == 2, tail
    assert point["requests"] == point["completed"] == 6 and point["errors"] == 0, point["error_samples"]
    assert point["completion_tokens"] == 6 * 4 and point["ttft_ms"]["n"] == 6
    assert_ttft_split(point, 6, tail)  # (the request ids came back from the client processes)
    # the API process alone can stay under one clock tick (10 ms) for six 4-token requests; the server as a
    # whole (API process + engine core child) cannot
    cpu = point["cpu"]
    assert cpu["bench"] > 0 and cpu["server"] >= 0 and cpu["server"] + cpu["server_children"] > 0, cpu
    assert "(2 procs)" in prefix.with_suffix(".md").read_text()


def test_steady_window_counts_tokens_while_every_client_is_busy():
    """bench/serving/serve.py's steady output tok/s: from the first request's end to the last one's send,
    each request's tokens spread over its decode; None when that window is empty."""
    import runpy

    serve = runpy.run_path(os.path.join(REPO, "bench", "serving", "serve.py"), run_name="serve_under_test")
    Result, steady = serve["Result"], serve["steady_throughput"]

    def res(start, ttft, e2e, tokens):
        return Result("warm", ok=True, start=start, ttft=ttft, e2e=e2e, completion_tokens=tokens)
    # two clients: requests end at 2 and 3; the last sends are at 2 and 3 -> window [2, 3]
    rs = [res(0.0, 0.0, 2.0, 20), res(0.0, 1.0, 3.0, 20), res(2.0, 0.0, 2.0, 20), res(3.0, 0.0, 2.0, 20)]
    # inside [2, 3]: 0 of the first, half of the second (decode 1..3), half of the third (2..4), none of the last
    assert steady(rs) == (0 + 10 + 10 + 0) / 1.0
    assert steady(rs[:2]) is None  # everyone sent once: the last send (0) is before the first end (2)


def test_waits_for_the_servers_first_runs():
    """bench/serving/serve.py waits after its warm-up until the engine reports no bucket's first run
    left (a server leaves them to idle time), within its timeout, through failed polls; and reports
    the wait, what was left and the first runs a load point met from the stats before and after it."""
    import asyncio
    import runpy

    serve = runpy.run_path(os.path.join(REPO, "bench", "serving", "serve.py"), run_name="serve_under_test")
    wait, first_runs = serve["wait_first_runs"], serve["first_runs"]
    cell, words = serve["compiles_cell"], serve["warmup_first_runs"]

    class Client:
        via = "http"

        def __init__(self, lefts):
            self.lefts, self.calls = list(lefts), 0

        async def stats(self):
            self.calls += 1
            left = self.lefts.pop(0) if len(self.lefts) > 1 else self.lefts[0]
            if isinstance(left, Exception):
                raise left
            return None if left is None else {"first_runs_left": left}

    def waited(client, stats, timeout):
        return asyncio.run(wait(client, stats, timeout))

    c = Client([3, 1, 0])
    took, last = waited(c, {"first_runs_left": 5}, 30.0)
    assert took >= 1.0 and c.calls == 3 and last == {"first_runs_left": 0}  # polled until 0; the last stats read
    c = Client([2, None, TimeoutError("stuck"), 0])  # an error reply and a failed poll: the wait goes on
    took, last = waited(c, {"first_runs_left": 5}, 30.0)
    assert took >= 1.5 and c.calls == 4 and last == {"first_runs_left": 0}
    c = Client([2])
    took, last = waited(c, {"first_runs_left": 2}, 0.6)
    assert 0.5 <= took < 5.0 and last == {"first_runs_left": 2}  # the timeout ends it
    c = Client([2])
    assert waited(c, {"first_runs_left": 0}, 30.0) == (0.0, {"first_runs_left": 0}) and c.calls == 0  # none left
    assert waited(c, {"first_runs_left": 4}, 0.0) == (0.0, {"first_runs_left": 4}) and c.calls == 0  # timeout 0
    assert waited(c, {"compiles": 1}, 30.0) == (0.0, {"compiles": 1}) and waited(c, None, 30.0) == (0.0, None)
    assert first_runs({"first_runs_left": 7}, {"first_runs_left": 4}) == 3
    assert first_runs({"compiles": 1}, {"compiles": 1}) is None and first_runs(None, None) is None
    assert cell({"compiles": 2, "first_runs": 3}) == "2 (3)" and cell({"compiles": 0, "first_runs": 0}) == "0"
    assert cell({"compiles": None}) == "n/a"
    assert words({"first_runs_wait_s": 0.0, "first_runs_left": 0}) == ""
    assert words({"first_runs_wait_s": 8.2, "first_runs_left": 0}) == "; then 8.2 s waiting for the buckets' first " \
        "runs, none left"
    assert "5 still left" in words({"first_runs_wait_s": 0.0, "first_runs_left": 5})  # no wait (timeout 0)
