"""The ``inferscale`` command as a user types it: the installed console script, run from a fresh
folder with relative paths and the defaults (the embedded default model, ``--dtype auto``).

- ``precompute corpus.jsonl --snapshot-dir ./kv`` works, twice (the second run skips the
  unchanged documents), then ``serve --snapshot-dir ./kv`` restores those segments from the
  snapshot (same default dtype as ``precompute``), a segment registered over HTTP survives a
  SIGTERM and a restart, and no command prints a traceback or third-party noise;
- known failures print one ``error: ...`` line and exit non-zero (``--debug``: the traceback).
"""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_util import cache_dir, free_port

INFERSCALE = os.path.join(os.path.dirname(sys.executable), "inferscale")
# lines that must never reach a user's terminal
NOISE = ("Traceback", "Event loop is closed", "PyTorch was not found", "absl", "Logging before flag parsing")
DOCS = {"doc-a": "The kettle has a three year warranty.", "doc-b": "Descale the kettle every month."}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = cache_dir(tmp_path_factory)
    # torch hidden, as on a machine without it: transformers would print its "PyTorch was not found" advisory
    hide = tmp_path_factory.mktemp("no-torch")
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    return dict(os.environ, INFERSCALE_CACHE=cache, JAX_PLATFORMS="cpu", PYTHONPATH=str(hide))


def inferscale(cwd, env, *args, timeout=300):
    return subprocess.run([INFERSCALE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_quiet(stderr: str) -> None:
    for noise in NOISE:
        assert noise not in stderr, stderr[-3000:]


def write_corpus(path, docs) -> None:
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))


class Serve:
    """``inferscale serve`` from ``cwd`` on a free loopback port, stopped with SIGTERM."""

    def __init__(self, cwd, env, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / f"serve-{self.port}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([INFERSCALE, "serve", "--port", str(self.port), *args], cwd=cwd, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        self.health: list[str] = []  # the /health statuses seen while starting
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health.append(r.json().get("status", ""))
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise AssertionError(f"serve did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> str:
        """SIGTERM, wait for the exit (final snapshot included); the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.log.read_text()


def test_precompute_twice_then_serve_restores_relative_snapshot_dir(tmp_path, env):
    write_corpus(tmp_path / "corpus.jsonl", DOCS)
    first = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv")
    assert first.returncode == 0, first.stderr[-3000:]
    assert_quiet(first.stderr)
    assert "2 stored, 0 skipped unchanged" in first.stdout, first.stdout
    assert (tmp_path / "kv" / "snapshots").is_dir()
    second = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv")
    assert second.returncode == 0, second.stderr[-3000:]
    assert_quiet(second.stderr)
    assert "0 stored, 2 skipped unchanged" in second.stdout, second.stdout

    # serve, with the same defaults, restores what precompute stored; a segment registered over HTTP
    # survives SIGTERM + restart, its KV restored from the snapshot (not recomputed)
    server = Serve(tmp_path, env, "--snapshot-dir", "./kv")
    try:
        # serve compiles every step bucket before it says ok (Engine.warmup)
        assert "warming up" in server.health and server.health[-1] == "ok", server.health
        stats = httpx.get(server.url + "/v1/stats", timeout=30).json()
        assert stats["warm"] and stats["compiles_after_warmup"] == 0, stats
        assert restored(server) == (2, 0)
        got = httpx.get(server.url + "/v1/segments/doc-a", timeout=30)
        assert got.status_code == 200 and got.json()["tier"] in ("hbm", "host"), got.text
        made = httpx.post(server.url + "/v1/segments", json={"id": "faq", "text": "Returns within 30 days."},
                          timeout=120)
        assert made.status_code in (200, 201), made.text
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log[-3000:]
    assert_quiet(log)

    server = Serve(tmp_path, env, "--snapshot-dir", "./kv", "--no-warmup")  # (warm-up checked above)
    try:
        assert restored(server) == (3, 0)  # the final snapshot on SIGTERM holds 'faq'
        for sid in ("doc-a", "doc-b", "faq"):
            got = httpx.get(server.url + f"/v1/segments/{sid}", timeout=30)
            assert got.status_code == 200 and got.json()["tier"] in ("hbm", "host"), (sid, got.text)
        out = httpx.post(server.url + "/v1/completions", timeout=120,
                         json={"prompt": " Q: returns? A:", "segments": ["faq"], "max_tokens": 2})
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log[-3000:]
    assert_quiet(log)


def restored(server) -> tuple[int, int]:
    """(segments whose KV came from the snapshot, segments recomputed) at the server's start."""
    snap = httpx.get(server.url + "/v1/stats", timeout=30).json()["snapshot"]
    return snap["restored_hbm"] + snap["restored_host"], snap["recomputed"]


def one_error_line(result, *expected: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_missing_model_folder_is_one_line(tmp_path, env):
    r = inferscale(tmp_path, env, "serve", "--model", "./does-not-exist")
    assert r.returncode == 2
    one_error_line(r, str(tmp_path / "does-not-exist"), "--model")
    debug = inferscale(tmp_path, env, "serve", "--model", "./does-not-exist", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


def test_garbage_registry_is_one_line(tmp_path, env):
    write_corpus(tmp_path / "corpus.jsonl", DOCS)
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "registry.sqlite3").write_bytes(b"this is not a database" * 100)
    r = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv")
    assert r.returncode == 1
    one_error_line(r, str(tmp_path / "kv"))


def test_corrupt_snapshot_is_one_line(tmp_path, env):
    write_corpus(tmp_path / "corpus.jsonl", DOCS)
    first = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv")
    assert first.returncode == 0, first.stderr[-3000:]
    damaged = 0
    for root, _, files in os.walk(tmp_path / "kv" / "snapshots"):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:  # the same length, other bytes: checksums fail
                size = os.path.getsize(path)
                f.write(b"\xff" * size)
            damaged += 1
    assert damaged
    r = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv")
    assert r.returncode == 1, (r.stdout, r.stderr[-3000:])
    one_error_line(r, "snapshot")


def test_tensor_parallel_past_the_devices_is_one_line(tmp_path, env):
    write_corpus(tmp_path / "corpus.jsonl", DOCS)
    r = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv", "--tensor-parallel", "2")
    assert r.returncode == 2
    one_error_line(r, "tensor_parallel=2", "1 device")


def test_serve_over_two_processes_answers_as_one(tmp_path, env):
    """``serve --coordinator ... --num-processes 2 --process-id I --tensor-parallel 2`` as two users'
    shells would start it: process 0 serves, process 1 follows; a greedy completion equals a
    one-process server's, and SIGTERM to process 0 ends both."""
    coord = f"127.0.0.1:{free_port()}"
    common = ["--coordinator", coord, "--num-processes", "2", "--tensor-parallel", "2", "--no-warmup"]
    env1 = dict(env)
    env1.pop("XLA_FLAGS", None)
    follower = subprocess.Popen([INFERSCALE, "serve", *common, "--process-id", "1", "--port", str(free_port())],
                                cwd=tmp_path, env=env1, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    body = {"prompt": "The kettle", "max_tokens": 8, "temperature": 0}
    try:
        leader = Serve(tmp_path, env1, *common, "--process-id", "0")
        try:
            two = httpx.post(leader.url + "/v1/completions", json=body, timeout=120).json()
        finally:
            log = leader.stop()
        assert leader.proc.returncode == 0, log[-3000:]
        assert follower.wait(timeout=120) == 0, follower.stderr.read()[-3000:]
    finally:
        follower.kill()
    single = Serve(tmp_path, env1, "--no-warmup")
    try:
        one = httpx.post(single.url + "/v1/completions", json=body, timeout=120).json()
    finally:
        single.stop()
    assert two["usage"]["completion_tokens"] == one["usage"]["completion_tokens"] == 8
    assert two["choices"][0]["text"] == one["choices"][0]["text"], (two, one)
