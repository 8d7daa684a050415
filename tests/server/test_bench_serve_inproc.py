"""The serving benchmark's in-process via (``bench/serving/serve.py --in-process``: the same workload through
``AsyncEngine`` in the benchmark's own process): its options, that ``--context`` changes only the
context of the same drawn requests, and a tiny closed-loop run whose JSON has every figure, no
error, and warm requests reading cached tokens.  No timing thresholds.  About 30-50 s on a 2-core CPU."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.server_util import REPO, cache_dir
from tests.server.test_bench_serve import assert_ttft_split


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serve_under_test", os.path.join(REPO, "bench", "serving", "serve.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_mode_options():
    bench = load_bench()
    assert bench.parse_args([]).mode == ["http"]  # the default stays the HTTP server only
    assert bench.parse_args(["--in-process"]).mode == ["inproc"]
    assert bench.parse_args(["--mode", "inproc,http"]).mode == ["http", "inproc"]  # HTTP always first
    args = bench.parse_args(["--concurrency", "1,16,64,256", "--num-requests", "32"])
    assert [bench.point_requests(args, "concurrency", c) for c in args.concurrency] == [32, 32, 128, 512]
    assert bench.point_requests(bench.parse_args(["--rates", "2", "--num-requests", "5"]), "rate", 2.0) == 5
    for bad in (["--mode", "grpc"], ["--in-process", "--mode", "http"], ["--url", "http://x", "--mode", "http,inproc"],
                ["--server-log", __file__],  # (a log without --url: the server started here has its own)
                ["--url", "http://x", "--server-log", "no/such/server.log"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_context_changes_only_the_context(tmp_path_factory):
    from inferscale_jax import default_model_dir
    from inferscale_jax.tokenizer import load_tokenizer

    bench = load_bench()
    maker = bench.TextMaker(load_tokenizer(default_model_dir(cache_dir(tmp_path_factory))))
    warm = {"t0": [("s0", " alpha beta"), ("s1", " gamma delta")]}
    drawn = {}
    for context in bench.CONTEXTS:
        args = bench.parse_args(["--context", context, "--segment-tokens", "12", "--question-tokens", "5",
                                 "--warm", "0.5", "--cold", "0.25"])
        drawn[context] = bench.make_specs(8, None, args, ["t0"], warm, maker, np.random.default_rng(7), "x")
    seg, inline, none = drawn["segment"], drawn["inline"], drawn["none"]
    assert [s.question for s in seg] == [s.question for s in inline] == [s.question for s in none]
    assert {s.kind for s in seg} == {"warm", "cold", "none"} and {s.kind for s in none} == {"none"}
    for s, i, n in zip(seg, inline, none):
        assert n.prompt == n.question and n.segment is None and n.cold_text is None
        assert i.segment is None and i.cold_text is None and i.kind == s.kind
        if s.kind == "warm":
            assert i.prompt == dict(warm["t0"])[s.segment] + s.question and s.cold_text is None
        elif s.kind == "cold":
            assert i.prompt == s.cold_text + s.question and maker.length(s.cold_text) == 12
        else:
            assert i.prompt == s.prompt == s.question


def test_max_tokens_spread_draws_each_requests_length(tmp_path_factory):
    """--max-tokens-spread S: each request's max_tokens in max_tokens +- S (varied, so a closed loop's clients
    do not run in cohorts); without it every request takes --max-tokens and the draws are as before."""
    from inferscale_jax import default_model_dir
    from inferscale_jax.tokenizer import load_tokenizer

    bench = load_bench()
    maker = bench.TextMaker(load_tokenizer(default_model_dir(cache_dir(tmp_path_factory))))
    warm = {"t0": [("s0", " alpha beta"), ("s1", " gamma delta")]}
    base = ["--max-tokens", "16", "--question-tokens", "5"]
    spread = bench.make_specs(64, None, bench.parse_args(base + ["--max-tokens-spread", "8"]), ["t0"], warm, maker,
                              np.random.default_rng(7), "x")
    lengths = [s.max_tokens for s in spread]
    assert all(8 <= n <= 24 for n in lengths) and len(set(lengths)) > 8
    plain = bench.make_specs(64, None, bench.parse_args(base), ["t0"], warm, maker, np.random.default_rng(7), "x")
    assert all(s.max_tokens is None for s in plain)
    assert spread[0].question == plain[0].question  # (the spread is drawn after each request's other draws)
    for bad in (base + ["--max-tokens-spread", "16"], base + ["--max-tokens-spread", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bench_serve_in_process(tmp_path, tmp_path_factory):
    cache = os.environ.get("INFERSCALE_CACHE") or cache_dir(tmp_path_factory)
    env = dict(os.environ, INFERSCALE_CACHE=cache, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "jax-compile-cache"))
    prefix = tmp_path / "serve_inproc"
    cmd = [sys.executable, "-m", "inferscale_cli", "bench", "serve", "--in-process", "--concurrency", "2",
           "--num-requests", "4", "--max-tokens", "4", "--tenants", "2", "--segments-per-tenant", "1",
           "--segment-tokens", "48", "--question-tokens", "8", "--warmup-requests", "1", "--warmup-burst", "2",
           "--hbm-pages", "256", "--serve-args", "--no-warmup --dtype float32", "--seed", "3", "--device", "cpu",
           "--out", str(prefix)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    tail = f"\n--- output (tail) ---\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    summary = json.loads(prefix.with_suffix(".json").read_text())
    assert summary["vias"] == ["inproc"] and summary["comparison"] == [] and summary["server_command"] is None
    run = summary["runs"]["inproc"]
    assert run["engine_config"]["hbm_pages"] == 256 and run["engine_config"]["dtype"] == "float32", tail
    assert summary["points"] == run["points"] and summary["warmup"] == run["warmup"]
    assert run["warmup"]["errors"] == 0 and run["warmup"]["compiles"] > 0 and run["warmup"]["segments"] == 2, tail
    [point] = run["points"]
    assert point["mode"] == "concurrency" and point["concurrency"] == 2
    assert point["requests"] == point["completed"] == 4 and point["errors"] == 0, point["error_samples"]
    assert point["completion_tokens"] == 4 * 4  # ignore_eos: every request makes max_tokens
    assert point["output_throughput"] > 0 and isinstance(point["compiles"], int)
    assert point["first_runs"] == 0  # (an in-process engine makes its first runs in the warm-up)
    steps = point["engine_steps"]  # 4 requests of 4 tokens: 3 decode rows each after the prefill
    assert steps["steps"] >= 4 and steps["rows"] >= steps["decode_rows"] > 0 and steps["step_ms"] > 0, steps
    assert steps["decode_rows"] * steps["steps"] == 4 * 3, steps
    assert steps["padded_tokens"] >= steps["tokens"] > 0, steps  # (each step padded to its bucket)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert point[key]["p50"] <= point[key]["p90"] <= point[key]["p99"], (key, point[key])
    assert point["ttft_ms"]["n"] == 4 and point["tokens_per_chunk"] >= 1
    assert_ttft_split(point, 4, tail)
    assert "Where TTFT goes" in (tmp_path / "serve_inproc.md").read_text()
    kinds = point["by_kind"]
    assert {k: v["requests"] for k, v in kinds.items()} == {"warm": 2, "cold": 1, "none": 1}
    assert kinds["warm"]["cached_tokens"] >= 2 * 48 - 2 * 16 and kinds["cold"]["register_ms"]["n"] == 1
    assert "| 2 clients | inproc |" in (tmp_path / "serve_inproc.md").read_text()
