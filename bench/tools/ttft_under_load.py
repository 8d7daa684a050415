"""Where the time to first token goes in ``inferscale serve`` under C concurrent streams, stretch by stretch.

    python bench/tools/ttft_under_load.py --paced-step-ms 16 --concurrency 256      # no model: the API path
    python bench/tools/ttft_under_load.py --model /tmp/llama8b --concurrency 256 -- --api-server-count 2
    python bench/tools/ttft_under_load.py --model /tmp/llama8b --segments 8 --segment-tokens 4096 -- --api-server-count 2

``first_token_timeline.py`` follows one request at a time (C = 1); under load the stretches that
grow are the waits behind the other streams, so this tool keys its trace points by request id.
It starts ``serve`` (``--paced-step-ms``: the model-free paced engine of ``bench/lib/paced_engine.py``)
with ``--log-requests`` and points in every API process, runs ``--concurrency`` closed-loop
streaming clients (64-token prompts, ``--max-tokens`` greedy tokens, ``ignore_eos``; with
``--segments N`` each prompt names one of N segments of ``--segment-tokens`` random token ids
registered first, as ``bench/serving/serve.py``'s workload; ``--max-tokens-spread S`` draws each
request's ``max_tokens`` from max-tokens +- S, so the closed loop's clients do not finish in waves)
spread over ``--client-procs`` processes for ``--seconds``, and reports each stretch's p50 / p90 over the
requests sent after the first ``--skip-s`` seconds (the first wave, every client process's at once, left out):

``client_send`` (the client, before the POST) -> ``stream_enter`` (the API process's handler calls
``CoreClient.stream``: HTTP, parsing, validation, admission; under load mostly the event loop's
backlog) -> ``step_received`` (the core's first step message with this request, on the I/O
thread: ZMQ both ways, the core's poll, and the engine's own TTFT, given apart from the server's
request log) -> ``first_delta`` (on the event loop) -> ``first_body`` (its SSE bytes written to
uvicorn's transport) -> ``client_first`` (the client has the first text).

Every point reads ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock across processes on Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "tools"), os.path.join(ROOT, "bench", "serving")]

from first_token_timeline import Trace, common_options, launch, wait_ready, write_report  # noqa: E402
from serve import dist, request_records  # noqa: E402  (bench/serving/serve.py: the request log, percentiles)
from servers import stop_process  # noqa: E402

HAS_TEXT = re.compile(rb'"text": ?"[^"]')  # a completion chunk with text (the server's JSON: `"text": "..."`)
POINTS = ("client_send", "stream_enter", "step_received", "first_delta", "first_body", "client_first")
PROMPT = " ".join(["what does the cache hold for this tenant today"] * 7)  # ~64 tokens


def install_points(trace) -> None:
    """Wrap the API process's functions at each point; ``trace(name, request_id)``."""
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    import serving.core_client as core_client

    client = core_client.CoreClient
    stream, on_message = client.stream, client._on_message
    seen: set = set()

    async def traced_stream(self, **request):
        rid = request.get("request_id")
        trace("stream_enter", rid)
        first = True
        async for item in stream(self, **request):
            if first:
                first = False
                trace("first_delta", rid)
            yield item

    def traced_on_message(self, msg):
        if msg[0] == "step":
            for entry in msg[1]:
                if entry[0] not in seen:
                    seen.add(entry[0])
                    trace("step_received", entry[0])
        return on_message(self, msg)

    client.stream, client._on_message = traced_stream, traced_on_message
    cycle = httptools_impl.RequestResponseCycle
    send = cycle.send

    async def traced_send(self, message):
        if message["type"] == "http.response.start":
            self.trace_rid = dict(message.get("headers") or ()).get(b"x-request-id", b"").decode() or None
        elif (message["type"] == "http.response.body" and getattr(self, "trace_rid", None)
              and HAS_TEXT.search(message.get("body", b""))):
            rid, self.trace_rid = self.trace_rid, None
            await send(self, message)
            trace("first_body", rid)
            return
        return await send(self, message)

    cycle.send = traced_send


def serve_child(args) -> int:
    """This tool's child: ``serve`` with the points in its API process(es)."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "lib"))
    os.environ["INFERSCALE_TTFT_TRACE"] = args.trace  # (more API processes are spawned: they read it)
    _install_from_env()
    from inferscale_cli import main as cli
    from inferscale_cli import serve

    serve_args = list(args.serve_args)
    if args.paced_step_ms is not None:
        import paced_engine

        os.environ["INFERSCALE_PACED_STEP_MS"] = str(args.paced_step_ms)  # (read by the spawned core)
        serve.build_engine = paced_engine.build
        serve_args = ["--no-warmup", *serve_args]
    return cli.main(["serve", *serve_args])


def _install_from_env() -> None:
    """In an API process spawned by the traced ``serve`` (``--api-server-count`` > 1) and in the
    first one: the points, into the shared trace file."""
    path = os.environ.get("INFERSCALE_TTFT_TRACE")
    if path:
        t = Trace(path)
        install_points(lambda name, rid: t(f"{name} {rid}"))


def client_proc(url: str, clients: int, seconds: float, max_tokens: int, trace_path: str, out, start,
                segments: int = 0, spread: int = 0, seed: int = 0) -> None:
    """One client process: ``clients`` closed loops for ``seconds``, begun when every client process
    is ready (``start``, a barrier: spawning them takes seconds on a busy machine, and all must send
    their first wave together for the skip window to leave it out); each request's send and first
    text go to the trace (keyed by the server's X-Request-Id).  ``segments``: each request names
    ``seg<i>`` for a random i below it; ``spread``: its ``max_tokens`` is drawn from max_tokens +- spread."""
    import random

    import httpx

    fd = os.open(trace_path, os.O_WRONLY | os.O_APPEND)
    rng = random.Random(seed)
    start.wait()

    async def main():
        limits = httpx.Limits(max_connections=2 * clients, max_keepalive_connections=2 * clients)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            end = time.perf_counter() + seconds

            async def loop():
                sent = 0
                while time.perf_counter() < end:
                    body = {"prompt": PROMPT, "max_tokens": max_tokens + rng.randint(-spread, spread),
                            "temperature": 0, "stream": True, "ignore_eos": True}
                    if segments:
                        body["segments"] = [f"seg{rng.randrange(segments)}"]
                    t0 = time.perf_counter()
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        rid, first = r.headers.get("x-request-id"), None
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data: {") and HAS_TEXT.search(line.encode()):
                                first = time.perf_counter()
                    if rid and first is not None:
                        os.write(fd, f"client_send {rid} {t0:.6f}\nclient_first {rid} {first:.6f}\n".encode())
                        sent += 1
                return sent
            return sum(await asyncio.gather(*(loop() for _ in range(clients))))
    out.put(asyncio.run(main()))


def register_segments(url: str, model: str | None, count: int, tokens: int) -> None:
    """``seg0`` .. ``seg<count-1>``: ``tokens`` random token ids each (below ``model``'s vocabulary)."""
    import json
    import random

    import httpx

    from inferscale_jax.default_model import default_model_dir

    with open(os.path.join(model or default_model_dir(), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    for i in range(count):
        ids = [rng.randrange(10, vocab) for _ in range(tokens)]
        r = httpx.post(f"{url}/v1/segments", json={"id": f"seg{i}", "token_ids": ids}, timeout=600)
        if r.status_code != 201:
            raise SystemExit(f"registering seg{i} answered {r.status_code}: {r.text[:300]}")


def stretches(trace_path: str, log_path: str, since: float) -> tuple[list[dict], dict]:
    """Each request's points (sent at or after ``since``) and its line of the server's request log
    (the engine's ``ttft_s``, ``queue_s``, the ``segments`` it named) per request id."""
    points: dict[str, dict] = {}
    with open(trace_path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3:
                name, rid, t = parts
                points.setdefault(rid, {}).setdefault(name, float(t))
    sent = {rid for rid, p in points.items() if all(k in p for k in POINTS) and p["client_send"] >= since}
    engine = request_records(log_path, sent, wait_s=0.0)
    return [dict(points[rid], rid=rid) for rid in sent if rid in engine], engine


def report(done: list[dict], engine: dict, title: str) -> str:
    named = sum(bool(engine[r["rid"]].get("segments")) for r in done)
    lines = [title, "", f"{len(done)} requests ({named} naming a segment); ms, p50 / p90:", "",
             "| from | to | p50 | p90 |", "| --- | --- | --- | --- |"]

    def row(a: str, b: str, seconds: list[float], bold: str = "") -> None:
        d = dist(seconds)
        lines.append(f"| {a} | {b} | {bold}{d['p50']:.1f}{bold} | {bold}{d['p90']:.1f}{bold} |")
    for a, b in zip(POINTS, POINTS[1:]):
        row(a, b, [r[b] - r[a] for r in done])
    row("(inside stream_enter -> step_received)", "the engine's TTFT", [engine[r["rid"]]["ttft_s"] for r in done])
    row("client_send", "client_first (TTFT)", [r["client_first"] - r["client_send"] for r in done], "**")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_options(ap)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--client-procs", type=int, default=None, help="(default: one per 16 clients, as bench/serving/serve.py)")
    ap.add_argument("--seconds", type=float, default=40.0, help="the load's length (default: 40)")
    ap.add_argument("--skip-s", type=float, default=10.0, help="requests sent in the first seconds left out")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-tokens-spread", type=int, default=0,
                    help="each request's max_tokens from --max-tokens +- this (default 0: every stream the same length)")
    ap.add_argument("--segments", type=int, default=0,
                    help="segments registered first; each request names one at random (default 0: plain prompts)")
    ap.add_argument("--segment-tokens", type=int, default=4096, help="each segment's random token ids (default 4096)")
    args = ap.parse_args()
    if args.serve_child:
        sys.exit(serve_child(args))
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in (("concurrency", args.concurrency), ("seconds", args.seconds),
                                                        ("max_tokens", args.max_tokens)) if not v > 0]
    if bad or not 0 <= args.skip_s < args.seconds:
        ap.error(f"out of range: {', '.join(bad) or f'--skip-s {args.skip_s}'} (counts and seconds > 0, "
                 "0 <= --skip-s < --seconds)")
    if not 0 <= args.max_tokens_spread < args.max_tokens:
        ap.error(f"--max-tokens-spread {args.max_tokens_spread} is out of range: 0 <= spread < --max-tokens "
                 f"({args.max_tokens})")
    if args.segments < 0 or args.segment_tokens < 1:
        ap.error(f"--segments {args.segments} / --segment-tokens {args.segment_tokens}: need segments >= 0 and "
                 "segment tokens >= 1")
    if args.segments and args.paced_step_ms is not None:
        ap.error("--segments needs a model: the paced engine (--paced-step-ms) holds no segments")
    url, trace_path, proc, log = launch(__file__, args, ["--log-level", "info", "--log-requests", "--max-batch",
                                                         str(args.concurrency)], "ttft-load")
    procs = args.client_procs or min(max(1, -(-args.concurrency // 16)), max(1, (os.cpu_count() or 2) // 2))
    try:
        wait_ready(url, proc, args.timeout)
        if args.segments:
            register_segments(url, args.model, args.segments, args.segment_tokens)
        ctx = multiprocessing.get_context("spawn")
        out, start = ctx.Queue(), ctx.Barrier(procs + 1)
        workers = [ctx.Process(
            target=client_proc, args=(url, args.concurrency // procs + (i < args.concurrency % procs), args.seconds,
                                      args.max_tokens, trace_path, out, start, args.segments, args.max_tokens_spread,
                                      i))
            for i in range(procs)]
        for w in workers:
            w.start()
        start.wait(timeout=120)  # (every client process ready: they all send their first wave now)
        since = time.perf_counter() + args.skip_s
        sent = sum(out.get(timeout=args.seconds + 600) for _ in workers)
        for w in workers:
            w.join()
        time.sleep(1.0)  # (the last requests' log lines)
    finally:
        stop_process(proc, 120)
    done, engine = stretches(trace_path, log, since)
    if not done:
        raise SystemExit(f"no request passed every point ({sent} sent; server log: {log})")
    what = f"paced engine, {args.paced_step_ms} ms steps" if args.paced_step_ms is not None else \
        (args.model or "the default model")
    write_report(report(done, engine, f"# Time to first token under load: C = {args.concurrency} ({what})\n\n"
                                      f"`python bench/tools/ttft_under_load.py {' '.join(sys.argv[1:])}` ({sent} "
                                      f"requests in all, {procs} client processes)"), args.out)
    os.unlink(trace_path)


if __name__ == "__mp_main__":  # an API process spawned by the traced serve (this file is its main module)
    _install_from_env()

if __name__ == "__main__":
    main()
