"""Helpers shared by the tests (tiny engines, server and child-process drivers), imported as
``tests.support.<module>``.  The ``*_child.py`` scripts run as files in child processes: each puts
the repository root on ``sys.path`` itself."""

import os
import subprocess
import sys

SUPPORT = os.path.dirname(os.path.abspath(__file__))  # this folder: where the child scripts are
REPO = os.path.dirname(os.path.dirname(SUPPORT))  # the repository root


def bench_smoke(script: str, out_dir, report: str, *args: str) -> tuple[str, str]:
    """Run ``bench/<script> --smoke --out out_dir [args]`` as a user would; assert it exits 0 and return (its
    stdout, the markdown ``report`` it wrote)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", *script.split("/")), "--smoke", "--out",
                           str(out_dir), *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, (out_dir / report).read_text()
