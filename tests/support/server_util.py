"""Helpers for the server tests: run the real ``inferscale serve`` in a subprocess, parse SSE."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.support import REPO  # noqa: F401 (the repository root, imported from here by tests)
# the engine config every server test uses; the in-process reference engine uses the same
SERVE_ARGS = ["--dtype", "float32", "--page-size", "16", "--hbm-pages", "512", "--no-warmup", "--log-requests"]
ENGINE_KW = dict(dtype="float32", page_size=16, hbm_pages=512)


def cache_dir(tmp_path_factory) -> str:
    """One INFERSCALE_CACHE per test session (the default model is built once, in a tmp dir)."""
    from inferscale_jax import default_model_dir

    path = tmp_path_factory.getbasetemp() / "inferscale-cache"
    path.mkdir(exist_ok=True)
    default_model_dir(str(path))  # build it here, before any server process looks for it
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m inferscale_cli serve`` on a free loopback port, until ``stop()``."""

    def __init__(self, tmp_dir, cache: str, *args: str):
        """Start the process; ``wait_ready()`` before use (so callers can load things meanwhile)."""
        self.log_path = os.path.join(str(tmp_dir), "server.log")
        env = dict(os.environ, INFERSCALE_CACHE=cache, JAX_PLATFORMS="cpu",
                   JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "jax-compile-cache"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inferscale_cli", "serve", "--port", str(self.port), *SERVE_ARGS, *args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 240.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise AssertionError(f"server did not start; log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def request_lines(self) -> list[dict]:
        """The server's structured per-request log lines."""
        out = []
        for line in self.log().splitlines():
            _, sep, rest = line.partition(" inferscale.server ")
            if sep and rest.startswith("{"):
                out.append(json.loads(rest))
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def sse_events(lines) -> list:
    """``data:`` payloads of an SSE stream: parsed JSON objects, and the final ``"[DONE]"``."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def stream_text(events) -> str:
    parts = []
    for ev in events:
        if ev == "[DONE]" or not ev.get("choices"):
            continue
        ch = ev["choices"][0]
        parts.append(ch["text"] if "text" in ch else ch["delta"].get("content") or "")
    return "".join(parts)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within timeout")
        time.sleep(interval)
