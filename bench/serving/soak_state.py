"""The soak's bookkeeping (``soak.py``): clocks, each segment id's versions over time (what a
request racing a change may have seen), request results, and the server process it restarts."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time

from report import log  # bench/lib/report.py (soak.py puts bench/lib/ on sys.path)
from servers import free_port, stop_process  # bench/serving/servers.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def now() -> float:
    return time.monotonic()


_WALL = time.time() - time.monotonic()


def wall(t: float | None) -> str:
    """A ``now()`` time as the server log writes its clock (to find the lines of a failure)."""
    if t is None:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(t + _WALL)) + f",{int((t + _WALL) % 1 * 1000):03d}"


@dataclasses.dataclass
class Version:
    """One content of a segment id, between the request that created it and the one that ended it."""
    content: int  # index into TEXTS
    sent: float  # the creating request was sent
    acked: float  # ... and acknowledged
    present_from: float  # certainly present since (an update keeps its predecessor's)
    end_sent: float | None = None  # the deleting / replacing request was sent (recorded at its answer)
    end_acked: float | None = None
    # a deleting / replacing request in flight since (set before it is sent: a completion answered
    # before the churner reads the delete's answer must not count the segment as present throughout)
    end_pending: float | None = None


@dataclasses.dataclass
class Seg:
    sid: str
    owner: str  # the tenant whose key changes it (ADMIN for public segments)
    public: bool
    stable: bool
    versions: list = dataclasses.field(default_factory=list)
    unsure: list = dataclasses.field(default_factory=list)  # [start, end] where its state is unknown

    def current(self) -> Version | None:
        v = self.versions[-1] if self.versions else None
        return v if v is not None and v.end_sent is None else None

    def certain(self) -> bool:
        return not self.unsure or self.unsure[-1][1] is not None

    def overlaps_unsure(self, t0: float, t1: float) -> bool:
        return any(a <= t1 and (b is None or b >= t0) for a, b in self.unsure)

    def candidates(self, t0: float, t1: float) -> list[int]:
        """Contents the server may have used for a request in flight during [t0, t1]."""
        return sorted({v.content for v in self.versions
                       if v.sent <= t1 and (v.end_acked is None or v.end_acked >= t0)})

    def present_throughout(self, t0: float, t1: float) -> bool:
        def end(v):
            return v.end_sent if v.end_sent is not None else v.end_pending
        return any(v.present_from <= t0 and (end(v) is None or end(v) >= t1) for v in self.versions)

    def history(self, t0: float, t1: float) -> str:
        """The versions near [t0, t1], wall-clock (failure messages)."""
        near = [v for v in self.versions if v.sent <= t1 + 3 and (v.end_acked is None or v.end_acked >= t0 - 3)]
        return f"{self.owner}/{self.sid}: " + "; ".join(
            f"text {v.content} sent {wall(v.sent)} acked {wall(v.acked)} end sent {wall(v.end_sent)} "
            f"acked {wall(v.end_acked)}" for v in near)


@dataclasses.dataclass
class Result:
    status: int
    body: object = None
    text: str | None = None  # the whole answer (None: not complete)
    disconnected: bool = False
    retry_after: str | None = None


class Server:
    """``inferscale serve`` in a subprocess; each ``start()`` (a new *life*) keeps the port and the
    snapshot folder."""

    def __init__(self, args, workdir: str, keys: dict):
        self.args, self.workdir = args, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = os.path.join(workdir, "keys.json")
        with open(self.keys, "w") as f:
            json.dump(keys, f)
        self.snapshot_dir = os.path.join(workdir, "snapshots")
        self.life = 0
        self.proc = None
        self.logs: list[str] = []

    def start(self) -> None:
        self.life += 1
        path = os.path.join(self.workdir, f"server-{self.life}.log")
        self.logs.append(path)
        a = self.args
        cmd = [sys.executable, "-m", "inferscale_cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-keys", self.keys, "--snapshot-dir", self.snapshot_dir, "--snapshot-interval",
               str(a.snapshot_interval), "--dtype", a.dtype, "--page-size", str(a.page_size), "--hbm-pages",
               str(a.hbm_pages), "--model-name", "soak"] + (["--host-pages", str(a.host_pages)] if a.host_pages else [])
        with open(path, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # kill9 takes its engine core process too
        log(f"[soak] server life {self.life}: pid {self.proc.pid}, {shlex.join(cmd[1:])}")

    def rss_kb(self) -> int | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                return next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), None)
        except OSError:  # the process is gone
            return None

    def kill9(self) -> None:
        """SIGKILL to the server's whole process group (the API server and its engine core
        process): a crash, not a shutdown (the core alone would take a final snapshot)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(60)

    def stop(self) -> None:
        stop_process(self.proc)

    def error_lines(self) -> list[str]:
        out = []
        for path in self.logs:
            with open(path, errors="replace") as f:
                out += [f"{os.path.basename(path)}: {ln.rstrip()}" for ln in f if " ERROR " in ln]
        return out
