"""Serving benchmark: the real HTTP server under load, measured from the client like vLLM's
``benchmark_serving`` (TTFT, inter-token latency, end-to-end latency, throughput), with tenants
and KV-injected segments (docs/architecture.md, "HTTP API"; results in bench/NOTES.md).

Usage (from the repository root, ``INFERSCALE_CACHE`` set), or as ``inferscale bench serve ...``::

    python bench/serve.py --rates 0.5,1,2 --num-requests 12 --tenants 2 --segments-per-tenant 2 \\
        --segment-tokens 200 --max-tokens 8                   # CPU, default model, a few minutes
    python bench/serve.py --concurrency 1,8,32 --num-requests 256    # fixed concurrency instead
    python bench/serve.py --url http://127.0.0.1:8000 --api-keys keys.json   # a running server

Life of a run:

1. **Server.** Without ``--url``: a key file with ``--tenants`` tenants (``t0``, ``t1``, ...) and
   one admin key, and ``inferscale serve`` as a subprocess on a free 127.0.0.1 port (``--model``
   or the default model; ``--hbm-pages``, ``--max-batch`` and ``--serve-args`` passed on).  With
   ``--url``: that server; ``--api-keys FILE`` (its key file) gives the tenants' keys (the
   non-admin entries) and an admin key for ``/v1/stats``; without it, no auth.
2. **Texts.** The model's tokenizer is loaded locally (``inferscale_jax.tokenizer``); pseudo-text
   of an exact token length is words of the package corpus drawn by a seeded generator, each
   word's token count known (byte-level BPE splits on spaces, so counts add up), the last ones
   chosen to fill the count exactly.  All texts of a load point are made before it starts.
3. **Segments.** Each tenant registers ``--segments-per-tenant`` segments of ``--segment-tokens``
   tokens (``POST /v1/segments``, text).
4. **Warm-up** (not measured): one request per warm segment (so every one has been used), then
   ``--warmup-requests`` of each kind one after another, then bursts of 2, 4, ... up to
   ``--warmup-burst`` mixed requests sent at once (batch shapes compile here rather than in the
   measured part; ``compiles`` per load point shows what was still left).
5. **Load points**, one per ``--rates`` value (seeded Poisson arrivals; ``inf``: all at once) or
   per ``--concurrency`` value (that many clients, each sending its next request when the last
   ends); ``--num-requests`` each.  A request is a streamed completion (``stream: true``,
   ``stream_options.include_usage``, ``temperature`` 0, ``ignore_eos`` so every request makes
   ``--max-tokens`` tokens) of a ``--question-tokens`` question of its own, of one of three
   kinds, mixed in the ``--warm``/``--cold`` fractions (the rest ``none``), shuffled:

   - ``warm``: names one of its tenant's registered, already used segments;
   - ``cold``: registers a new segment of ``--segment-tokens`` tokens just before the request
     (its registration latency is reported apart, ``register``), names it, deletes it after;
   - ``none``: the question alone.

   ``GET /v1/stats`` (admin key) before and after each point gives the compiles in it.
6. **End**: the warm segments are deleted; the server (if started here) gets SIGTERM.

Measured per request (client clock, ``time.perf_counter``): TTFT = first SSE chunk with text
since the request was sent; ITL = gaps between consecutive text chunks (vLLM's ITL; a chunk is
one engine delta, normally one token: ``tokens_per_chunk`` in the JSON says how close); TPOT =
(last text chunk - first) / (completion tokens - 1), the per-token decode time; E2E = the
request's whole time, ``[DONE]`` included; cached ratio = usage ``cached_tokens`` /
``prompt_tokens`` summed over the requests.  Per point: requests/s and output tokens/s over the
wall time from the first request sent to the last one done.  A request is an error when its
status is not 200, its stream has an error event or no usage, or the connection fails.  A p99
over fewer than 1000 samples is indicative only (the ``n`` of each figure says how many).

Writes ``PREFIX.json`` (every figure), ``PREFIX.md`` (tables) and ``PREFIX.png`` (latency
percentiles and throughput vs load) for ``--out PREFIX`` (default ``bench/results/serve_<device>``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from importlib import resources

import httpx
import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _p in (BENCH, ROOT):  # report.py beside this file; the engine package (run from a checkout)
    if _p not in sys.path:
        sys.path.insert(0, _p)

from report import MD, log, pyplot, table, write_md  # noqa: E402  (bench/report.py)
from servers import free_port, stop_process  # noqa: E402  (bench/servers.py)

KINDS = ("warm", "cold", "none")
ADMIN = "bench-admin"
PCTS = (50, 90, 99)


# ---------------------------------------------------------------- arguments

def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="inferscale bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--url", help="benchmark this running server (default: start `inferscale serve` on a free "
                   "127.0.0.1 port)")
    g.add_argument("--api-keys", metavar="FILE", help="with --url: the server's key file (JSON/TOML); its "
                   "non-admin keys are the tenants, an admin key reads /v1/stats (default: no auth)")
    g.add_argument("--model", help="HF checkpoint folder the server serves; its tokenizer makes the texts "
                   "(default: the embedded default model)")
    g.add_argument("--hbm-pages", type=int, help="server KV pool pages (default: the server's)")
    g.add_argument("--max-batch", type=int, help="server sequences per step (default: the server's)")
    g.add_argument("--serve-args", default="", help="more `inferscale serve` options, one shell-quoted string")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for the server to start")
    g = p.add_argument_group("workload")
    g.add_argument("--tenants", type=int, default=2, help="(default: %(default)s)")
    g.add_argument("--segments-per-tenant", type=int, default=2, help="(default: %(default)s)")
    g.add_argument("--segment-tokens", type=int, default=1024, help="tokens of each segment (default: %(default)s)")
    g.add_argument("--question-tokens", type=int, default=64, help="tokens of each question (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s, greedy)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens per request (default: %(default)s)")
    g.add_argument("--warm", type=float, default=0.5, help="fraction of requests on warm segments (default: "
                   "%(default)s)")
    g.add_argument("--cold", type=float, default=0.25, help="fraction on cold segments; the rest have no segment "
                   "(default: %(default)s)")
    g = p.add_argument_group("load")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--rates", type=floats, help="Poisson request rates per second, comma-separated; inf = all "
                      "at once (default: 1,2,4)")
    load.add_argument("--concurrency", type=ints, help="fixed numbers of clients in flight, comma-separated")
    g.add_argument("--num-requests", type=int, default=100, help="requests per load point (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="arrivals, kinds, tenants and texts (default: %(default)s)")
    g.add_argument("--warmup-requests", type=int, default=2, help="sequential warm-up requests of each kind "
                   "(default: %(default)s)")
    g.add_argument("--warmup-burst", type=int, default=8, help="the largest burst of mixed warm-up requests "
                   "sent at once; bursts of 2, 4, ... up to it run first (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--out", help="prefix of the .json/.md/.png results (default: bench/results/serve_<device>)")
    g.add_argument("--device", help="device name for the report and the default --out (default: asked from jax)")
    args = p.parse_args(argv)
    if args.rates is None and args.concurrency is None:
        args.rates = [1.0, 2.0, 4.0]
    bad = [f"{name}={v}" for name, v in (("--tenants", args.tenants), ("--segments-per-tenant",
           args.segments_per_tenant), ("--segment-tokens", args.segment_tokens), ("--question-tokens",
           args.question_tokens), ("--max-tokens", args.max_tokens), ("--num-requests", args.num_requests)) if v < 1]
    bad += [f"--rates {r}" for r in args.rates or () if not r > 0]
    bad += [f"--concurrency {c}" for c in args.concurrency or () if c < 1]
    if not (0 <= args.warm and 0 <= args.cold and args.warm + args.cold <= 1):
        bad.append(f"--warm {args.warm} --cold {args.cold} (each >= 0, together <= 1)")
    if bad:
        p.error("out of range: " + ", ".join(bad) + "; counts, rates and concurrency must be positive")
    return args


# ---------------------------------------------------------------- texts and the request mix

class TextMaker:
    """Pseudo-text of an exact token length: corpus words with known per-word token counts."""

    def __init__(self, tokenizer):
        from inferscale_jax.tokenizer import encode_text

        self.tok, self.encode = tokenizer, encode_text
        text = resources.files("inferscale_jax").joinpath("data/corpus.txt").read_text(encoding="utf-8")
        words = sorted({w.strip(".,:;()!?\"'").lower() for w in text.split()} - {""})
        self.count = {w: len(encode_text(tokenizer, " " + w)) for w in words if w.isalpha()}
        self.by_count: dict[int, list[str]] = {}
        for w, c in self.count.items():
            self.by_count.setdefault(c, []).append(w)
        self.counts = sorted(self.by_count)
        self.inexact = 0  # texts whose length came out other than asked (no word fitted the rest)

    def make(self, n: int, rng: np.random.Generator) -> str:
        """" w1 w2 ..." of ``n`` tokens (exactly, when the vocabulary has one-token words)."""
        parts, left = [], n
        while left > 0:
            fits = [c for c in self.counts if c <= left] or self.counts[:1]
            pool = [w for c in fits for w in self.by_count[c]]
            w = pool[int(rng.integers(len(pool)))]
            parts.append(" " + w)
            left -= self.count[w]
        text = "".join(parts)
        self.inexact += self.length(text) != n
        return text

    def length(self, text: str) -> int:
        return len(self.encode(self.tok, text))


def mix(n: int, fractions: dict[str, float], rng: np.random.Generator) -> list[str]:
    """``n`` kinds in the given fractions (largest remainders round), in a seeded random order."""
    exact = {k: n * f for k, f in fractions.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[:n - sum(counts.values())]:
        counts[k] += 1
    kinds = [k for k in KINDS for _ in range(counts.get(k, 0))]
    rng.shuffle(kinds)
    return kinds


@dataclasses.dataclass
class Spec:
    kind: str
    tenant: str
    question: str
    segment: str | None = None  # the warm segment's id, or the cold segment's (registered by the request)
    cold_text: str | None = None


@dataclasses.dataclass
class Result:
    kind: str
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list = dataclasses.field(default_factory=list)
    tpot: float | None = None
    chunks: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    register: float | None = None


# ---------------------------------------------------------------- server and client

def detect_device() -> str:
    """The platform of jax's first device (``cpu``, ``gpu``, ``tpu``) and its kind in parentheses
    where they differ, asked in a child process (this one stays free of an accelerator context)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    code = ("import jax; d = jax.devices()[0]; "
            "print(d.platform if d.device_kind == d.platform else f'{d.platform} ({d.device_kind})')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"could not ask jax for the device: {out.stderr[-500:]}; pass --device NAME")
    return out.stdout.strip().splitlines()[-1]


class Server:
    """``inferscale serve`` on a free loopback port with a key file of the bench's tenants."""

    def __init__(self, args, workdir: str, tenants: list[str]):
        self.keys = {f"bench-{t}-{uuid.uuid4().hex}": t for t in tenants}
        self.keys[f"bench-admin-{uuid.uuid4().hex}"] = {"tenant": ADMIN, "admin": True}
        key_file = os.path.join(workdir, "keys.json")
        with open(key_file, "w") as f:
            json.dump(self.keys, f)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.cmd = [sys.executable, "-m", "inferscale_cli", "serve", "--host", "127.0.0.1",
                    "--port", self.url.rsplit(":", 1)[1], "--api-keys", key_file, "--log-level", "warning"]
        for flag, value in (("--model", args.model), ("--hbm-pages", args.hbm_pages), ("--max-batch", args.max_batch)):
            if value is not None:
                self.cmd += [flag, str(value)]
        self.cmd += shlex.split(args.serve_args)
        self.log_path = os.path.join(workdir, "server.log")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        log(f"[serve] server pid {self.proc.pid}: {shlex.join(self.cmd[1:])}")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not become ready within {timeout:.0f} s (exit code "
                           f"{self.proc.returncode}); log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        stop_process(self.proc)


def keys_from_file(path: str) -> dict:
    """An ``inferscale serve --api-keys`` file (JSON or TOML): key -> tenant or {tenant, admin}."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except ValueError:
        return tomllib.loads(raw.decode("utf-8"))


class Client:
    """httpx calls of the benchmark: tenants' segment and completion calls, the admin's stats."""

    def __init__(self, url: str, keys: dict | None, n_tenants: int, timeout: float, connections: int):
        self.url = url.rstrip("/")
        if keys:
            users = [(k, v) for k, v in keys.items() if isinstance(v, str) or not v.get("admin")]
            admins = [k for k, v in keys.items() if isinstance(v, dict) and v.get("admin")]
            users = users or [(k, keys[k]) for k in admins]
            self.tenants = [v if isinstance(v, str) else v["tenant"] for _, v in users][:n_tenants]
            self.headers = {t: {"Authorization": f"Bearer {k}"} for k, t in zip([k for k, _ in users], self.tenants)}
            self.admin = {"Authorization": f"Bearer {admins[0]}"} if admins else None
        else:  # no auth: every tenant is the server's single local tenant, which is admin
            self.tenants = [f"t{i}" for i in range(n_tenants)]
            self.headers = {t: {} for t in self.tenants}
            self.admin = {}
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout,
                                      limits=httpx.Limits(max_connections=max(100, connections),
                                                          max_keepalive_connections=max(20, connections)))

    async def register(self, tenant: str, sid: str, text: str) -> float:
        t0 = time.perf_counter()
        r = await self.http.post("/v1/segments", json={"id": sid, "text": text}, headers=self.headers[tenant])
        if r.status_code != 201:
            raise RuntimeError(f"registering {sid!r} answered {r.status_code}: {r.text[:300]}")
        return time.perf_counter() - t0

    async def delete(self, tenant: str, sid: str) -> None:
        await self.http.delete(f"/v1/segments/{sid}", headers=self.headers[tenant])

    async def stats(self) -> dict | None:
        if self.admin is None:
            return None
        r = await self.http.get("/v1/stats", headers=self.admin)
        return r.json() if r.status_code == 200 else None

    async def complete(self, spec: Spec, args, res: Result) -> None:
        """One streamed completion into ``res`` (timings, usage, or the error)."""
        body = {"prompt": spec.question, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if spec.segment is not None:
            body["segments"] = [spec.segment]
        usage, times = None, []
        t0 = time.perf_counter()
        async with self.http.stream("POST", "/v1/completions", json=body, headers=self.headers[spec.tenant]) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return
                if event.get("choices") and event["choices"][0].get("text"):
                    times.append(time.perf_counter())
                if event.get("usage"):
                    usage = event["usage"]
        res.e2e = time.perf_counter() - t0
        if usage is None:
            res.error = "the stream ended without a usage chunk"
            return
        res.prompt_tokens = usage["prompt_tokens"]
        res.completion_tokens = usage["completion_tokens"]
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        res.chunks = len(times)
        if times:
            res.ttft = times[0] - t0
            res.itl = np.diff(times).tolist()
            if res.completion_tokens > 1:
                res.tpot = (times[-1] - times[0]) / (res.completion_tokens - 1)
        res.ok = True

    async def run(self, spec: Spec, args) -> Result:
        """A request of any kind; a cold one registers its segment first and deletes it after."""
        res = Result(spec.kind)
        try:
            if spec.kind == "cold":
                res.register = await self.register(spec.tenant, spec.segment, spec.cold_text)
            await self.complete(spec, args, res)
        except Exception as e:  # noqa: BLE001 - one failed request is counted, the run goes on
            res.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            if spec.kind == "cold":
                try:
                    await self.delete(spec.tenant, spec.segment)
                except httpx.HTTPError:
                    pass
        return res


# ---------------------------------------------------------------- load

def make_specs(n: int, kinds: list[str] | None, args, tenants: list[str], warm_ids: dict, maker: TextMaker,
               rng: np.random.Generator, tag: str) -> list[Spec]:
    kinds = kinds or mix(n, {"warm": args.warm, "cold": args.cold, "none": 1 - args.warm - args.cold}, rng)
    specs = []
    for i, kind in enumerate(kinds):
        tenant = tenants[int(rng.integers(len(tenants)))]
        spec = Spec(kind, tenant, maker.make(args.question_tokens, rng))
        if kind == "warm":
            spec.segment = warm_ids[tenant][int(rng.integers(len(warm_ids[tenant])))]
        elif kind == "cold":
            spec.segment = f"bench-cold-{tag}-{i}-{uuid.uuid4().hex[:8]}"
            spec.cold_text = maker.make(args.segment_tokens, rng)
        specs.append(spec)
    return specs


async def poisson(client: Client, specs: list[Spec], args, rate: float, rng: np.random.Generator):
    """Send request i at its seeded Poisson arrival time; returns (results, wall seconds)."""
    gaps = np.zeros(len(specs)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(specs))
    arrivals = np.cumsum(gaps) - gaps[0]
    t0 = time.perf_counter()
    tasks = []
    for spec, at in zip(specs, arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.run(spec, args)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def closed_loop(client: Client, specs: list[Spec], args, concurrency: int):
    """``concurrency`` clients, each sending the next request when its last one ends."""
    queue = list(reversed(specs))
    results: list[Result] = []

    async def worker():
        while queue:
            results.append(await client.run(queue.pop(), args))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------- figures

def dist(xs: list[float], scale: float = 1e3) -> dict | None:
    """p50/p90/p99/mean of ``xs`` (seconds) in ms, and the sample count."""
    if not xs:
        return None
    a = np.asarray(xs, dtype=float) * scale
    return {**{f"p{q}": float(v) for q, v in zip(PCTS, np.percentile(a, PCTS))}, "mean": float(a.mean()), "n": len(a)}


def ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out = {
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "output_throughput": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "ttft_ms": dist([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": dist([x for r in ok for x in r.itl]),
        "tpot_ms": dist([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": dist([r.e2e for r in ok]),
        "register_ms": dist([r.register for r in results if r.register is not None]),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "cached_ratio": ratio(sum(r.cached_tokens for r in ok), sum(r.prompt_tokens for r in ok)),
        "tokens_per_chunk": ratio(sum(r.completion_tokens for r in ok), sum(r.chunks for r in ok)),
    }
    out["by_kind"] = {}
    for kind in KINDS:
        rs = [r for r in results if r.kind == kind]
        if rs:
            k_ok = [r for r in rs if r.ok]
            out["by_kind"][kind] = {
                "requests": len(rs), "errors": len(rs) - len(k_ok),
                "ttft_ms": dist([r.ttft for r in k_ok if r.ttft is not None]),
                "e2e_ms": dist([r.e2e for r in k_ok]),
                "register_ms": dist([r.register for r in rs if r.register is not None]),
                "prompt_tokens": sum(r.prompt_tokens for r in k_ok),
                "cached_tokens": sum(r.cached_tokens for r in k_ok),
                "cached_ratio": ratio(sum(r.cached_tokens for r in k_ok), sum(r.prompt_tokens for r in k_ok))}
    return out


def fmt(d: dict | None, key: str = "", digits: int = 1) -> str:
    """``p50 / p90 / p99`` of a dist (or one of its fields), ms."""
    if d is None:
        return "n/a"
    if key:
        return f"{d[key]:.{digits}f}"
    return " / ".join(f"{d[f'p{q}']:.{digits}f}" for q in PCTS)


def num(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def load_label(p: dict) -> str:
    return f"{p['rate']:g} req/s" if p["mode"] == "rate" else f"{p['concurrency']} clients"


def report(summary: dict, prefix: str) -> None:
    pts = summary["points"]
    cfg = summary["config"]
    MD.extend([f"# Serving benchmark: {summary['device']}", "",
               f"{summary['date']}; `{summary['command']}`", ""])
    if summary["device"].startswith("cpu"):
        MD.extend(["**CPU figures with the tiny random default model: they show that the harness works, not "
                   "GPU performance.**", ""])
    MD.extend([f"Server: `{summary['server_command'] or summary['url']}`. Model `{cfg['model']}`; "
               f"{cfg['tenants']} tenants x {cfg['segments_per_tenant']} segments of {cfg['segment_tokens']} "
               f"tokens; questions of {cfg['question_tokens']} tokens, {cfg['max_tokens']} tokens generated "
               f"(temperature {cfg['temperature']}, ignore_eos {cfg['ignore_eos']}); mix warm {cfg['warm']}, "
               f"cold {cfg['cold']}, none {1 - cfg['warm'] - cfg['cold']:.2f}; {cfg['num_requests']} requests "
               f"per load point, seed {cfg['seed']}. Definitions: bench/serve.py docstring; p99 over fewer than "
               "1000 samples (the `n` column) is indicative only.", ""])
    table("Latency (ms, p50 / p90 / p99) and throughput per load point", [
        "load", "n", "errors", "req/s", "out tok/s", "TTFT", "ITL", "TPOT p50", "E2E", "cached ratio",
        "compiles"], [
        [load_label(p), p["completed"], p["errors"], num(p["request_throughput"]), num(p["output_throughput"], 1),
         fmt(p["ttft_ms"]), fmt(p["itl_ms"]), fmt(p["tpot_ms"], "p50"), fmt(p["e2e_ms"]), num(p["cached_ratio"], 3),
         "n/a" if p["compiles"] is None else p["compiles"]] for p in pts])
    table("By request kind (ms, p50 / p90 / p99; register = the cold segment's POST /v1/segments)", [
        "load", "kind", "n", "errors", "TTFT", "E2E", "register", "cached ratio"], [
        [load_label(p), kind, k["requests"], k["errors"], fmt(k["ttft_ms"]), fmt(k["e2e_ms"]), fmt(k["register_ms"]),
         num(k["cached_ratio"], 3)] for p in pts for kind, k in p["by_kind"].items()])
    w = summary["warmup"]
    MD.extend([f"Warm-up (not measured): {w['requests']} requests, {w['errors']} errors, {w['wall_s']:.1f} s; "
               f"server compiles by then: {w['compiles']}. Segment setup: {w['segments']} registered, "
               f"register p50 {fmt(w['register_ms'], 'p50')} ms.", ""])
    out_dir, name = os.path.split(prefix)
    with open(prefix + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    log(f"wrote {prefix}.json")
    write_md(out_dir or ".", name + ".md", MD)
    plot(summary, prefix + ".png")


def plot(summary: dict, path: str) -> None:
    plt = pyplot()
    pts = summary["points"]
    if plt is None or not pts:
        return
    numeric = all(math.isfinite(p["rate"] if p["mode"] == "rate" else p["concurrency"]) for p in pts)
    xs = [(p["rate"] if p["mode"] == "rate" else p["concurrency"]) if numeric else i for i, p in enumerate(pts)]
    xlabel = "request rate (req/s, Poisson)" if pts[0]["mode"] == "rate" else "concurrent clients"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for metric, color in (("ttft_ms", "tab:blue"), ("itl_ms", "tab:green"), ("e2e_ms", "tab:red")):
        for q, style in zip(PCTS, ("-o", "--s", ":^")):
            ys = [p[metric][f"p{q}"] if p[metric] else float("nan") for p in pts]
            a.plot(xs, ys, style, color=color, label=f"{metric[:-3].upper()} p{q}")
    a.set(xlabel=xlabel, ylabel="ms", yscale="log", title="latency percentiles")
    a.legend(fontsize=7, ncol=3)
    b.plot(xs, [p["output_throughput"] or 0 for p in pts], "-o", label="output tokens/s")
    b.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput")
    b2 = b.twinx()
    b2.plot(xs, [p["request_throughput"] or 0 for p in pts], ":s", color="tab:orange", label="requests/s")
    b2.set_ylabel("requests/s")
    b.legend(loc="upper left", fontsize=8)
    b2.legend(loc="lower right", fontsize=8)
    if not numeric:
        for ax in (a, b):
            ax.set_xticks(xs, [load_label(p) for p in pts])
    fig.suptitle(f"inferscale serve: {summary['device']}, {summary['config']['segment_tokens']}-token segments, "
                 f"{summary['config']['max_tokens']} tokens out")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


# ---------------------------------------------------------------- the run

def burst_sizes(largest: int) -> list[int]:
    """2, 4, 8, ... below ``largest``, then ``largest`` (none for 0)."""
    sizes, size = [], 2
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest] if largest > 0 else sizes


async def bench(args, client: Client, maker: TextMaker) -> dict:
    rng = np.random.default_rng(args.seed)
    tenants = client.tenants
    run_tag = uuid.uuid4().hex[:8]
    warm_ids = {t: [f"bench-{t}-{run_tag}-{j}" for j in range(args.segments_per_tenant)] for t in tenants}
    registered = []
    try:
        seg_times = []
        for t in tenants:
            for sid in warm_ids[t]:
                seg_times.append(await client.register(t, sid, maker.make(args.segment_tokens, rng)))
                registered.append((t, sid))
        log(f"[serve] {len(registered)} segments of {args.segment_tokens} tokens registered")
        # warm-up: every warm segment once, then each kind in turn, then a burst
        t0 = time.perf_counter()
        firsts = [Spec("warm", t, maker.make(args.question_tokens, rng), sid) for t, sid in registered]
        kinds = [k for k in KINDS for _ in range(args.warmup_requests)]
        warm = [*firsts, *make_specs(len(kinds), kinds, args, tenants, warm_ids, maker, rng, "warmup")]
        results = [await client.run(s, args) for s in warm]
        for size in burst_sizes(args.warmup_burst):  # the batch sizes load will bring
            burst = make_specs(size, None, args, tenants, warm_ids, maker, rng, f"burst{size}")
            results += await asyncio.gather(*(client.run(s, args) for s in burst))
        stats = await client.stats()
        warmup = {"requests": len(results), "errors": sum(not r.ok for r in results),
                  "error_samples": sorted({r.error for r in results if not r.ok})[:5],
                  "wall_s": time.perf_counter() - t0, "compiles": stats["compiles"] if stats else None,
                  "segments": len(registered), "register_ms": dist(seg_times)}
        log(f"[serve] warm-up: {warmup['requests']} requests, {warmup['errors']} errors, {warmup['wall_s']:.1f} s, "
            f"compiles {warmup['compiles']}")
        points = []
        loads = [("rate", x) for x in args.rates or ()] + [("concurrency", x) for x in args.concurrency or ()]
        for i, (mode, x) in enumerate(loads):
            prng = np.random.default_rng([args.seed, i])
            specs = make_specs(args.num_requests, None, args, tenants, warm_ids, maker, prng, f"p{i}")
            before = await client.stats()
            if mode == "rate":
                results, wall = await poisson(client, specs, args, x, prng)
            else:
                results, wall = await closed_loop(client, specs, args, x)
            after = await client.stats()
            p = {"mode": mode, "rate": x if mode == "rate" else None, "concurrency": x if mode != "rate" else None,
                 **summarize(results, wall),
                 "compiles": after["compiles"] - before["compiles"] if before and after else None}
            points.append(p)
            log(f"[serve] {load_label(p)}: {p['completed']}/{p['requests']} ok, {num(p['request_throughput'])} req/s, "
                f"{num(p['output_throughput'], 1)} tok/s, TTFT {fmt(p['ttft_ms'])} ms, ITL {fmt(p['itl_ms'])} ms, "
                f"E2E {fmt(p['e2e_ms'])} ms, cached {num(p['cached_ratio'], 3)}, compiles {p['compiles']}")
        return {"warmup": warmup, "points": points}
    finally:
        for t, sid in registered:
            try:
                await client.delete(t, sid)
            except httpx.HTTPError:
                pass
        await client.http.aclose()


def main(argv=None) -> int:
    from inferscale_cli.main import quiet_third_party

    quiet_third_party()
    args = parse_args(argv)
    from inferscale_jax.default_model import default_model_dir
    from inferscale_jax.tokenizer import load_tokenizer

    model_dir = os.path.abspath(args.model) if args.model else default_model_dir()
    args.model = model_dir if args.model else None
    device = args.device or detect_device()
    prefix = os.path.abspath(args.out or os.path.join(BENCH, "results", f"serve_{device.split()[0]}"))
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    maker = TextMaker(load_tokenizer(model_dir))
    workdir = tempfile.mkdtemp(prefix="inferscale-bench-serve-")
    tenant_names = [f"t{i}" for i in range(args.tenants)]
    server = None
    if args.url:
        url, keys = args.url, keys_from_file(args.api_keys) if args.api_keys else None
    else:
        server = Server(args, workdir, tenant_names)
        url, keys = server.url, server.keys
    connections = max([args.num_requests, args.warmup_burst, *(args.concurrency or [])])
    try:
        if server is not None:
            t0 = time.monotonic()
            server.wait_ready(args.ready_timeout)
            log(f"[serve] server ready in {time.monotonic() - t0:.0f} s at {url}")
        client = Client(url, keys, args.tenants, args.request_timeout, connections)
        figures = asyncio.run(bench(args, client, maker))
    finally:
        if server is not None:
            server.stop()
    summary = {
        "device": device, "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "bench/serve.py", *(sys.argv[1:] if argv is None else argv)]),
        "server_command": shlex.join(server.cmd[1:]) if server else None, "url": url,
        "config": {**{k: v for k, v in vars(args).items() if k not in ("api_keys",)},
                   "model": args.model or "default model", "tenants": len(client.tenants)},
        "texts_inexact": maker.inexact,
        **figures,
    }
    report(summary, prefix)
    errors = summary["warmup"]["errors"] + sum(p["errors"] for p in summary["points"])
    log(f"[serve] done: {errors} errors; results {prefix}.json/.md/.png")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
