"""``bench/serving/api_overhead.py`` as documented: the real ``serve`` over the model-free paced
engine (``bench/lib/paced_engine.py``) streams each request its ``max_tokens`` tokens, one per
paced step, detokenized by the API process; ``bench/serving/serve.py --url --server-log`` over it
splits each request's TTFT with the paced engine's own clock; SIGTERM stops it cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.test_bench_serve import assert_ttft_split
from tests.support.server_util import REPO, cache_dir, free_port, sse_events, stream_text

pytestmark = pytest.mark.alone  # (engine and prefill milliseconds: conftest.py)


def test_api_overhead_serves_paced_tokens_and_stops(tmp_path, tmp_path_factory):
    port = free_port()
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "bench/serving/api_overhead.py", "--step-ms", "20", "--",
                             "--port", str(port), "--max-batch", "8", "--log-level", "info",
                             "--log-requests"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        t0 = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "what does the engine read", "max_tokens": 6, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        wall = time.monotonic() - t0
        assert events[-1] == "[DONE]"
        text = stream_text(events)
        # the paced engine's words, in order (6 tokens of the tiny tokenizer: a prefix of the sentence)
        assert len(text) > 3 and "the engine reads each shared page once".startswith(text.strip()), text
        usage = [e for e in events[:-1] if e.get("usage")][-1]["usage"]
        assert usage["completion_tokens"] == 6
        assert wall >= 6 * 0.020 * 0.9  # one token per paced step

        # the benchmark over this running server, its TTFT split from the server's log (a relative path, as typed)
        out = tmp_path / "paced"
        bench = subprocess.run([sys.executable, "bench/serving/serve.py", "--url", url, "--server-log",
                                os.path.relpath(tmp_path / "server.log", REPO), "--concurrency", "2",
                                "--num-requests", "4", "--context", "none", "--max-tokens", "4", "--out", str(out)],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        point = json.loads(out.with_suffix(".json").read_text())["points"][0]
        assert point["completed"] == 4, point
        assert_ttft_split(point, 4, bench.stderr[-3000:])
        # the paced engine admits a request at its next step and gives it a token in that step:
        # its engine TTFT is its queue, under two paced steps
        split = point["ttft_split"]
        assert split["engine_ms"]["p50"] < 2 * 20 + 5 and split["prefill_ms"]["p50"] < 5, split
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
