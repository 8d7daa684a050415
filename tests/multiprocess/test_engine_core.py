"""``inferscale serve``'s default layout: the engine in its own core process (``inferscale_jax/engine_core.py``),
HTTP in API-server processes (``serving/core_client.py``).  Loopback only; every process is ended
by a fixture finalizer (``Server.stop``: SIGTERM, then SIGKILL).

- 64 concurrent greedy streams equal the in-process engine's outputs token for token;
- ``/v1/stats`` names the core's pid and the API servers' (two with ``--api-server-count 2``);
- killing the core process ends every open stream with an error event within 5 s, ``/health``
  answers 503, and the server exits non-zero;
- SIGTERM drains an open stream, takes the final snapshot and exits 0.
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from inferscale_jax import Engine, EngineConfig, SamplingParams, default_model_dir
from tests.support.server_util import ENGINE_KW, Server, cache_dir, wait_for

PROMPTS = [f"Request {i}: tell me about item {i * 13} and its {'very ' * (i % 5)}long history" for i in range(64)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache):
    srv = Server(tmp_path_factory.mktemp("core"), cache)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(cache, server):
    engine = Engine.from_pretrained(default_model_dir(cache), EngineConfig(**ENGINE_KW))
    server.wait_ready()
    yield engine
    engine.close()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


async def _stream(client, body: dict) -> dict:
    """One SSE stream: its events, and when it ended (monotonic)."""
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return {"events": events, "ended": time.monotonic()}


def _tokens(events) -> tuple[list[str], list[float]]:
    """The streamed tokens and their log-probs (each chunk's ``logprobs``), in order."""
    tokens, lps = [], []
    for ev in events:
        if ev != "[DONE]" and ev.get("choices") and ev["choices"][0].get("logprobs"):
            tokens += ev["choices"][0]["logprobs"]["tokens"]
            lps += ev["choices"][0]["logprobs"]["token_logprobs"]
    return tokens, lps


def test_stats_name_the_core_and_api_processes(server, ref):
    stats = httpx.get(server.url + "/v1/stats", timeout=30).json()
    core = stats["engine_process"]["pid"]
    assert core != server.proc.pid and not stats["engine_process"]["in_process"]
    assert _ppid(core) == server.proc.pid  # the core is the API server's child
    assert [a["pid"] for a in stats["api_processes"]] == [server.proc.pid]


def test_64_concurrent_greedy_streams_equal_the_engine_token_for_token(server, ref):
    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)
    want = ref.generate_batch([dict(prompt=p, sampling=sp) for p in PROMPTS])
    tok = ref.tokenizer

    async def main():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=180, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, {"prompt": p, "max_tokens": 16, "temperature": 0,
                                                           "logprobs": 1}) for p in PROMPTS))
    got = asyncio.run(main())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["events"][-1] == "[DONE]" and not any("error" in e for e in g["events"][:-1]), (i, g["events"])
        tokens, lps = _tokens(g["events"])
        assert tokens == [tok.decode([t], skip_special_tokens=True) for t in w.token_ids], i  # the server's form
        assert lps == pytest.approx([lp[t] for t, lp in zip(w.token_ids, w.logprobs)], abs=1e-4), i
        text = "".join(e["choices"][0]["text"] for e in g["events"][:-1] if e["choices"])
        assert text == w.text, i
        finish = [e["choices"][0]["finish_reason"] for e in g["events"][:-1] if e["choices"]][-1]
        assert finish == w.finish_reason, i
    stats = wait_for(lambda: (s := httpx.get(server.url + "/v1/stats", timeout=30).json())["running"] == 0 and s)
    assert stats["waiting"] == 0


def test_two_api_servers_share_the_port_and_the_core(tmp_path, cache, ref):
    """Two API servers, one core; the core runs decode loops (``--decode-steps 4``): a stream's
    tokens, log-probs and text still equal the in-process engine's single steps."""
    srv = Server(tmp_path, cache, "--api-server-count", "2", "--decode-steps", "4")
    try:
        srv.wait_ready()
        sp = SamplingParams(max_tokens=30, temperature=0.0, logprobs=1)
        want = ref.generate_batch([dict(prompt=p, sampling=sp) for p in PROMPTS[:6]])

        async def streams():
            async with httpx.AsyncClient(base_url=srv.url, timeout=180) as client:
                return await asyncio.gather(*(_stream(client, {"prompt": p, "max_tokens": 30, "temperature": 0,
                                                               "logprobs": 1}) for p in PROMPTS[:6]))
        for g, w in zip(asyncio.run(streams()), want):
            tokens, lps = _tokens(g["events"])
            assert tokens == [ref.tokenizer.decode([t], skip_special_tokens=True) for t in w.token_ids]
            assert lps == pytest.approx([lp[t] for t, lp in zip(w.token_ids, w.logprobs)], abs=1e-4)
            assert "".join(e["choices"][0]["text"] for e in g["events"][:-1] if e["choices"]) == w.text
        assert httpx.get(srv.url + "/v1/stats", timeout=30).json()["decode_loops"] > 0
        answered = set()
        for _ in range(200):  # new connections land on either API server (the kernel picks)
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
                assert r.status_code == 200, r.text
                stats = c.get("/v1/stats").json()
                answered.add(stats["api_process"]["pid"])
            if len(answered) == 2:
                break
        apis = {a["pid"] for a in stats["api_processes"]}
        assert len(apis) == 2 and srv.proc.pid in apis and answered == apis, (answered, stats["api_processes"])
        assert _ppid(stats["engine_process"]["pid"]) == srv.proc.pid
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log()[-3000:]
    finally:
        srv.stop()


@pytest.mark.alone  # (a time bound: conftest.py)
def test_killing_the_core_ends_every_stream_with_an_error_and_health_fails(tmp_path, cache):
    srv = Server(tmp_path, cache)
    try:
        srv.wait_ready()
        core = httpx.get(srv.url + "/v1/stats", timeout=30).json()["engine_process"]["pid"]
        started = []

        async def one(client, i):
            events = []
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": f"Story {i}:", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if len(events) == 2:
                            started.append(i)
            return events, time.monotonic()

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(6)]
                while len(started) < 6:
                    await asyncio.sleep(0.05)
                    assert not any(t.done() for t in tasks), "a stream ended before the kill"
                os.kill(core, signal.SIGKILL)
                killed = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
                return killed, results
        killed, results = asyncio.run(main())
        for events, ended in results:
            assert ended - killed < 5.0, ended - killed
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["code"] == "engine_fault"
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_fault"
        assert srv.proc.wait(60) == 1  # then it stops serving, non-zero
        assert "the engine core process exited" in srv.log()
    finally:
        srv.stop()


def test_sigterm_drains_takes_the_final_snapshot_and_exits_0(tmp_path, cache):
    snap = tmp_path / "kv"
    srv = Server(tmp_path, cache, "--snapshot-dir", str(snap))
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/segments", json={"id": "faq", "text": "Returns within thirty days."}, timeout=60)
        assert r.status_code == 201, r.text
        core = httpx.get(srv.url + "/v1/stats", timeout=30).json()["engine_process"]["pid"]
        got: dict = {}

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json={
                        "prompt": "Q: returns? A:", "segments": ["faq"], "max_tokens": 60, "ignore_eos": True,
                        "stream": True}) as resp:
                    events = []
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            data = line[len("data: "):]
                            events.append(data if data == "[DONE]" else json.loads(data))
                            if len(events) == 1:
                                srv.proc.send_signal(signal.SIGTERM)  # mid-stream
                    got["events"] = events
        asyncio.run(main())
        events = got["events"]
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
        assert finishes[-1] == "length"  # the stream ran to its end: drained, not cut
        assert srv.proc.wait(120) == 0, srv.log()[-3000:]
        wait_for(lambda: not os.path.exists(f"/proc/{core}"), timeout=30)
    finally:
        srv.stop()
    # the final snapshot holds the segment's KV: a restart restores it rather than recomputing
    (tmp_path / "again").mkdir()
    again = Server(tmp_path / "again", cache, "--snapshot-dir", str(snap))
    try:
        again.wait_ready()
        s = httpx.get(again.url + "/v1/stats", timeout=30).json()["snapshot"]
        assert s["restored_hbm"] + s["restored_host"] == 1 and s["recomputed"] == 0, s
    finally:
        again.stop()
