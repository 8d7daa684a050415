"""Serving benchmark: the real HTTP server under load, measured from the client like vLLM's
``benchmark_serving`` (TTFT, inter-token latency, end-to-end latency, throughput), with tenants
and KV-injected segments (docs/architecture.md, "HTTP API"; results in bench/NOTES.md); and the
very same workload through the in-process ``AsyncEngine`` beside it, which tells what the HTTP
layer costs (a serving figure is the HTTP one; the in-process one is its reference).

Usage (from the repository root, ``INFERSCALE_CACHE`` set), or as ``inferscale bench serve ...``::

    python bench/serving/serve.py --rates 0.5,1,2 --num-requests 12 --tenants 2 --segments-per-tenant 2 \\
        --segment-tokens 200 --max-tokens 8                   # CPU, default model, a few minutes
    python bench/serving/serve.py --concurrency 1,8,32 --num-requests 256    # fixed concurrency instead
    python bench/serving/serve.py --url http://127.0.0.1:8000 --api-keys keys.json   # a running server
    python bench/serving/serve.py --in-process ...                    # the same through AsyncEngine only
    python bench/serving/serve.py --mode http,inproc ...              # both, one table, HTTP/in-process ratio

Issue 30's workload (H200; ``python bench/tools/make_checkpoint.py`` makes the Llama-3-8B-shaped random
checkpoint): 8 segments of 4096 tokens, each request a fresh 64-token question naming one, 64
greedy tokens streamed with ``ignore_eos``, C clients in a closed loop, through HTTP and in-process
(about 6 minutes; ``--context inline`` / ``--context none`` for the prefix-cache and no-context
comparisons)::

    python bench/serving/serve.py --model /tmp/llama8b --tenants 1 --segments-per-tenant 8 \\
        --segment-tokens 4096 --question-tokens 64 --max-tokens 64 --warm 1.0 --cold 0 \\
        --concurrency 1,16,64,256 --num-requests 32 --warmup-burst 256 --mode http,inproc

Life of a run:

1. **Vias.** ``--mode`` (default ``http``; ``--in-process`` = ``--mode inproc``) lists the ways
   the requests go: ``http`` (a client of the server) and ``inproc`` (``AsyncEngine`` in this
   process).  With both, HTTP runs first and its server has exited (its device memory free)
   before the in-process engine loads; steps 2-7 run once per via, with the same seed, so both
   send the same texts, questions and load.  The device is asked in a child process, so this
   one holds no accelerator while a server runs.
2. **Server or engine.**  ``http`` without ``--url``: a key file with ``--tenants`` tenants
   (``t0``, ``t1``, ...) and one admin key, and ``inferscale serve`` as a subprocess on a free
   127.0.0.1 port (``--model`` or the default model; ``--hbm-pages``, ``--max-batch`` and
   ``--serve-args`` passed on), ready when ``/health`` answers 200 (after its warm-up).  With
   ``--url``: that server; ``--api-keys FILE`` (its key file) gives the tenants' keys (the
   non-admin entries) and an admin key for ``/v1/stats``; without it, no auth.  ``inproc``:
   ``Engine.from_pretrained(model, EngineConfig(...))`` with the settings ``inferscale serve``
   would use for the same ``--model`` / ``--hbm-pages`` / ``--max-batch`` / ``--serve-args``
   (its parser's defaults; ``inferscale_cli`` serve), its warm-up (``Engine.warmup``, unless
   ``--serve-args --no-warmup``) on the ``AsyncEngine`` thread, tenants ``t0``, ``t1``, ...
3. **Texts.** The model's tokenizer is loaded locally (``inferscale_jax.tokenizer``); pseudo-text
   of an exact token length is words of the package corpus drawn by a seeded generator, each
   word's token count known (byte-level BPE splits on spaces, so counts add up), the last ones
   chosen to fill the count exactly.  All texts of a load point are made before it starts.
4. **Segments.** Each tenant's ``--segments-per-tenant`` texts of ``--segment-tokens`` tokens
   are made; with ``--context segment`` (the default) they are registered (``POST /v1/segments``,
   text; in-process ``AsyncEngine.register_segment``).  ``--context inline`` / ``none`` register
   nothing (the texts are still drawn, so the questions stay the same as with segments).
5. **Warm-up** (not measured): one request per warm segment (so every one has been used), then
   ``--warmup-requests`` of each kind one after another, then bursts of 2, 4, ... up to
   ``--warmup-burst`` mixed requests sent at once (batch shapes compile here rather than in the
   measured part; ``compiles`` per load point shows what was still left).  Then, up to
   ``--first-runs-timeout`` seconds, until the engine reports no bucket's first run left (a
   server makes them in its idle time after ``/health`` turns 200; the in-process engine in its
   warm-up), so that neither via pays one inside a load point; the report says how long it
   waited and how many were left (the table's compiles column: those a point met).
6. **Load points**, one per ``--rates`` value (seeded Poisson arrivals; ``inf``: all at once;
   ``--num-requests`` each) or per ``--concurrency`` value C (C clients, each sending its next
   request when its last one ends; max(``--num-requests``, 2 x C) requests, so every client sends
   at least two).  A request is a streamed completion (``stream: true``,
   ``stream_options.include_usage``, ``temperature`` 0, ``ignore_eos`` so every request makes
   ``--max-tokens`` tokens; in-process ``AsyncEngine.stream`` with the same ``SamplingParams``)
   of a ``--question-tokens`` question of its own, of one of three kinds, mixed in the
   ``--warm``/``--cold`` fractions (the rest ``none``), shuffled:

   - ``warm``: one of its tenant's segments, already used: named (``segments``) with
     ``--context segment``, its text before the question with ``inline`` (the automatic prefix
     cache);
   - ``cold``: a new text of ``--segment-tokens`` tokens: with ``segment``, registered just before
     the request (its registration latency is reported apart, ``register``), named, deleted
     after; with ``inline``, sent before the question;
   - ``none``: the question alone (with ``--context none`` every request is one).

   Engine stats (``GET /v1/stats`` with the admin key; in-process ``stats()``) before and after
   each point give the compiles in it, and the buckets' first runs in it (``first_runs_left``: a
   server's warm-up leaves them to idle time, so a point that starts before they are done pays
   each one inside a step, ~80 ms for the 8B model; in-process engines make them in the warm-up).
7. **End**: the warm segments are deleted; the server (if started here) gets SIGTERM; the
   in-process engine is shut down.  With both vias, each load point's HTTP/in-process ratio of
   output tokens/s (issue 30's target: >= 0.85 at C=256) goes in the table and the JSON
   (``comparison``).

Measured per request (client clock, ``time.perf_counter``): TTFT = first SSE chunk with text
since the request was sent; ITL = gaps between consecutive text chunks (vLLM's ITL; a chunk is
one engine delta, normally one token: ``tokens_per_chunk`` in the JSON says how close); TPOT =
(last text chunk - first) / (completion tokens - 1), the per-token decode time; E2E = the
request's whole time, ``[DONE]`` included; cached ratio = usage ``cached_tokens`` /
``prompt_tokens`` summed over the requests.  In-process the same with ``stream()``'s deltas for
chunks (those with text), the call to ``stream()`` for the send and its final delta's metrics
for the usage.  Per point: requests/s and output tokens/s over the wall time from the first
request sent to the last one done; with ``--concurrency``, also the *steady* output tokens/s, over the
window in which every client is busy (from the first request's end to the last request's send; each
request's tokens spread evenly over its decode), which leaves out the first wave's start-up and the
last requests' tail (empty when each client sends few requests: ``--num-requests`` 8 x C gives a
window of several waves).  An HTTP closed loop's clients run in ``--client-procs`` processes (default
one per 16 clients, at most half the machine's cores): a single Python process reading 64 SSE streams
held the figure down (bench/NOTES.md, run AR).  Each point
also records the CPU cores each side used (the benchmark's processes, the server, the server's
children: the engine core and any more API servers).  A request is an error when its status is not 200, its stream
has an error event or no usage, or the connection fails (in-process: ``stream()`` raises).  A p99
over fewer than 1000 samples is indicative only (the ``n`` of each figure says how many).

Where TTFT goes (``ttft_split`` per point, the "Where TTFT goes" table): each request's TTFT beside
the engine's own clock for it (``RequestMetrics.ttft_s``: its submit in the engine -> its first token
applied, and ``queue_s``: submit -> running with its pages), in-process from the final output's
metrics, over HTTP from the per-request lines of the server's log (``--log-requests``, joined on
``X-Request-Id``): a server started here logs to its work folder; with ``--url``, ``--server-log``
names the running server's log.  The engine's TTFT less its queue is its prefill steps and the
first token's read-back; client TTFT less engine TTFT is everything outside the engine (HTTP, the
API process, the hand-offs to and from the engine core, the client).

Writes ``PREFIX.json`` (every figure; ``runs`` holds each via's ``warmup`` and ``points``, the
top-level ``warmup`` and ``points`` are the first via's), ``PREFIX.md`` (tables, a ``via``
column) and ``PREFIX.png`` (latency percentiles and throughput vs load) for ``--out PREFIX``
(default ``bench/results/serve_<device>``).
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
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from importlib import resources

import httpx
import numpy as np

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
ROOT = os.path.dirname(BENCH)
# servers.py beside this file, bench/lib/ (report), the engine package (run from a checkout; the CLI runs
# this file with runpy, which puts nothing on sys.path)
for _p in (os.path.join(BENCH, "serving"), os.path.join(BENCH, "lib"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from report import MD, code_version, log, pyplot, switch_lines, table, write_md  # noqa: E402  (bench/lib/report.py)
from servers import free_port, stop_process  # noqa: E402  (bench/serving/servers.py)

KINDS = ("warm", "cold", "none")
VIAS = ("http", "inproc")  # the order they run in (module docstring, 1)
CONTEXTS = ("segment", "inline", "none")
ADMIN = "bench-admin"
PCTS = (50, 90, 99)


# ---------------------------------------------------------------- arguments

def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def vias(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in VIAS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give http, inproc or http,inproc")
    return [v for v in VIAS if v in names]  # HTTP first: its server is gone before the engine loads


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="inferscale bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server or in-process engine")
    g.add_argument("--mode", type=vias, default=None, metavar="VIAS",
                   help="how requests go, comma-separated: http (the server), inproc (AsyncEngine in this "
                   "process, built as `inferscale serve` builds its engine); with both, HTTP first, then the "
                   "same requests in-process, one table with their ratio (default: http)")
    g.add_argument("--in-process", action="store_true", help="same as --mode inproc")
    g.add_argument("--url", help="benchmark this running server (default: start `inferscale serve` on a free "
                   "127.0.0.1 port)")
    g.add_argument("--server-pid", type=int, help="with --url: that server's process id, for the CPU column")
    g.add_argument("--server-log", metavar="FILE", help="with --url: that server's log, written with `--log-level "
                   "info --log-requests`: each request's TTFT and queue time on the engine's clock (the "
                   "report's \"Where TTFT goes\")")
    g.add_argument("--api-keys", metavar="FILE", help="with --url: the server's key file (JSON/TOML); its "
                   "non-admin keys are the tenants, an admin key reads /v1/stats (default: no auth)")
    g.add_argument("--model", help="HF checkpoint folder the server (or the in-process engine) serves; its "
                   "tokenizer makes the texts (default: the embedded default model)")
    g.add_argument("--hbm-pages", type=int, help="server KV pool pages (default: the server's)")
    g.add_argument("--max-batch", type=int, help="server sequences per step (default: the server's)")
    g.add_argument("--serve-args", default="", help="more `inferscale serve` options, one shell-quoted string "
                   "(in-process: those that shape the engine, e.g. --dtype, --page-size, --no-warmup)")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for the server to start")
    g = p.add_argument_group("workload")
    g.add_argument("--tenants", type=int, default=2, help="(default: %(default)s)")
    g.add_argument("--segments-per-tenant", type=int, default=2, help="(default: %(default)s)")
    g.add_argument("--segment-tokens", type=int, default=1024, help="tokens of each segment (default: %(default)s)")
    g.add_argument("--question-tokens", type=int, default=64, help="tokens of each question (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    g.add_argument("--max-tokens-spread", type=int, default=0,
                   help="each request's max_tokens uniform in --max-tokens +- this (default 0: all equal, and "
                        "clients of a closed loop then run in cohorts: bench/NOTES.md, run AK 8)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s, greedy)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens per request (default: %(default)s)")
    g.add_argument("--warm", type=float, default=0.5, help="fraction of requests on warm segments (default: "
                   "%(default)s)")
    g.add_argument("--cold", type=float, default=0.25, help="fraction on cold segments; the rest have no segment "
                   "(default: %(default)s)")
    g.add_argument("--context", choices=CONTEXTS, default="segment", help="how a warm or cold request carries its "
                   "segment's text: segment (registered, named), inline (the text before the question: the "
                   "automatic prefix cache), none (the question alone) (default: %(default)s)")
    g = p.add_argument_group("load")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--rates", type=floats, help="Poisson request rates per second, comma-separated; inf = all "
                      "at once (default: 1,2,4)")
    load.add_argument("--concurrency", type=ints, help="fixed numbers of clients in flight, comma-separated")
    g.add_argument("--num-requests", type=int, default=100, help="requests per load point; with --concurrency C, "
                   "max(this, 2 x C), so every client sends at least two (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="arrivals, kinds, tenants and texts (default: %(default)s)")
    g.add_argument("--warmup-requests", type=int, default=2, help="sequential warm-up requests of each kind "
                   "(default: %(default)s)")
    g.add_argument("--warmup-burst", type=int, default=8, help="the largest burst of mixed warm-up requests "
                   "sent at once; bursts of 2, 4, ... up to it run first (default: %(default)s)")
    g.add_argument("--first-runs-timeout", type=float, default=120.0, help="after the warm-up, wait up to this "
                   "many seconds for the server's buckets' first runs (its warm-up leaves them to idle time; a load "
                   "point that meets one pays ~80 ms per bucket inside a step: bench/NOTES.md, run AP), as the "
                   "in-process engine makes them in its warm-up; 0: do not wait (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    g.add_argument("--switch-interval", type=float, help="in-process via: sys.setswitchinterval(SECONDS) in this "
                   "process, whose engine thread shares the GIL with the clients' event loop (Python's default 0.005)")
    g.add_argument("--client-procs", type=int, default=None, help="HTTP closed loops: spread the clients over this "
                   "many benchmark processes (default: one per 16 clients, at most half the cores: one Python "
                   "process reading 64 SSE streams cost C = 64 5266 vs 5548 tok/s and TTFT p50 89 vs 52 ms against 4, "
                   "bench/NOTES.md run AR; the table's CPU column shows each side's use)")
    g = p.add_argument_group("output")
    g.add_argument("--out", help="prefix of the .json/.md/.png results (default: bench/results/serve_<device>)")
    g.add_argument("--work-dir", help="the server's key file and log (default: a temporary folder, removed after a "
                   "run without errors)")
    g.add_argument("--device", help="device name for the report and the default --out (default: asked from jax)")
    args = p.parse_args(argv)
    if args.rates is None and args.concurrency is None:
        args.rates = [1.0, 2.0, 4.0]
    if args.in_process and args.mode not in (None, ["inproc"]):
        p.error(f"--in-process is --mode inproc; it contradicts --mode {','.join(args.mode)}")
    args.mode = ["inproc"] if args.in_process else args.mode or ["http"]
    if args.server_log and not args.url:
        p.error("--server-log reads a running server's log: it goes with --url (a server started here logs to "
                "its work folder)")
    if args.server_log:
        args.server_log = os.path.abspath(os.path.expanduser(args.server_log))
        if not os.path.isfile(args.server_log):
            p.error(f"--server-log {args.server_log}: no such file (start the server with --log-level info "
                    "--log-requests and its output sent there)")
    if args.url and "inproc" in args.mode:
        p.error("--url benchmarks a running server; --mode inproc builds its own engine from --model (and needs "
                "the device free): run them apart")
    bad = [f"{name}={v}" for name, v in (("--tenants", args.tenants), ("--segments-per-tenant",
           args.segments_per_tenant), ("--segment-tokens", args.segment_tokens), ("--question-tokens",
           args.question_tokens), ("--max-tokens", args.max_tokens), ("--num-requests", args.num_requests)) if v < 1]
    bad += [f"--max-tokens-spread {args.max_tokens_spread} (0 <= spread < --max-tokens {args.max_tokens})"
            ] if not 0 <= args.max_tokens_spread < max(1, args.max_tokens) else []
    bad += [f"--rates {r}" for r in args.rates or () if not r > 0]
    bad += [f"--concurrency {c}" for c in args.concurrency or () if c < 1]
    bad += [f"--client-procs {args.client_procs}"] if args.client_procs is not None and args.client_procs < 1 else []
    bad += [f"--switch-interval {args.switch_interval}"] if args.switch_interval is not None and not (
        args.switch_interval > 0) else []
    if not (0 <= args.warm and 0 <= args.cold and args.warm + args.cold <= 1):
        bad.append(f"--warm {args.warm} --cold {args.cold} (each >= 0, together <= 1)")
    if bad:
        p.error("out of range: " + ", ".join(bad) + "; counts, rates, concurrency, client processes and the switch "
                "interval must be positive")
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
        self.pools: dict[int, list[str]] = {}  # words of the k smallest counts, by k (a segment's words reuse them)
        self.inexact = 0  # texts whose length came out other than asked (no word fitted the rest)

    def make(self, n: int, rng: np.random.Generator) -> str:
        """" w1 w2 ..." of ``n`` tokens (exactly, when the vocabulary has one-token words)."""
        parts, left = [], n
        while left > 0:
            k = max(1, sum(c <= left for c in self.counts))
            pool = self.pools.get(k)
            if pool is None:
                pool = self.pools[k] = [w for c in self.counts[:k] for w in self.by_count[c]]
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
    cold_text: str | None = None  # the cold segment's text (--context segment)
    inline: str = ""  # the segment's text before the question (--context inline)
    max_tokens: int | None = None  # this request's (--max-tokens-spread); None: --max-tokens

    @property
    def prompt(self) -> str:
        return self.inline + self.question


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
    start: float | None = None  # perf_counter at send (the steady window, ``steady_throughput``)
    request_id: str | None = None  # the server's X-Request-Id
    # the engine's own clock (RequestMetrics): its submit -> first token (ttft_s), of which the queue
    # (queue_s); over HTTP from the server's per-request log lines (``request_times``)
    engine_ttft: float | None = None
    engine_queue: float | None = None

    def timed(self, t0: float, times: list[float]) -> None:
        """A completed request: its chunks' arrival ``times`` (text chunks) since the send at ``t0``
        (TTFT, ITL, TPOT over ``completion_tokens``, set before)."""
        self.chunks = len(times)
        if times:
            self.ttft = times[0] - t0
            self.itl = np.diff(times).tolist()
            if self.completion_tokens > 1:
                self.tpot = (times[-1] - times[0]) / (self.completion_tokens - 1)
        self.ok = True


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


def request_records(log_path: str, ids: set[str], wait_s: float = 3.0) -> dict[str, dict]:
    """Request id -> its per-request log line (``serve --log-requests --log-level info``, a JSON
    object with ``ttft_s``, ``queue_s``, ``segments``, ...) in ``log_path``, for ``ids`` (a line is
    written as its response ends: waits up to ``wait_s`` for the last ones)."""
    found: dict[str, dict] = {}
    deadline = time.monotonic() + wait_s
    while True:
        with open(log_path, errors="replace") as f:
            for line in f:
                _, sep, rest = line.partition(" inferscale.server ")
                if not sep or not rest.startswith("{"):
                    continue
                try:
                    x = json.loads(rest)
                except ValueError:
                    continue
                if x.get("id") in ids and "ttft_s" in x:
                    found[x["id"]] = x
        if len(found) >= len(ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def request_times(log_path: str, ids: set[str], wait_s: float = 3.0) -> dict[str, tuple[float, float]]:
    """Request id -> (engine ttft_s, queue_s) from ``request_records``."""
    return {rid: (x["ttft_s"], x.get("queue_s")) for rid, x in request_records(log_path, ids, wait_s).items()}


class Server:
    """``inferscale serve`` on a free loopback port with a key file of the bench's tenants."""

    def __init__(self, args, workdir: str, tenants: list[str]):
        self.keys = {f"bench-{t}-{uuid.uuid4().hex}": t for t in tenants}
        self.keys[f"bench-admin-{uuid.uuid4().hex}"] = {"tenant": ADMIN, "admin": True}
        key_file = os.path.join(workdir, "keys.json")
        with open(key_file, "w") as f:
            json.dump(self.keys, f)
        self.url = f"http://127.0.0.1:{free_port()}"
        # one JSON line per request (--log-requests, at INFO): the engine's TTFT and queue time per request id
        self.cmd = [sys.executable, "-m", "inferscale_cli", "serve", "--host", "127.0.0.1",
                    "--port", self.url.rsplit(":", 1)[1], "--api-keys", key_file, "--log-level", "info",
                    "--log-requests"]
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


async def wait_first_runs(client, stats: dict | None, timeout: float) -> tuple[float, dict | None]:
    """Wait (up to ``timeout`` s) until the engine reports no bucket's first run left
    (``first_runs_left``: a server's warm-up leaves them to idle time, one bucket at a time); returns
    the seconds waited (0.0 when none were left or the stats lack the key) and the last stats read.
    A poll that fails or gets no stats (an error reply) is logged and the wait goes on: it is only
    an optional pause."""
    if not stats or not stats.get("first_runs_left") or timeout <= 0:
        return 0.0, stats
    t0 = time.perf_counter()
    deadline = t0 + timeout
    last, left = stats, stats["first_runs_left"]
    while left and time.perf_counter() < deadline:
        await asyncio.sleep(min(0.5, deadline - time.perf_counter()))
        try:
            now = await asyncio.wait_for(client.stats(), max(0.1, deadline - time.perf_counter()))
        except Exception as err:  # noqa: BLE001 - a failed poll: the wait goes on until its timeout
            log(f"[serve] {client.via}: stats poll failed while waiting for the first runs ({type(err).__name__})")
            continue
        if now is None or "first_runs_left" not in now:
            log(f"[serve] {client.via}: no stats while waiting for the first runs (an error reply)")
            continue
        last, left = now, now["first_runs_left"]
    waited = time.perf_counter() - t0
    log(f"[serve] {client.via}: waited {waited:.1f} s for the buckets' first runs ({stats['first_runs_left']} left "
        f"after the warm-up, {left} at the end" + (": timed out" if left else "") + ")")
    return waited, last


def warmup_first_runs(w: dict) -> str:
    """The report's words on the first runs after the warm-up: the wait, and any runs still left."""
    wait, left = w.get("first_runs_wait_s"), w.get("first_runs_left")
    if not wait and not left:
        return ""
    text = f"; then {wait:.1f} s waiting for the buckets' first runs" if wait else "; no wait for the first runs"
    return text + (f", {left} still left (the load points pay them)" if left else ", none left")


def first_runs(before: dict | None, after: dict | None) -> int | None:
    """Buckets whose first run came inside a load point (``first_runs_left`` before minus after);
    None when the stats lack it (an older server)."""
    if not before or not after or "first_runs_left" not in before or "first_runs_left" not in after:
        return None
    return before["first_runs_left"] - after["first_runs_left"]


def compiles_cell(p: dict) -> str:
    """The table's compiles cell: the compiles in the point, and its first runs when there were any."""
    cell = "n/a" if p["compiles"] is None else str(p["compiles"])
    return cell + (f" ({p['first_runs']})" if p.get("first_runs") else "")


def engine_steps(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """The engine's steps over a point from its stats before and after: how many, the wall time per
    step, and the mean rows (all, decode), tokens and tokens padded to (the steps' buckets) per step
    (None without stats or steps)."""
    if not before or not after or "steps" not in after:
        return None
    n = after["steps"] - before["steps"]
    if n <= 0:
        return None
    keys = ("rows", "decode_rows", "tokens") + (("padded_tokens",) if "step_padded_tokens" in after else ())
    per = {k: (after[f"step_{k}"] - before.get(f"step_{k}", 0)) / n for k in keys}
    return {"steps": n, "step_ms": 1e3 * wall / n, **per}


def keys_from_file(path: str) -> dict:
    """An ``inferscale serve --api-keys`` file (JSON or TOML): key -> tenant or {tenant, admin}."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except ValueError:
        return tomllib.loads(raw.decode("utf-8"))


class Via:
    """What the load needs of a via: ``tenants``, ``register`` (seconds), ``delete``, ``stats``
    (the engine's, or None), ``complete`` (one request into a ``Result``), ``aclose``."""

    tenants: list[str]

    async def run(self, spec: Spec, args) -> Result:
        """A request of any kind; a cold one registers its segment first and deletes it after."""
        res = Result(spec.kind)
        try:
            if spec.cold_text is not None:
                res.register = await self.register(spec.tenant, spec.segment, spec.cold_text)
            await self.complete(spec, args, res)
        except Exception as e:  # noqa: BLE001 - one failed request is counted, the run goes on
            res.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            if spec.cold_text is not None:
                try:
                    await self.delete(spec.tenant, spec.segment)
                except Exception:  # noqa: BLE001 - a leftover cold segment does not fail the run
                    pass
        return res


class Client(Via):
    """httpx calls of the benchmark: tenants' segment and completion calls, the admin's stats."""

    via = "http"

    def __init__(self, url: str, keys: dict | None, n_tenants: int, timeout: float, connections: int):
        self.url = url.rstrip("/")
        self.keys = keys
        self.server_pid: int | None = None  # the server started here (its CPU is reported per point)
        self.request_log: str | None = None  # the server's log (the engine's times per request), if known
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
        body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens or args.max_tokens, "temperature": args.temperature,
                "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if spec.segment is not None:
            body["segments"] = [spec.segment]
        usage, times = None, []
        t0 = time.perf_counter()
        res.start = t0
        async with self.http.stream("POST", "/v1/completions", json=body, headers=self.headers[spec.tenant]) as r:
            res.request_id = r.headers.get("x-request-id")
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
        res.timed(t0, times)

    async def aclose(self) -> None:
        await self.http.aclose()


def serve_namespace(args) -> argparse.Namespace:
    """``inferscale serve``'s options for this run, parsed by its own parser (so its defaults)."""
    from inferscale_cli.main import build_parser

    argv = ["serve"]
    for flag, value in (("--model", args.model), ("--hbm-pages", args.hbm_pages), ("--max-batch", args.max_batch)):
        if value is not None:
            argv += [flag, str(value)]
    return build_parser().parse_args(argv + shlex.split(args.serve_args))


def serve_engine_config(ns: argparse.Namespace):
    """The ``EngineConfig`` ``inferscale serve`` builds from its options (the same function)."""
    from inferscale_cli.main import resolve_dtype
    from inferscale_cli.serve import _engine_config

    return _engine_config(ns, resolve_dtype)


class InProcess(Via):
    """The same calls on ``AsyncEngine`` in this process: no HTTP, no auth, tenants t0, t1, ..."""

    via = "inproc"

    def __init__(self, args, tenants: list[str]):
        import logging

        from inferscale_jax.async_engine import AsyncEngine
        from inferscale_jax.engine import Engine
        from inferscale_jax.sampling import SamplingParams

        if not logging.getLogger().handlers:  # the engine's warnings (e.g. a compile after warm-up), as serve logs
            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.switch_interval:
            sys.setswitchinterval(args.switch_interval)
        ns = serve_namespace(args)
        self.config = serve_engine_config(ns)
        self.tenants, self.sampling_params = list(tenants), SamplingParams
        t0 = time.monotonic()
        self.engine = Engine.from_pretrained(args.model, self.config)
        self.load_s = time.monotonic() - t0
        self.ae = AsyncEngine(self.engine)
        self.warmup_info, self.warmup_s = None, 0.0
        self.do_warmup = ns.warmup
        log(f"[serve] in-process engine loaded in {self.load_s:.0f} s: {self.config}")

    async def start(self) -> None:
        """The engine's warm-up, on the engine thread, as ``inferscale serve`` runs it before /health is 200."""
        if not self.do_warmup:
            return
        t0 = time.monotonic()
        self.warmup_info = await self.ae.call(self.engine.warmup)
        self.warmup_s = time.monotonic() - t0
        log(f"[serve] in-process engine warm-up: {self.warmup_s:.0f} s")

    async def register(self, tenant: str, sid: str, text: str) -> float:
        t0 = time.perf_counter()
        await self.ae.register_segment(sid, text=text, tenant=tenant)
        return time.perf_counter() - t0

    async def delete(self, tenant: str, sid: str) -> None:
        await self.ae.delete_segment(sid, tenant=tenant)

    async def stats(self) -> dict:
        return await self.ae.stats()

    async def complete(self, spec: Spec, args, res: Result) -> None:
        """``AsyncEngine.stream`` of the request the server would submit for the same body."""
        sampling = self.sampling_params(max_tokens=spec.max_tokens or args.max_tokens, temperature=args.temperature,
                                        ignore_eos=args.ignore_eos)
        segments = [spec.segment] if spec.segment is not None else []
        final, times = None, []
        t0 = time.perf_counter()
        res.start = t0
        async for delta in self.ae.stream(prompt=spec.prompt, segments=segments, tenant=spec.tenant,
                                          sampling=sampling):
            if delta.text:
                times.append(time.perf_counter())
            if delta.finished:
                final = delta.output
        res.e2e = time.perf_counter() - t0
        if final is None:
            res.error = "the stream ended without a final output"
            return
        m = final.metrics
        res.engine_ttft, res.engine_queue = m.ttft_s, m.queue_s
        res.prompt_tokens, res.cached_tokens = m.prompt_tokens, m.cached_tokens
        res.completion_tokens = m.generated_tokens
        res.timed(t0, times)

    async def aclose(self) -> None:
        pass

    def shutdown(self) -> None:
        """As serve ends: no new compile, the engine thread stopped, then ``close``."""
        self.engine.stop_warmup()
        self.ae.shutdown(timeout=60.0)
        if self.ae.stopped:
            self.engine.close()


# ---------------------------------------------------------------- load

def with_context(spec: Spec, sid: str, text: str, context: str, cold: bool) -> Spec:
    """``spec`` carrying its segment as ``--context`` says (module docstring, 6)."""
    if context == "segment":
        spec.segment, spec.cold_text = sid, text if cold else None
    elif context == "inline":
        spec.inline = text
    else:
        spec.kind = "none"
    return spec


def make_specs(n: int, kinds: list[str] | None, args, tenants: list[str], warm: dict, maker: TextMaker,
               rng: np.random.Generator, tag: str) -> list[Spec]:
    """``n`` requests (of ``kinds``, or of the --warm/--cold mix); ``warm``: tenant -> [(id, text)].
    The draws are the same whatever ``--context`` is, so only the context differs between them."""
    kinds = kinds or mix(n, {"warm": args.warm, "cold": args.cold, "none": 1 - args.warm - args.cold}, rng)
    specs = []
    for i, kind in enumerate(kinds):
        tenant = tenants[int(rng.integers(len(tenants)))]
        spec = Spec(kind, tenant, maker.make(args.question_tokens, rng))
        if kind == "warm":
            sid, text = warm[tenant][int(rng.integers(len(warm[tenant])))]
            spec = with_context(spec, sid, text, args.context, cold=False)
        elif kind == "cold":
            sid = f"bench-cold-{tag}-{i}-{uuid.uuid4().hex[:8]}"
            spec = with_context(spec, sid, maker.make(args.segment_tokens, rng), args.context, cold=True)
        if args.max_tokens_spread:  # (drawn last: without a spread the other draws are as before)
            spread = args.max_tokens_spread
            spec = dataclasses.replace(spec, max_tokens=args.max_tokens + int(rng.integers(-spread, spread + 1)))
        specs.append(spec)
    return specs


def point_requests(args, mode: str, x) -> int:
    """Requests of a load point: --num-requests; with C clients at least 2 x C (each sends two or more)."""
    return args.num_requests if mode == "rate" else max(args.num_requests, 2 * int(x))


async def poisson(client: Via, specs: list[Spec], args, rate: float, rng: np.random.Generator):
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


async def closed_loop(client: Via, specs: list[Spec], args, concurrency: int):
    """``concurrency`` clients, each sending the next request when its last one ends."""
    queue = list(reversed(specs))
    results: list[Result] = []

    async def worker():
        while queue:
            results.append(await client.run(queue.pop(), args))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return results, time.perf_counter() - t0


def client_procs(args, concurrency: int) -> int:
    """Benchmark processes of an HTTP closed loop of ``concurrency`` clients (``--client-procs``)."""
    k = args.client_procs or min(-(-int(concurrency) // 16), max(1, (os.cpu_count() or 2) // 2))
    return max(1, min(k, int(concurrency)))


CLIENT_WORKER = "--client-worker"  # argv[1] of a --client-procs process (stdin: its JSON job)


def client_worker() -> int:
    """A ``--client-procs`` process: its JSON job on stdin (url, keys, the options, its requests, its
    clients), its results as JSON on stdout.  JSON, not pickle: this script's classes live under a
    different module name in each process (``__main__`` here, ``inferscale bench serve``'s otherwise)."""
    job = json.load(sys.stdin)
    args = argparse.Namespace(**job["args"])
    specs = [Spec(**d) for d in job["specs"]]

    async def go():
        client = Client(job["url"], job["keys"], args.tenants, args.request_timeout, 2 * job["concurrency"])
        try:
            return await closed_loop(client, specs, args, job["concurrency"])
        finally:
            await client.aclose()
    cpu0 = time.process_time()
    results, wall = asyncio.run(go())
    json.dump({"results": [dataclasses.asdict(r) for r in results], "wall": wall,
               "cpu": time.process_time() - cpu0}, sys.stdout)
    return 0


async def closed_loop_procs(client: "Client", specs: list[Spec], args, concurrency: int):
    """``closed_loop`` over ``--client-procs`` processes (this script, ``client_worker``; clients and
    requests dealt round-robin): (results, wall seconds, the processes' CPU seconds).  ``perf_counter``
    is the system's monotonic clock on Linux, so every process's send times share one axis."""
    k = client_procs(args, concurrency)
    opts = {key: v for key, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    jobs = [json.dumps({"url": client.url, "keys": client.keys, "args": opts, "concurrency": concurrency // k + (i < concurrency % k),
                        "specs": [dataclasses.asdict(sp) for sp in specs[i::k]]}) for i in range(k)]

    async def one(job: str):
        proc = await asyncio.create_subprocess_exec(sys.executable, os.path.abspath(__file__), CLIENT_WORKER,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate(job.encode())
        if proc.returncode != 0:
            raise RuntimeError(f"a --client-procs process exited with {proc.returncode}")
        return json.loads(out)

    got = await asyncio.gather(*(one(job) for job in jobs))
    results = [Result(**d) for g in got for d in g["results"]]
    # from the first send to the last end (the processes' start-up is not the server's time)
    timed = [r for r in results if r.start is not None]
    wall = (max(r.start + (r.e2e or 0.0) for r in timed) - min(r.start for r in timed)) if timed else max(
        g["wall"] for g in got)
    return results, wall, sum(g["cpu"] for g in got)


def process_cpu(pid: int | None) -> dict:
    """CPU seconds (user + system) of the process ``pid`` and, apart, of its descendants (the engine core
    and any more API servers of ``inferscale serve``); {} without psutil or a pid."""
    if pid is None:
        return {}
    try:
        import psutil

        proc = psutil.Process(pid)
        own = sum(proc.cpu_times()[:2])
        kids = 0.0
        for child in proc.children(recursive=True):
            try:
                kids += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
        return {"server": own, "server_children": kids}
    except Exception:  # noqa: BLE001 - the figures stand without it
        return {}


def cpu_share(before: dict, after: dict, wall: float) -> dict:
    """Per role, CPU seconds / wall seconds (1.0 = one core busy the whole point)."""
    return {k: (after[k] - before[k]) / wall for k in after if k in before and wall > 0}


# ---------------------------------------------------------------- figures

def dist(xs: list[float], scale: float = 1e3) -> dict | None:
    """p50/p90/p99/mean of ``xs`` (seconds) in ms, and the sample count."""
    if not xs:
        return None
    a = np.asarray(xs, dtype=float) * scale
    return {**{f"p{q}": float(v) for q, v in zip(PCTS, np.percentile(a, PCTS))}, "mean": float(a.mean()), "n": len(a)}


def ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def steady_throughput(ok: list[Result]) -> float | None:
    """Output tok/s while every client of a closed loop is busy: from the first request's end (the
    first wave's start-up is over) to the last request's send (clients go idle after it).  Each
    request's tokens count spread evenly over its decode (first token to end), pro rata to the
    part inside the window.  None when the window is empty (too few requests per client)."""
    timed = [r for r in ok if r.start is not None and r.e2e is not None and r.ttft is not None]
    if not timed:
        return None
    lo, hi = min(r.start + r.e2e for r in timed), max(r.start for r in timed)
    if hi - lo <= 0:
        return None
    tokens = 0.0
    for r in timed:
        a, b = r.start + r.ttft, r.start + r.e2e
        inside = max(0.0, min(b, hi) - max(a, lo))
        tokens += r.completion_tokens * (inside / (b - a) if b > a else float(lo <= a <= hi))
    return tokens / (hi - lo)


def ttft_split(ok: list[Result]) -> dict | None:
    """Where the client's TTFT goes (ms dists): the engine's (its submit -> first token, ``ttft_s``),
    of which its queue (``queue_s``: submit -> running), and the rest outside the engine (HTTP, the
    API process, the core's hand-offs, the client); None without the engine's times."""
    both = [r for r in ok if r.ttft is not None and r.engine_ttft is not None]
    if not both:
        return None
    return {"engine_ms": dist([r.engine_ttft for r in both]),
            "queue_ms": dist([r.engine_queue for r in both if r.engine_queue is not None]),
            "prefill_ms": dist([r.engine_ttft - r.engine_queue for r in both if r.engine_queue is not None]),
            "outside_ms": dist([r.ttft - r.engine_ttft for r in both])}


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out = {
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "output_throughput": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "steady_output_throughput": steady_throughput(ok),
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
        "ttft_split": ttft_split(ok),
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


def cpu_cell(p: dict) -> str:
    """The point's CPU use in cores (bench processes / server / the server's children)."""
    c = p.get("cpu") or {}
    procs = p.get("client_procs", 1)
    bench = num(c.get("bench")) + (f" ({procs} procs)" if procs > 1 else "")
    return " / ".join([bench, num(c.get("server")), num(c.get("server_children"))])


def load_label(p: dict) -> str:
    return f"{p['rate']:g} req/s" if p["mode"] == "rate" else f"{p['concurrency']} clients"


def via_points(summary: dict) -> list[tuple[str, int, dict]]:
    """(via, load index, point) of every run, load-major: a load point's vias side by side."""
    rows = [(via, i, p) for via, run in summary["runs"].items() for i, p in enumerate(run["points"])]
    return sorted(rows, key=lambda r: (r[1], VIAS.index(r[0])))


def report(summary: dict, prefix: str) -> None:
    cfg = summary["config"]
    runs, both = summary["runs"], bool(summary["comparison"])
    ratio_of = {c_i: c for c_i, c in enumerate(summary["comparison"])}
    MD.extend([f"# Serving benchmark: {summary['device']}", "",
               f"{summary['date']}; `{summary['command']}`; code {summary.get('code', 'unknown')}", "",
               *(summary.get("switches") or []), *([""] if summary.get("switches") else [])])
    if summary["device"].startswith("cpu"):
        MD.extend(["**CPU figures with the tiny random default model: they show that the harness works, not "
                   "GPU performance.**", ""])
    per_point = (f"{cfg['num_requests']} requests per load point" if not cfg["concurrency"] else
                 f"max({cfg['num_requests']}, 2 x clients) requests per load point")
    vias = []
    if "http" in runs:
        vias.append(f"`http`: server `{runs['http']['server_command'] or runs['http']['url']}`")
    if "inproc" in runs:
        c = runs["inproc"]["engine_config"]
        vias.append(f"`inproc`: `AsyncEngine` in the benchmark's process, `Engine.from_pretrained` with serve's "
                    f"`EngineConfig` (dtype {c.get('dtype')}, page_size {c.get('page_size')}, hbm_pages "
                    f"{c.get('hbm_pages')}, max_batch {c.get('max_batch')})")
    MD.extend([f"Vias: {'; '.join(vias)}. Model `{cfg['model']}`; "
               f"{cfg['tenants']} tenants x {cfg['segments_per_tenant']} segments of {cfg['segment_tokens']} "
               f"tokens, context `{cfg['context']}`; questions of {cfg['question_tokens']} tokens, "
               f"{cfg['max_tokens']}{' +- ' + str(cfg['max_tokens_spread']) if cfg.get('max_tokens_spread') else ''} "
               f"tokens generated (temperature {cfg['temperature']}, ignore_eos "
               f"{cfg['ignore_eos']}); mix warm {cfg['warm']}, cold {cfg['cold']}, none "
               f"{1 - cfg['warm'] - cfg['cold']:.2f}; {per_point}, seed {cfg['seed']}. Definitions: bench/serving/serve.py "
               "docstring; p99 over fewer than 1000 samples (the `n` column) is indicative only.", ""])
    rows = via_points(summary)
    head = ["load", "via", "n", "errors", "req/s", "out tok/s", "steady tok/s"] + (["HTTP / inproc tok/s"] if both else []) + [
        "TTFT", "ITL", "TPOT p50", "E2E", "cached ratio", "compiles (first runs)", "CPU cores: bench / server / its children"]
    table("Latency (ms, p50 / p90 / p99) and throughput per load point", head, [
        [load_label(p), via, p["completed"], p["errors"], num(p["request_throughput"]), num(p["output_throughput"], 1),
         num(p.get("steady_output_throughput"), 1)]
        + ([num(ratio_of[i]["http_over_inproc"], 3) if via == "http" else ""] if both else [])
        + [fmt(p["ttft_ms"]), fmt(p["itl_ms"]), fmt(p["tpot_ms"], "p50"), fmt(p["e2e_ms"]), num(p["cached_ratio"], 3),
           compiles_cell(p), cpu_cell(p)] for via, i, p in rows])
    split = [(via, p) for via, _, p in rows if p.get("ttft_split")]
    if split:
        table("Where TTFT goes (ms, p50 / p90 / p99): the engine's clock (submit -> first token), its queue "
              "(submit -> running) and the rest (prefill steps and the first token's read-back), and outside "
              "the engine (client TTFT - engine TTFT: HTTP, API process, hand-offs to and from the engine)", [
                  "load", "via", "client TTFT", "engine TTFT", "queue", "engine rest", "outside the engine"], [
                  [load_label(p), via, fmt(p["ttft_ms"]), fmt(s["engine_ms"]), fmt(s["queue_ms"]),
                   fmt(s["prefill_ms"]), fmt(s["outside_ms"])] for via, p in split for s in [p["ttft_split"]]])
    table("By request kind (ms, p50 / p90 / p99; register = the cold segment's registration)", [
        "load", "via", "kind", "n", "errors", "TTFT", "E2E", "register", "cached ratio"], [
        [load_label(p), via, kind, k["requests"], k["errors"], fmt(k["ttft_ms"]), fmt(k["e2e_ms"]),
         fmt(k["register_ms"]), num(k["cached_ratio"], 3)] for via, _, p in rows for kind, k in p["by_kind"].items()])
    for via, run in runs.items():
        w = run["warmup"]
        start = (f"server ready in {run['ready_s']:.0f} s" if run.get("ready_s") is not None else
                 f"engine loaded in {run['load_s']:.0f} s, its warm-up {run['engine_warmup_s']:.0f} s"
                 if via == "inproc" else "a running server")
        MD.extend([f"`{via}`: {start}. Warm-up (not measured): {w['requests']} requests, {w['errors']} errors, "
                   f"{w['wall_s']:.1f} s; engine compiles by then: {w['compiles']}"
                   + warmup_first_runs(w)
                   + f". Segment setup: {w['segments']} "
                   f"registered, register p50 {fmt(w['register_ms'], 'p50')} ms.", ""])
    out_dir, name = os.path.split(prefix)
    with open(prefix + ".json", "w") as f:
        json.dump(summary, f, indent=1, default=str)
    log(f"wrote {prefix}.json")
    write_md(out_dir or ".", name + ".md", MD)
    plot(summary, prefix + ".png")


def plot(summary: dict, path: str) -> None:
    plt = pyplot()
    runs = summary["runs"]
    pts = summary["points"]
    if plt is None or not pts:
        return
    numeric = all(math.isfinite(p["rate"] if p["mode"] == "rate" else p["concurrency"]) for p in pts)
    xs = [(p["rate"] if p["mode"] == "rate" else p["concurrency"]) if numeric else i for i, p in enumerate(pts)]
    xlabel = "request rate (req/s, Poisson)" if pts[0]["mode"] == "rate" else "concurrent clients"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    one = len(runs) == 1
    for via, run in runs.items():
        vp = run["points"]
        tag = "" if one else f"{via} "
        for metric, color in (("ttft_ms", "tab:blue"), ("itl_ms", "tab:green"), ("e2e_ms", "tab:red")):
            # one via: p50 / p90 / p99 by line style; two: p50 and p99, the via by line style
            qs = PCTS if one else (50, 99)
            styles = ("-o", "--s", ":^") if one else (("-o", "-^") if via == "http" else ("--o", "--^"))
            for q, style in zip(qs, styles):
                ys = [p[metric][f"p{q}"] if p[metric] else float("nan") for p in vp]
                a.plot(xs, ys, style, color=color, label=f"{tag}{metric[:-3].upper()} p{q}",
                       markerfacecolor="none" if via == "inproc" else color)
        b.plot(xs, [p["output_throughput"] or 0 for p in vp], "-o" if via == "http" else "--s",
               color="tab:blue" if via == "http" else "tab:purple", label=f"{tag}output tokens/s")
    a.set(xlabel=xlabel, ylabel="ms", yscale="log", title="latency percentiles")
    a.legend(fontsize=7, ncol=3 if one else 2)
    b.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput")
    b2 = b.twinx()
    if one:
        b2.plot(xs, [p["request_throughput"] or 0 for p in pts], ":s", color="tab:orange", label="requests/s")
        b2.set_ylabel("requests/s")
    else:
        b2.plot(xs, [c["http_over_inproc"] or float("nan") for c in summary["comparison"]], ":D", color="tab:gray",
                label="HTTP / in-process tok/s")
        b2.axhline(0.85, color="tab:gray", lw=0.8, ls="--", label="0.85 (issue 30)")
        b2.set_ylabel("HTTP / in-process")
        b2.set_ylim(0, max(1.1, *[(c["http_over_inproc"] or 0) * 1.1 for c in summary["comparison"]]))
    b.legend(loc="upper left", fontsize=8)
    b2.legend(loc="lower right", fontsize=8)
    if not numeric:
        for ax in (a, b):
            ax.set_xticks(xs, [load_label(p) for p in pts])
    elif min(xs) > 0 and max(xs) >= 8 * min(xs):  # e.g. 1, 16, 64, 256 clients
        for ax in (a, b):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
    title = "serve" if one and "http" in runs else " / ".join(runs)
    fig.suptitle(f"inferscale {title}: {summary['device']}, "
                 f"{summary['config']['segment_tokens']}-token segments ({summary['config']['context']}), "
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


async def bench(args, client: Via, maker: TextMaker) -> dict:
    """Steps 4-7 of the module docstring through one via; the same seed gives every via the same texts."""
    rng = np.random.default_rng(args.seed)
    tenants = client.tenants
    run_tag = uuid.uuid4().hex[:8]
    warm = {t: [(f"bench-{t}-{run_tag}-{j}", maker.make(args.segment_tokens, rng))
                for j in range(args.segments_per_tenant)] for t in tenants}
    registered = []
    try:
        if isinstance(client, InProcess):
            await client.start()
        seg_times = []
        if args.context == "segment":
            for t in tenants:
                for sid, text in warm[t]:
                    seg_times.append(await client.register(t, sid, text))
                    registered.append((t, sid))
            log(f"[serve] {client.via}: {len(registered)} segments of {args.segment_tokens} tokens registered")
        # warm-up: every warm segment once, then each kind in turn, then a burst
        t0 = time.perf_counter()
        before = await client.stats()
        firsts = [with_context(Spec("warm", t, maker.make(args.question_tokens, rng)), sid, text, args.context, False)
                  for t in tenants for sid, text in warm[t]]
        kinds = [k for k in KINDS for _ in range(args.warmup_requests)]
        specs = [*firsts, *make_specs(len(kinds), kinds, args, tenants, warm, maker, rng, "warmup")]
        results = [await client.run(s, args) for s in specs]
        for size in burst_sizes(args.warmup_burst):  # the batch sizes load will bring
            burst = make_specs(size, None, args, tenants, warm, maker, rng, f"burst{size}")
            results += await asyncio.gather(*(client.run(s, args) for s in burst))
        stats = await client.stats()
        wall = time.perf_counter() - t0
        idle_wait, stats = await wait_first_runs(client, stats, args.first_runs_timeout)
        warmup = {"requests": len(results), "errors": sum(not r.ok for r in results),
                  "error_samples": sorted({r.error for r in results if not r.ok})[:5],
                  "wall_s": wall, "compiles": stats["compiles"] if stats else None,
                  "compiles_in_warmup": stats["compiles"] - before["compiles"] if stats and before else None,
                  "segments": len(registered), "register_ms": dist(seg_times),
                  "first_runs_wait_s": idle_wait, "first_runs_left": stats.get("first_runs_left") if stats else None}
        log(f"[serve] {client.via} warm-up: {warmup['requests']} requests, {warmup['errors']} errors, "
            f"{warmup['wall_s']:.1f} s, compiles {warmup['compiles']}")
        points = []
        loads = [("rate", x) for x in args.rates or ()] + [("concurrency", x) for x in args.concurrency or ()]
        for i, (mode, x) in enumerate(loads):
            prng = np.random.default_rng([args.seed, i])
            specs = make_specs(point_requests(args, mode, x), None, args, tenants, warm, maker, prng, f"p{i}")
            before = await client.stats()
            server_pid = getattr(client, "server_pid", None)
            cpu0 = {"bench": time.process_time(), **process_cpu(server_pid)}
            procs_cpu = 0.0
            if mode == "rate":
                results, wall = await poisson(client, specs, args, x, prng)
            elif client.via == "http" and client_procs(args, x) > 1:
                results, wall, procs_cpu = await closed_loop_procs(client, specs, args, x)
            else:
                results, wall = await closed_loop(client, specs, args, x)
            cpu1 = {"bench": time.process_time() + procs_cpu, **process_cpu(server_pid)}
            after = await client.stats()
            if getattr(client, "request_log", None):  # the engine's clock, from the server's log
                times = request_times(client.request_log, {r.request_id for r in results if r.ok and r.request_id})
                for r in results:
                    r.engine_ttft, r.engine_queue = times.get(r.request_id, (None, None))
            p = {"mode": mode, "rate": x if mode == "rate" else None, "concurrency": x if mode != "rate" else None,
                 **summarize(results, wall), "cpu": cpu_share(cpu0, cpu1, wall),
                 **({"steady_output_throughput": None} if mode == "rate" else {}),  # (no closed-loop window)
                 "client_procs": client_procs(args, x) if client.via == "http" and mode != "rate" else 1,
                 "compiles": after["compiles"] - before["compiles"] if before and after else None,
                 "first_runs": first_runs(before, after),
                 "engine_steps": engine_steps(before, after, wall)}
            points.append(p)
            log(f"[serve] {client.via} {load_label(p)}: {p['completed']}/{p['requests']} ok, "
                f"{num(p['request_throughput'])} req/s, {num(p['output_throughput'], 1)} tok/s, "
                f"TTFT {fmt(p['ttft_ms'])} ms, ITL {fmt(p['itl_ms'])} ms, E2E {fmt(p['e2e_ms'])} ms, "
                f"cached {num(p['cached_ratio'], 3)}, compiles {p['compiles']}"
                + (f", first runs {p['first_runs']}" if p["first_runs"] else ""))
            if p["engine_steps"]:
                e = p["engine_steps"]
                log(f"[serve] {client.via} engine: {e['steps']} steps, {e['step_ms']:.2f} ms each, rows "
                    f"{e['rows']:.1f} ({e['decode_rows']:.1f} decode), tokens {e['tokens']:.1f} per step"
                    + (f" (padded to {e['padded_tokens']:.1f})" if "padded_tokens" in e else ""))
        return {"warmup": warmup, "points": points}
    finally:
        for t, sid in registered:
            try:
                await client.delete(t, sid)
            except Exception:  # noqa: BLE001 - the run's figures stand without the clean-up
                pass
        await client.aclose()


def run_http(args, maker: TextMaker, workdir: str, tenant_names: list[str]) -> dict:
    """The HTTP via: a server started here (or ``--url``), the load, the server stopped."""
    server = None
    if args.url:
        url, keys = args.url, keys_from_file(args.api_keys) if args.api_keys else None
    else:
        server = Server(args, workdir, tenant_names)
        url, keys = server.url, server.keys
    connections = max([args.num_requests, args.warmup_burst, *(2 * c for c in args.concurrency or [])])
    ready_s = None
    try:
        if server is not None:
            t0 = time.monotonic()
            server.wait_ready(args.ready_timeout)
            ready_s = time.monotonic() - t0
            log(f"[serve] server ready in {ready_s:.0f} s at {url}")
        client = Client(url, keys, args.tenants, args.request_timeout, connections)
        client.server_pid = server.proc.pid if server is not None else args.server_pid
        client.request_log = server.log_path if server is not None else args.server_log
        figures = asyncio.run(bench(args, client, maker))
    finally:
        if server is not None:
            server.stop()
    return {"via": "http", "server_command": shlex.join(server.cmd[1:]) if server else None, "url": url,
            "ready_s": ready_s, "tenants": len(client.tenants), **figures}


def run_inproc(args, maker: TextMaker, tenant_names: list[str]) -> dict:
    """The in-process via: the engine as serve builds it, its warm-up, the load, its shutdown."""
    client = InProcess(args, tenant_names)
    try:
        figures = asyncio.run(bench(args, client, maker))
    finally:
        client.shutdown()
    return {"via": "inproc", "engine_config": dataclasses.asdict(client.config),
            "load_s": client.load_s, "engine_warmup_s": client.warmup_s,
            "engine_warmup_buckets": (client.warmup_info or {}).get("buckets"), "tenants": len(client.tenants),
            **figures}


def compare(runs: dict) -> list[dict]:
    """Per load point of both vias: output tokens/s, TTFT and ITL p50 of each, HTTP / in-process."""
    if not {"http", "inproc"} <= set(runs):
        return []

    def p50(p, key):
        return p[key]["p50"] if p[key] else None

    out = []
    for h, i in zip(runs["http"]["points"], runs["inproc"]["points"]):
        ht, it = h["output_throughput"], i["output_throughput"]
        out.append({"mode": h["mode"], "rate": h["rate"], "concurrency": h["concurrency"],
                    "http_output_throughput": ht, "inproc_output_throughput": it,
                    "http_over_inproc": ht / it if ht and it else None,
                    "http_ttft_p50_ms": p50(h, "ttft_ms"), "inproc_ttft_p50_ms": p50(i, "ttft_ms"),
                    "http_itl_p50_ms": p50(h, "itl_ms"), "inproc_itl_p50_ms": p50(i, "itl_ms")})
    return out


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
    workdir = os.path.abspath(args.work_dir) if args.work_dir else tempfile.mkdtemp(prefix="inferscale-bench-serve-")
    os.makedirs(workdir, exist_ok=True)
    tenant_names = [f"t{i}" for i in range(args.tenants)]
    runs = {}

    def summary() -> dict:
        first = runs[args.mode[0]]
        return {
            "device": device, "date": datetime.date.today().isoformat(),
            "command": shlex.join(["python", "bench/serving/serve.py", *(sys.argv[1:] if argv is None else argv)]),
            "code": code_version(), "switches": switch_lines(),  # (the commit measured; INFERSCALE_* set outside)
            "vias": list(runs),
            "server_command": runs["http"]["server_command"] if "http" in runs else None,
            "url": runs["http"]["url"] if "http" in runs else None,
            "config": {**{k: v for k, v in vars(args).items() if k not in ("api_keys",)},
                       "model": args.model or "default model", "tenants": first["tenants"]},
            "texts_inexact": maker.inexact,
            "warmup": first["warmup"], "points": first["points"],  # the first via's (runs: each one's)
            "runs": runs,
            "comparison": compare(runs),
        }

    for via in args.mode:  # HTTP first: its server has exited before the in-process engine loads
        runs[via] = (run_http(args, maker, workdir, tenant_names) if via == "http"
                     else run_inproc(args, maker, tenant_names))
        # the report so far after each via (a run cut short by a time limit keeps what it measured)
        report(summary(), prefix)
    errors = sum(r["warmup"]["errors"] + sum(p["errors"] for p in r["points"]) for r in runs.values())
    log(f"[serve] done: {errors} errors; results {prefix}.json/.md/.png")
    if errors == 0 and not args.work_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    elif errors:
        log(f"[serve] the server's log and key file: {workdir}")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(client_worker() if sys.argv[1:2] == [CLIENT_WORKER] else main())
