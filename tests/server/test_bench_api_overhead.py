"""``bench/serving/api_overhead.py`` as documented: the real ``serve`` over the model-free paced
engine (``bench/lib/paced_engine.py``) streams each request its ``max_tokens`` tokens, one per
paced step, detokenized by the API process; SIGTERM stops it cleanly."""

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.support.server_util import REPO, cache_dir, free_port, sse_events, stream_text


def test_api_overhead_serves_paced_tokens_and_stops(tmp_path, tmp_path_factory):
    port = free_port()
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "bench/serving/api_overhead.py", "--step-ms", "20", "--",
                             "--port", str(port), "--max-batch", "8"], cwd=REPO, env=env, stdout=log,
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
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
