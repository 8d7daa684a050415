"""The ``inferscale`` command as a user types it: the installed console script, run from a fresh
folder with relative paths and the defaults (the embedded default model, ``--dtype auto``).

- ``precompute corpus.jsonl --snapshot-dir ./kv`` works, twice (the second run skips the
  unchanged documents, warms nothing up and writes no snapshot), then ``serve --snapshot-dir ./kv``
  restores those segments from the snapshot (same default dtype as ``precompute``), names the
  snapshot's tenant that no key reaches, answers to both default model names, logs no request
  line by default and one per request with ``--log-requests``; a segment registered over HTTP
  survives a SIGTERM and a restart, and no command prints a traceback or third-party noise;
- SIGTERM during a (cold) warm-up stops it after the compiles in flight: exit 0, promptly;
- known failures print one ``error: ...`` line and exit non-zero (``--debug``: the traceback),
  before any model loads: a bad or taken port, a file given as ``--snapshot-dir``, a missing
  corpus (no snapshot folder is created) or key file; ``-h`` and ``--version`` import no jax.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.server_util import cache_dir, free_port

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
    assert "warm-up:" in first.stderr, first.stderr[-3000:]
    steps = sorted(os.listdir(tmp_path / "kv" / "snapshots"))
    assert steps
    second = inferscale(tmp_path, env, "precompute", "corpus.jsonl", "--snapshot-dir", "./kv")
    assert second.returncode == 0, second.stderr[-3000:]
    assert_quiet(second.stderr)
    assert "0 stored, 2 skipped unchanged" in second.stdout, second.stdout
    # nothing to do: no warm-up, no new snapshot
    assert "warm-up" not in second.stderr and "nothing to compute" in second.stderr, second.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "kv" / "snapshots")) == steps
    write_corpus(tmp_path / "acme.jsonl", {"shipping": "We ship to Canada within 5 days."})
    acme = inferscale(tmp_path, env, "precompute", "acme.jsonl", "--snapshot-dir", "./kv", "--tenant", "acme")
    assert acme.returncode == 0 and "1 stored" in acme.stdout, acme.stderr[-3000:]
    assert "--api-keys" in acme.stderr and '"acme"' in acme.stderr, acme.stderr[-3000:]

    # serve, with the same defaults, restores what precompute stored; a segment registered over HTTP
    # survives SIGTERM + restart, its KV restored from the snapshot (not recomputed)
    server = Serve(tmp_path, env, "--snapshot-dir", "./kv")
    try:
        # serve compiles every step bucket before it says ok (Engine.warmup)
        assert "warming up" in server.health and server.health[-1] == "ok", server.health
        stats = httpx.get(server.url + "/v1/stats", timeout=30).json()
        assert stats["warm"] and stats["compiles_after_warmup"] == 0, stats
        assert restored(server) == (3, 0)
        models = httpx.get(server.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]][:1] == ["inferscale-default"], models
        for name in ("inferscale-default", "inferscale"):  # the docs' examples send "inferscale"
            out = httpx.post(server.url + "/v1/completions", timeout=120,
                             json={"model": name, "prompt": " Q: warranty? A:", "segments": ["doc-a"], "max_tokens": 2})
            assert out.status_code == 200 and out.json()["model"] == "inferscale-default", out.text
        got = httpx.get(server.url + "/v1/segments/doc-a", timeout=30)
        assert got.status_code == 200 and got.json()["tier"] in ("hbm", "host"), got.text
        made = httpx.post(server.url + "/v1/segments", json={"id": "faq", "text": "Returns within 30 days."},
                          timeout=120)
        assert made.status_code in (200, 201), made.text
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log[-3000:]
    assert_quiet(log)
    # startup speaks: the bound address, the tenant no key reaches and the key file it needs
    assert f"listening on {server.url}" in log and "warm-up (small step buckets)" in log, log[-3000:]
    assert "tenant 'acme' (1 segment)" in log and '{"<a secret key for acme>": "acme"}' in log, log[-3000:]
    assert "compiling step for bucket" not in log  # (DEBUG)
    assert not request_lines(log)  # no per-request line by default (--log-requests)

    server = Serve(tmp_path, env, "--snapshot-dir", "./kv", "--no-warmup", "--log-requests",  # (warm-up above)
                   "--served-model-name", "kettle-bot", "inferscale")
    try:
        assert restored(server) == (4, 0)  # the final snapshot on SIGTERM holds 'faq'
        models = httpx.get(server.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["kettle-bot", "inferscale"], models
        for sid in ("doc-a", "doc-b", "faq"):
            got = httpx.get(server.url + f"/v1/segments/{sid}", timeout=30)
            assert got.status_code == 200 and got.json()["tier"] in ("hbm", "host"), (sid, got.text)
        out = httpx.post(server.url + "/v1/completions", timeout=120,
                         json={"prompt": " Q: returns? A:", "segments": ["faq"], "max_tokens": 2})
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        rid = out.json()["id"]
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log[-3000:]
    assert_quiet(log)
    lines = request_lines(log)
    assert [ln["id"] for ln in lines if ln.get("id") == rid] == [rid], lines  # one line for the request
    assert not any(ln.get("endpoint") == "/health" for ln in lines)  # probes are never logged
    assert " inferscale.request " not in log  # the engine's own line stays off: one line per request


def request_lines(log: str) -> list[dict]:
    """The JSON per-request lines of a server log (logger inferscale.server)."""
    out = []
    for line in log.splitlines():
        _, sep, rest = line.partition(" inferscale.server ")
        if sep and rest.startswith("{"):
            out.append(json.loads(rest))
    return out


def test_sigterm_during_a_cold_warmup_stops_it(tmp_path, env):
    """The warm-up compiles on a thread pool; SIGTERM stops it after the compiles in flight (an
    empty compile cache, so each compile takes seconds), and the server exits 0."""
    cold = dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "empty-compile-cache"))
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([INFERSCALE, "serve", "--port", str(port)], cwd=tmp_path, env=cold, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, status = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None and status != "warming up":
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("status")
            except httpx.HTTPError:
                time.sleep(0.1)
        assert status == "warming up", log_path.read_text()[-3000:]
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text()
    assert rc == 0, text[-3000:]
    assert "(stopped)" in text, text[-3000:]  # Engine.warmup's line: it returned early
    assert took < 60, (took, text[-3000:])  # at most the compiles in flight (seconds each), not the whole set


def test_bad_values_fail_fast_with_one_line(tmp_path, env):
    r = inferscale(tmp_path, env, "serve", "--port", "99999", timeout=60)
    assert r.returncode == 2
    one_error_line(r, "--port", "99999", "1-65535")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = inferscale(tmp_path, env, "serve", "--port", str(port), timeout=60)
        took = time.monotonic() - t0
    assert r.returncode == 1
    one_error_line(r, f"127.0.0.1:{port}", "--port")
    assert took < 15, took  # before any model loads (about 0.2 s on an idle machine)
    (tmp_path / "a-file").write_text("x")
    r = inferscale(tmp_path, env, "serve", "--snapshot-dir", "a-file", timeout=60)
    assert r.returncode == 2
    one_error_line(r, str(tmp_path / "a-file"), "not a folder")
    r = inferscale(tmp_path, env, "serve", "--api-keys", "keys.json", timeout=60)
    assert r.returncode == 2
    one_error_line(r, str(tmp_path / "keys.json"), "does not exist")
    r = inferscale(tmp_path, env, "serve", "--chat-template", "missing.jinja", timeout=60)
    assert r.returncode == 2
    one_error_line(r, str(tmp_path / "missing.jinja"), "--chat-template")
    r = inferscale(tmp_path, env, "serve", "--decode-steps", "65", timeout=60)
    assert r.returncode == 2
    one_error_line(r, "--decode-steps", "65", "<= 64")
    r = inferscale(tmp_path, env, "serve", "--first-runs", "later", timeout=60)
    assert r.returncode == 2
    one_error_line(r, "--first-runs", "later", "idle", "now")
    r = inferscale(tmp_path, env, "precompute", "missing.jsonl", "--snapshot-dir", "./kv", timeout=60)
    assert r.returncode == 2
    one_error_line(r, str(tmp_path / "missing.jsonl"))
    assert not (tmp_path / "kv").exists()


def test_help_and_version_import_no_jax(tmp_path, env):
    from inferscale_jax import __version__

    r = inferscale(tmp_path, env, "--version", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"inferscale {__version__}", r
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)
    for args in (["-h"], ["serve", "-h"], ["--version"]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "inferscale_cli", *args], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time")}
        assert not imported & {"jax", "transformers", "torch", "uvicorn", "fastapi"}, sorted(imported)


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


def test_corrupt_snapshot_is_recomputed_and_logged(tmp_path, env):
    """Every snapshot file overwritten (same length): the next run restores none of it - the
    segments are recomputed from the registry's tokens - and says so in a logged integrity error
    naming the snapshot, without a traceback (docs/architecture.md, "Damaged stored KV")."""
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
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    errors = [ln for ln in r.stderr.splitlines() if "integrity error: snapshot" in ln]
    assert errors and str(tmp_path / "kv" / "snapshots") in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "2 skipped unchanged" in r.stdout, (r.stdout, r.stderr[-3000:])


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


def test_snapshot_warning_ends_with_the_matching_flags():
    """A snapshot of another engine: the engine's warning (registry.Identity.mismatch's words)
    gets the flags of this command that match the snapshot."""
    import logging

    from inferscale_cli.main import SnapshotHint, snapshot_fix
    from inferscale_jax.registry import Identity

    mine = Identity("fp", "model", "float32", 16)
    assert snapshot_fix(mine.mismatch(Identity("fp", "model", "bfloat16/kv=int8", 16))) == \
        "--dtype bfloat16 --kv-dtype int8"
    assert snapshot_fix(mine.mismatch(Identity("fp", "model", "float32", 32))) == "--page-size 32"
    assert snapshot_fix("something else") is None
    record = logging.LogRecord("inferscale.snapshot", logging.WARNING, __file__, 1,
                               "snapshot %s was written by another engine: %s; starting without its KV",
                               ("/kv/snapshots/3", mine.mismatch(Identity("fp", "model", "bfloat16", 16))), None)
    assert SnapshotHint().filter(record)
    assert record.getMessage().endswith("Fix: run with --dtype bfloat16 (as the command that wrote it), or give "
                                        "another --snapshot-dir"), record.getMessage()


def test_a_malformed_key_file_stops_the_starting_core(tmp_path, env):
    """The engine core process is spawned before the key file is parsed (its start overlaps the
    API process's imports): a file that does not parse is still one error line naming it, exit 2
    within seconds, and the core is gone (an orphan would hold the pipes open past the timeout)."""
    (tmp_path / "keys.json").write_text("{not json")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    t0 = time.monotonic()
    r = inferscale(tmp_path, env, "serve", "--port", str(port), "--api-keys", "keys.json", timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(tmp_path / "keys.json") in last and "valid JSON" in last, last
    assert took < 45, took
