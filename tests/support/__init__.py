"""Helpers shared by the tests (tiny engines, server and child-process drivers), imported as
``tests.support.<module>``.  The ``*_child.py`` scripts run as files in child processes: each puts
the repository root on ``sys.path`` itself."""

import os
import subprocess
import sys

SUPPORT = os.path.dirname(os.path.abspath(__file__))  # this folder: where the child scripts are
REPO = os.path.dirname(os.path.dirname(SUPPORT))  # the repository root


def same_compiler(env=None) -> dict:
    """``env`` (default: this process's) for a child whose numbers a test compares with its own to ~1e-6: with the
    XLA flag the test processes compile with on a CPU-only machine (``INFERSCALE_TEST_XLA_FLAGS``, set by
    tests/conftest.py).  Float32 log-probs of the same program differ by a few 1e-6 between XLA's optimization
    levels (fused multiply-adds, reduction order); other children keep XLA's default, as users' processes do."""
    env = dict(os.environ if env is None else env)
    extra = os.environ.get("INFERSCALE_TEST_XLA_FLAGS", "")
    if extra:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra).strip()
    return env


def bench_smoke(script: str, out_dir, report: str, *args: str) -> tuple[str, str]:
    """Run ``bench/<script> --smoke --out out_dir [args]`` as a user would; assert it exits 0 and return (its
    stdout, the markdown ``report`` it wrote)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", *script.split("/")), "--smoke", "--out",
                           str(out_dir), *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, (out_dir / report).read_text()
