"""The server examples of README.md and docs/living_knowledge.md run as written, in order, twice.

The code blocks are read from the markdown when the test runs (never copied here).  A block
takes part when it starts a server (a line ``inferscale serve ...``) or talks to one (it names
``localhost:PORT`` / ``127.0.0.1:PORT``); the Python-API blocks (an ``Engine`` in-process) do not.
docs/multi_host.md and docs/tpu.md are left out: their examples need several GPUs, a TPU or a
model folder.  Each port the docs name is replaced by a free loopback port, consistently.

Running the sequence, as a user in one folder (``tmp_path``) with two terminals would:

- a ``bash`` block with ``inferscale serve``: the server already on that port is stopped (SIGTERM,
  as Ctrl-C), the block's lines before it run (``pip install`` lines are skipped: no network, the
  test extra has the packages), then the serve command starts in the background and the block is
  done when ``/health`` answers 200 (the server's own readiness; on the CPU its warm-up is the
  small bucket set, so a cold start is tens of seconds);
- any other ``bash`` block runs under ``bash -euo pipefail``; it must exit 0 and print no OpenAI
  error body (``"error"``: curl exits 0 on an HTTP error);
- a ``python`` block runs in a fresh interpreter and must exit 0.

The whole sequence runs twice: the second pass restarts each server on the same folders, so the
examples must be idempotent (a segment created again would be a 409) and restores must work.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.server_util import REPO, cache_dir, free_port

DOCS = ("README.md", "docs/living_knowledge.md")
ADDRESS = re.compile(r"(localhost|127\.0\.0\.1):(\d{4,5})")
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)
STEP_TIMEOUT_S = 300  # one block, or one server's start (a cold CPU warm-up on a busy machine)


def blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of every block that starts or talks to a server, in reading order."""
    out = []
    for name in DOCS:
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            text = f.read()
        for m in BLOCK.finditer(text):
            lang, code = m.group(1), m.group(2)
            if ADDRESS.search(code) or re.search(r"^inferscale serve\b", code, re.M):
                out.append((f"{name}:{text[:m.start()].count(chr(10)) + 1}", lang, code))
    return out


def docs_ports(code: str) -> set[int]:
    return {int(p) for _, p in ADDRESS.findall(code)} | {int(p) for p in re.findall(r"--port (\d+)", code)}


class Servers:
    """The servers the docs start, by the port the docs give them."""

    def __init__(self, cwd, env, ports: dict[int, int]):
        self.cwd, self.env, self.ports = cwd, env, ports
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, line: str, where: str) -> None:
        argv = shlex.split(line.split("#")[0])
        doc_port = int(argv[argv.index("--port") + 1])
        argv[argv.index("--port") + 1] = str(self.ports[doc_port])
        self.stop(doc_port)
        log = open(self.cwd / f"serve-{doc_port}.log", "a")
        proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[doc_port] = proc
        url = f"http://127.0.0.1:{self.ports[doc_port]}/health"
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"{where}: `{line}` did not get ready (rc {proc.poll()}):\n{self.log(doc_port)}")

    def log(self, doc_port: int) -> str:
        return (self.cwd / f"serve-{doc_port}.log").read_text(errors="replace")[-3000:]

    def stop(self, doc_port: int) -> None:
        proc = self.procs.pop(doc_port, None)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"the server of port {doc_port} ignored SIGTERM:\n{self.log(doc_port)}")
        assert rc == 0, f"the server of port {doc_port} exited {rc} on SIGTERM:\n{self.log(doc_port)}"

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def servers(tmp_path, tmp_path_factory):
    examples = blocks()
    ports = {p: free_port() for _, _, code in examples for p in docs_ports(code)}
    env = dict(os.environ, INFERSCALE_CACHE=cache_dir(tmp_path_factory), JAX_PLATFORMS="cpu",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    s = Servers(tmp_path, env, ports)
    yield s
    s.kill_all()


def with_ports(code: str, ports: dict[int, int]) -> str:
    code = ADDRESS.sub(lambda m: f"{m.group(1)}:{ports[int(m.group(2))]}", code)
    return re.sub(r"--port (\d+)", lambda m: f"--port {ports[int(m.group(1))]}", code)


def run_block(servers: Servers, where: str, lang: str, code: str) -> None:
    if lang == "python":
        code = with_ports(code, servers.ports)
        r = subprocess.run([sys.executable, "-c", code], cwd=servers.cwd, env=servers.env, capture_output=True,
                           text=True, timeout=STEP_TIMEOUT_S)
        assert r.returncode == 0, f"{where}: python block failed:\n{code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return
    lines = code.replace("\\\n", " ").splitlines()
    serve = [i for i, line in enumerate(lines) if line.startswith("inferscale serve")]
    if serve:
        assert serve == [len(lines) - 1], f"{where}: a serve command ends its block (it keeps running)"
        doc_port = int(re.search(r"--port (\d+)", lines[-1]).group(1))
        servers.stop(doc_port)  # the user stops the running one before re-running the block
    body = "\n".join(line for line in lines[:len(lines) - bool(serve)] if not line.startswith("pip "))
    if body.strip():
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", with_ports(body, servers.ports)], cwd=servers.cwd,
                           env=servers.env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
        assert r.returncode == 0, f"{where}: bash block failed:\n{body}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert '"error"' not in r.stdout, f"{where}: an error answer:\n{body}\n{r.stdout[-2000:]}"
    if serve:
        servers.start(lines[-1], where)


def test_the_docs_server_examples_run_as_written_twice(servers):
    assert shutil.which("curl"), "the README's examples use curl: install it"
    examples = blocks()
    # what the docs hold today (a test that found nothing to run could not fail)
    assert sum(lang == "python" for _, lang, _ in examples) >= 4, examples
    assert sum("inferscale serve" in code for _, _, code in examples) >= 2, examples
    assert examples[0][2].splitlines()[-1].startswith("inferscale serve"), "the first example starts the server"
    for attempt in (1, 2):
        for where, lang, code in examples:
            run_block(servers, f"pass {attempt}, {where}", lang, code)
    for doc_port in list(servers.procs):
        servers.stop(doc_port)  # a graceful exit (rc 0) with the final snapshot
