"""What the benchmarks that run ``inferscale serve`` as a subprocess share (``serve.py``,
``soak.py``): a free loopback port and a graceful stop."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    """SIGTERM (the server's final snapshot runs), then SIGKILL if it is not gone in ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
