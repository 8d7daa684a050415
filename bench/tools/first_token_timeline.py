"""Where a lone request's time to first token goes in ``inferscale serve``: a timeline per request.

    python bench/tools/first_token_timeline.py --model /tmp/llama8b --requests 40   # H200: the real engine
    python bench/tools/first_token_timeline.py --paced-step-ms 50                    # no model (the API path alone)

Starts ``serve`` (the default layout: this tool's child is the API process, the engine core its
own process; ``--paced-step-ms`` swaps the core's engine for ``bench/lib/paced_engine.py``, whose
first token comes at once) with trace points in the API process, then sends ``--requests``
streamed completions one at a time (C = 1) and reports, for each stretch between two points, its
median and mean over the requests (the first ``--skip`` left out).  The points, in a request's order:

``client_send`` (this process, before the POST) -> ``uvicorn_data`` (the first bytes reach the API
process's HTTP protocol) -> ``asgi_enter`` (the app is called) -> ``route_job`` (the completion
handler builds its job: body parsed and validated, auth and admission passed) -> ``stream_enter``
(``CoreClient.stream``) -> ``tokenized`` -> ``submit_sent`` (handed to the I/O thread for the
core) -> in the engine core's process: ``core_recv`` (``EngineCore.handle`` takes the submit) ->
``dispatch_start`` / ``dispatch_end`` (the first ``ModelRunner.dispatch`` after it: the question's
prefill step packed and launched) -> ``collect_start`` / ``collect_end`` (the first
``ModelRunner.collect``: the loop reads a step one iteration late, so between ``dispatch_end`` and
``collect_start`` it plans and launches the next step, and ``collect`` then waits for the device) ->
``core_sent`` (the core's first step message for it on its socket) -> ``step_received`` (that
message, on the API's I/O thread) ->
``first_delta`` (the stream's first delta, on the event loop) -> ``first_body`` (the first SSE
bytes handed to uvicorn) -> ``client_first`` (this process: the first text chunk parsed).

Every point reads ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock across processes on Linux).
The core's points are installed in the core process: ``serve`` spawns it, and a spawned process
imports its parent's main module (this file, as ``__mp_main__``), which installs them there when
``INFERSCALE_TIMELINE_TRACE`` names the trace file.  With ``--paced-step-ms`` (no runner) the four
runner points are left out.  Writes ``--out`` (markdown) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, os.path.join(ROOT, "bench", "serving"))

from servers import free_port, stop_process  # noqa: E402  (bench/serving/servers.py)
POINTS = ("client_send", "uvicorn_data", "asgi_enter", "route_job", "stream_enter", "tokenized", "submit_sent",
          "core_recv", "dispatch_start", "dispatch_end", "collect_start", "collect_end", "core_sent",
          "step_received", "first_delta", "first_body", "client_first")
RUNNER_POINTS = ("dispatch_start", "dispatch_end", "collect_start", "collect_end")  # (not with the paced engine)
TRACE_ENV = "INFERSCALE_TIMELINE_TRACE"  # the trace file, for the core process's points
PROMPT = ("Summarize what the segment says about the engine's cache, and name the two settings that matter "
          "most for a server under load.")


class Trace:
    """Points appended to one file, one ``name time`` line each (every process and thread)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lock = threading.Lock()

    def __call__(self, name: str) -> None:
        line = f"{name} {time.perf_counter():.6f}\n".encode()
        with self.lock:
            os.write(self.fd, line)


def install_points(trace: Trace) -> None:
    """Wrap the API process's functions at each point (the module docstring's list)."""
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    import serving
    import serving.app as app_module
    import serving.core_client as core_client

    data_received = httptools_impl.HttpToolsProtocol.data_received

    def on_data(self, data):
        trace("uvicorn_data")
        return data_received(self, data)

    httptools_impl.HttpToolsProtocol.data_received = on_data
    create_app = serving.create_app

    def traced_app(*args, **kwargs):
        app = create_app(*args, **kwargs)

        async def asgi(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            trace("asgi_enter")
            first = [True]

            async def traced_send(message):
                if first[0] and message["type"] == "http.response.body" and message.get("body"):
                    first[0] = False
                    trace("first_body")
                await send(message)

            return await app(scope, receive, traced_send)

        return asgi

    serving.create_app = traced_app
    completion_job = app_module.completion_job

    def traced_job(*args, **kwargs):
        trace("route_job")
        return completion_job(*args, **kwargs)

    app_module.completion_job = traced_job
    client = core_client.CoreClient
    stream, pretokenized, send, on_message = client.stream, client._pretokenized, client._send, client._on_message

    async def traced_stream(self, **request):
        trace("stream_enter")
        first = True
        async for item in stream(self, **request):
            if first:
                first = False
                trace("first_delta")
            yield item

    async def traced_pretokenized(self, *args, **kwargs):
        out = await pretokenized(self, *args, **kwargs)
        trace("tokenized")
        return out

    def traced_send(self, msg):
        if msg[0] == "submit":
            trace("submit_sent")
        return send(self, msg)

    def traced_on_message(self, msg):
        if msg[0] == "step":
            trace("step_received")
        return on_message(self, msg)

    client.stream, client._pretokenized = traced_stream, traced_pretokenized
    client._send, client._on_message = traced_send, traced_on_message


def install_core_points(trace: Trace) -> None:
    """Wrap the engine core's functions at its points (the module docstring's list), in the core process."""
    from inferscale_jax import engine_core, runner

    core, model_runner = engine_core.EngineCore, runner.ModelRunner
    handle, send, dispatch, collect = core.handle, core.send, model_runner.dispatch, model_runner.collect

    def traced_handle(self, ident, msg):
        if msg[0] == "submit":
            trace("core_recv")
        return handle(self, ident, msg)

    def traced_send(self, ident, msg):
        if msg[0] == "step":
            trace("core_sent")
        return send(self, ident, msg)

    def spanned(fn, name):  # fn between the points NAME_start and NAME_end
        def traced(self, *args, **kwargs):
            trace(f"{name}_start")
            try:
                return fn(self, *args, **kwargs)
            finally:
                trace(f"{name}_end")
        return traced

    core.handle, core.send = traced_handle, traced_send
    model_runner.dispatch, model_runner.collect = spanned(dispatch, "dispatch"), spanned(collect, "collect")


def serve_child(args, serve_args: list[str]) -> int:
    """This tool's child: the API process of ``serve``, traced (and, through ``TRACE_ENV``, its core)."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]
    install_points(Trace(args.trace))
    os.environ[TRACE_ENV] = args.trace  # (the spawned core inherits it: the end of this file)
    from inferscale_cli import main as cli
    from inferscale_cli import serve

    if args.paced_step_ms is not None:
        import paced_engine

        os.environ["INFERSCALE_PACED_STEP_MS"] = str(args.paced_step_ms)  # (read by the spawned core)
        serve.build_engine = paced_engine.build
        serve_args = ["--no-warmup", *serve_args]
    return cli.main(["serve", *serve_args])


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    from serve_ready import health  # (this folder's startup timer: /health's status, None while down)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if health(url) == 200:
            return
        time.sleep(0.25)
    raise SystemExit(f"the server did not become ready within {timeout:.0f} s (exit code {proc.poll()})")


def send_requests(url: str, trace: Trace, n: int, max_tokens: int, gap_s: float) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(n):
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            trace("client_send")
            with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise SystemExit(f"the server answered {r.status_code}: {r.read()[:300]!r}")
                first = True
                for line in r.iter_lines():
                    if first and line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if event.get("choices") and event["choices"][0].get("text"):
                            trace("client_first")
                            first = False
            time.sleep(gap_s)


def timeline(path: str, skip: int, points=POINTS) -> list[dict]:
    """Each request's first occurrence of every point after its ``client_send`` (requests that reached
    every one of ``points``)."""
    events = []
    with open(path) as f:
        for line in f:
            name, t = line.split()
            events.append((float(t), name))
    requests: list[dict] = []
    for t, name in sorted(events):
        if name == "client_send":
            requests.append({name: t})
        elif requests and name not in requests[-1]:
            requests[-1][name] = t
    return [r for r in requests[skip:] if all(p in r for p in points)]


def report(requests: list[dict], title: str, points=POINTS) -> str:
    """Each stretch's median and mean over the requests (ms).  The means add up to the TTFT's mean
    (every request has every point); the medians need not (a stretch that is long in a few requests
    only, such as a wait for the core's step, moves the TTFT's median but not its own)."""
    lines = [title, "", f"{len(requests)} requests (ms):", "", "| from | to | median | mean |",
             "| --- | --- | --- | --- |"]
    for a, b in zip(points, points[1:]):
        ms = [(r[b] - r[a]) * 1e3 for r in requests]
        lines.append(f"| {a} | {b} | {statistics.median(ms):.3f} | {statistics.fmean(ms):.3f} |")
    ms = [(r["client_first"] - r["client_send"]) * 1e3 for r in requests]
    lines.append(f"| client_send | client_first (TTFT) | **{statistics.median(ms):.3f}** | "
                 f"**{statistics.fmean(ms):.3f}** |")
    return "\n".join(lines)


def common_options(ap: argparse.ArgumentParser) -> None:
    """The options this tool shares with ``ttft_under_load.py``."""
    ap.add_argument("--model", help="the checkpoint folder (default: the embedded default model)")
    ap.add_argument("--paced-step-ms", type=float, default=None,
                    help="the model-free paced engine instead of the model (its first token comes at once)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the server to become ready")
    ap.add_argument("--out", help="write the markdown report here too")
    ap.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("serve_args", nargs="*", help="after --: more of serve's own flags")


def launch(script: str, args, serve_args: list[str], name: str) -> tuple[str, str, subprocess.Popen, str]:
    """``script --serve-child`` (a traced ``serve``) on a free port: (url, trace file, process, log file)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trace_path = tempfile.mktemp(prefix=f"inferscale-{name}-", suffix=".txt")
    serve_args = ["--host", "127.0.0.1", "--port", str(port), *(["--model", args.model] if args.model else []),
                  *serve_args, *args.serve_args]
    cmd = [sys.executable, os.path.abspath(script), "--serve-child", "--trace", trace_path,
           *(["--paced-step-ms", str(args.paced_step_ms)] if args.paced_step_ms is not None else []), "--", *serve_args]
    log = tempfile.NamedTemporaryFile("w", prefix=f"inferscale-{name}-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return url, trace_path, proc, log.name


def write_report(text: str, out: str | None) -> None:
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_options(ap)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="first requests left out of the medians (default: 5)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=50.0, help="idle time between requests (default: 50)")
    args = ap.parse_args()
    if args.serve_child:
        sys.exit(serve_child(args, args.serve_args))
    url, trace_path, proc, log = launch(__file__, args, ["--log-level", "warning"], "timeline")
    try:
        wait_ready(url, proc, args.timeout)
        send_requests(url, Trace(trace_path), args.requests, args.max_tokens, args.gap_ms / 1e3)
    finally:
        stop_process(proc, 120)
    points = tuple(p for p in POINTS if args.paced_step_ms is None or p not in RUNNER_POINTS)
    requests = timeline(trace_path, args.skip, points)
    if not requests:
        raise SystemExit(f"no request passed every point (server log: {log})")
    engine = f"paced engine, {args.paced_step_ms} ms steps" if args.paced_step_ms is not None else \
        (args.model or "the default model")
    write_report(report(requests, f"# First-token timeline of `serve` at C = 1 ({engine})\n\n`python "
                                  f"bench/tools/first_token_timeline.py {' '.join(sys.argv[1:])}`", points), args.out)
    os.unlink(trace_path)


def _in_core() -> bool:
    """Whether this process is the engine core a traced ``serve`` spawned (not another spawned API process)."""
    import multiprocessing

    if __name__ != "__mp_main__" or not os.environ.get(TRACE_ENV):
        return False
    sys.path[:0] = [ROOT]
    from inferscale_cli.serve import CORE_PROCESS_NAME

    return multiprocessing.current_process().name == CORE_PROCESS_NAME


if _in_core():
    install_core_points(Trace(os.environ[TRACE_ENV]))

if __name__ == "__main__":
    main()
