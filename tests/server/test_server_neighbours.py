"""Tenants and hostile clients against the real ``inferscale serve`` (loopback only): one tenant's
flood does not starve another (fair admission, ``inferscale_jax/fair_queue.py``), and slow
headers, held connections and large bodies do not pause another client's stream
(``serving/connections.py``, off-loop parsing in ``serving/app.py``)."""

import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.server_util import Server, cache_dir

pytestmark = pytest.mark.alone  # (p99 ratios, a 200 ms gap: conftest.py)

KEYS = {"key-a": "a", "key-b": "b", "key-ops": {"tenant": "ops", "admin": True}}
FLOOD_TOKENS = 64  # and up to twice that: long, so the flood holds rows (what fairness is about) more than it
#   costs HTTP work, and varied, so its requests do not finish (and prefill) in lockstep waves


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("neighbours")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # 4 rows a step: the flood (48 in flight) is 12x what a step holds, and on the 2-core CPU its rows cost
    # little beside b's (the fairness is in admission; the compute of extra rows is the device's)
    srv = Server(tmp, cache_dir(tmp_path_factory), "--api-keys", str(keys), "--max-batch", "4").wait_ready()
    yield srv
    srv.stop()


def body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "inferscale", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


async def flood(url: str, stop: asyncio.Event, clients: int, counts: dict) -> None:
    """Tenant a: ``clients`` closed-loop clients until ``stop``; 429/503 are retried after a pause."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer key-a"}, timeout=300,
                                 limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def one(i: int) -> None:
            n = 0
            while not stop.is_set():
                r = await client.post("/v1/completions", json=body(f"flood {i} {n} " * 3,
                                                                 FLOOD_TOKENS + (37 * i + 11 * n) % FLOOD_TOKENS))
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                n += 1
                if r.status_code != 200:
                    await asyncio.sleep(0.05)
        await asyncio.gather(*(one(i) for i in range(clients)))


async def latencies(url: str, n: int) -> list[tuple[float, float]]:
    """Tenant b: ``n`` sequential streamed requests, (time to first token, end to end) seconds each
    (all must succeed)."""
    out = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer key-b"}, timeout=300) as client:
        for i in range(n):
            t0, first = time.perf_counter(), None
            async with client.stream("POST", "/v1/completions", json=body(f"quiet question {i % 3}", 16,
                                                                            stream=True)) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: "):
                        first = time.perf_counter() - t0
            out.append((first, time.perf_counter() - t0))
    return out


def compiles(server) -> int:
    stats = httpx.get(server.url + "/v1/stats", headers={"Authorization": "Bearer key-ops"}, timeout=30).json()
    return stats["compiles"]


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


async def measured(url: str, server) -> list[tuple[float, float]]:
    """b's latencies over 30 requests, taken again (up to 3 times) if a step bucket compiled meanwhile."""
    for _ in range(3):
        before = compiles(server)
        out = await latencies(url, 30)
        if compiles(server) == before:
            return out
    raise AssertionError("step buckets kept compiling while b's latency was measured")


def test_a_flooding_tenant_does_not_starve_another(server):
    """Tenant a keeps 48 requests in flight (12 times the rows a step holds); tenant b's sequential
    requests keep a p99 latency (end to end) within 2x of b's p99 on the quiet server, and within
    2x of it while a holds just the rows it may hold (4 in flight, none queued: the same compute
    beside b without the flood's queue).  Each phase is measured once no step bucket compiles."""
    async def phase(clients: int, counts: dict) -> list[tuple[float, float]]:
        stop = asyncio.Event()
        task = asyncio.create_task(flood(server.url, stop, clients, counts)) if clients else None
        before = -1
        while compiles(server) != before:  # warm-up until the mix compiles no new step bucket
            before = compiles(server)
            await latencies(server.url, 8)
        out = await measured(server.url, server)
        stop.set()
        if task is not None:
            await task
        return out

    async def run():
        counts: dict = {}
        return await phase(48, counts), await phase(4, {}), await phase(0, {}), counts

    reports = []
    for _ in range(3):  # a p99 of 30 samples on a shared 2-core machine: up to 3 tries, each whole
        flooded, fair, quiet, counts = asyncio.run(run())
        assert counts.get(200, 0) >= 48, counts  # the flood was served too
        e2e = {name: [x[1] for x in xs] for name, xs in (("flood", flooded), ("fair", fair), ("quiet", quiet))}
        ttft = {name: [x[0] for x in xs] for name, xs in (("flood", flooded), ("fair", fair), ("quiet", quiet))}
        reports.append("; ".join(f"{k}: end to end p99 {p99(e2e[k]):.3f} s (median {statistics.median(e2e[k]):.3f}),"
                                 f" first token p99 {p99(ttft[k]):.3f} s" for k in e2e) + f"; a's answers {counts}")
        print(reports[-1])
        if p99(e2e["flood"]) <= 2 * min(p99(e2e["fair"]), p99(e2e["quiet"])):
            return
    raise AssertionError("b's p99 under a's flood above 2x its quiet or fair-share p99 in 3 tries:\n"
                         + "\n".join(reports))


def largest_gap(url: str, result: dict, max_tokens: int, during=None) -> None:
    """Tenant b streams one completion; ``result`` gets the largest gap between chunks (s).  With
    ``during`` (a function starting the attack and returning its ``Popen``): started at the first
    chunk, and the gaps counted are those until that process exits."""
    gaps, last, attack = [], None, None
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer key-b"}, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body("stream me", max_tokens, stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if during is not None and attack is None:
                    attack = during()
                if attack is not None and attack.poll() is not None:
                    break
    if attack is not None:
        result["attack"] = attack.communicate(timeout=120)
        assert attack.returncode == 0, result["attack"]
    result["gap"], result["chunks"] = max(gaps), len(gaps) + 1


# the attacker, a client of its own (its work must not hold this process's GIL while b's stream is timed):
# two 1.9 MiB bodies, then 1100 connections sending half a request head, held for a second
ATTACK = """
import json, socket, sys, time
import httpx
port = int(sys.argv[1])
body = dict(model="inferscale", prompt="x", max_tokens=4, temperature=0, ignore_eos=True, stream=False)
many_keys = json.dumps(dict(body, **{f"k{i}": i for i in range(110_000)})).encode()
nested = json.dumps(dict(body, extra=json.loads("[" * 64 + "1" + "]" * 64), pad="y" * (1900 << 10))).encode()
assert len(many_keys) > 1.5e6 and len(nested) > 1.9e6
answers = []
for payload in (many_keys, nested):
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=payload, timeout=60,
                   headers={"Authorization": "Bearer key-a", "Content-Type": "application/json"})
    answers.append(r.status_code)
held = []
for _ in range(1100):  # past the per-address cap (1024): the rest are closed at once
    s = socket.create_connection(("127.0.0.1", port))
    held.append(s)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 10")  # and no more
    except OSError:
        pass  # closed by the server already
time.sleep(1.0)
for s in held:
    s.close()
print(json.dumps(answers))
"""


def test_slow_headers_and_large_bodies_do_not_pause_another_stream(server):
    """While tenant b streams, another client sends two 1.9 MiB bodies (110k unknown keys; 64-deep
    nested arrays), then opens 1100 connections that send half a request head and hold it (past
    the per-address cap): b's largest gap between chunks stays under 200 ms, and the server
    answers afterwards."""
    quiet: dict = {}
    largest_gap(server.url, quiet, 3000)  # compiles every bucket a stream this long needs; a baseline

    def attack() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", ATTACK, str(server.port)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    tries = []
    for _ in range(3):  # up to 3 tries on the shared 2-core machine (a stall repeats; noise does not), and
        before = compiles(server)  # again when a step bucket compiled while it was timed (not a stall)
        result: dict = {}
        largest_gap(server.url, result, 3000, during=attack)
        answers = json.loads(result["attack"][0].strip().splitlines()[-1])
        assert answers[0] == 400 and answers[1] in (400, 413), answers
        tries.append(f"largest gap {result['gap'] * 1000:.0f} ms over {result['chunks']} chunks "
                     f"(quiet stream: {quiet['gap'] * 1000:.0f} ms; compiles {compiles(server) - before})")
        print(tries[-1])
        wait_health(server.url)
        if compiles(server) == before and result["gap"] < 0.2:
            break
    assert compiles(server) == before and result["gap"] < 0.2, tries


def wait_health(url: str, timeout: float = 30.0) -> None:
    """The server answers again (the held connections are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server does not answer after the attack"
        time.sleep(0.2)
