"""How long ``inferscale serve`` takes to become ready, cold and warm (issue 30's startup target).

Starts ``python -m inferscale_cli serve ARGS`` ``--runs`` times in a row with the same persistent
compilation cache (``INFERSCALE_CACHE``, a fresh temporary folder unless set), and for each start
reports the seconds from the process's launch to ``/health`` answering 200 (the model loaded and
every step bucket compiled or loaded: ``serve``'s warm-up), then sends SIGTERM and reports the
seconds to exit and the exit code (0: drained).  The first run with an empty cache is the cold
start; the next ones are warm restarts.

    python bench/tools/serve_ready.py --runs 2 -- --model /tmp/llama8b          # H200: cold, then warm
    python bench/tools/serve_ready.py --runs 2 --out /tmp/ready.md               # the default model, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
MAX_WARNINGS = 12  # of one start's warning and error lines, the first this many are reported


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def one_start(serve_args: list[str], env: dict, timeout: float, log_path: str) -> dict:
    """One ``serve`` process: seconds to /health 200, then SIGTERM and seconds to exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "inferscale_cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "info", *serve_args]
    t0, wall0 = time.monotonic(), time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        ready = None
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            if health(url) == 200:
                ready = time.monotonic() - t0
                break
            time.sleep(0.25)
        t1 = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return dict(ready_s=ready, exit_s=time.monotonic() - t1, rc=rc, log=log_path, parts=startup_lines(log_path, wall0))


def startup_lines(log_path: str, wall0: float) -> list[str]:
    """The engine's own account of the start (its load and warm-up lines, with their parts, and any
    warning or error logged: the first ``MAX_WARNINGS``), each with the seconds from the launch to when it was logged (its
    asctime, millisecond resolution)."""
    out, warnings = [], 0
    with open(log_path, errors="replace") as f:
        for line in f:
            engine = "inferscale.engine " in line and (" loaded " in line or " warm-up: " in line)
            if not engine and (" WARNING " not in line and " ERROR " not in line or warnings >= MAX_WARNINGS):
                continue
            warnings += not engine
            try:
                stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1e3
                out.append(f"+{stamp - wall0:.1f} s: {line[24:].strip()}")
            except ValueError:
                out.append(line.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="starts in a row, the same cache (default 2: cold, warm)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for one start to become ready")
    ap.add_argument("--out", help="write the markdown table here too (and each start's log to OUT-stem_logs/)")
    ap.add_argument("serve_args", nargs="*", help="after --: serve's own arguments (e.g. --model DIR)")
    args = ap.parse_args()
    env = dict(os.environ)
    if not env.get("INFERSCALE_CACHE"):
        env["INFERSCALE_CACHE"] = tempfile.mkdtemp(prefix="inferscale-ready-cache-")
    # each start's whole log: beside --out (run_N.log) when given, else in a temporary folder
    logs = (os.path.splitext(os.path.abspath(args.out))[0] + "_logs" if args.out
            else tempfile.mkdtemp(prefix="inferscale-ready-logs-"))
    os.makedirs(logs, exist_ok=True)
    rows = []
    for i in range(args.runs):
        cache = env["INFERSCALE_CACHE"]
        warm = os.path.isdir(cache) and any(files for _, _, files in os.walk(cache))
        r = one_start(args.serve_args, env, args.timeout, os.path.join(logs, f"serve_{i}.log"))
        r["start"] = "warm" if warm else "cold"
        rows.append(r)
        print(json.dumps(r), flush=True)
    lines = [f"`python bench/tools/serve_ready.py --runs {args.runs} -- {' '.join(args.serve_args)}`; "
             f"cache `{env['INFERSCALE_CACHE']}`", "",
             "| run | start | /health 200 after s | SIGTERM to exit s | exit code |", "| --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rows):
        ready = f"{r['ready_s']:.1f}" if r["ready_s"] is not None else "not ready"
        lines.append(f"| {i + 1} | {r['start']} | {ready} | {r['exit_s']:.1f} | {r['rc']} |")
    for i, r in enumerate(rows):
        lines += ["", f"Run {i + 1}, the engine's log:", *(f"- `{line}`" for line in r["parts"])]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if any(r["ready_s"] is None or r["rc"] != 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
