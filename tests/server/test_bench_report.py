"""bench/lib/report.py's code_version: every benchmark report names the commit it measured."""

import os
import shutil
import subprocess
import sys

from tests.support import REPO

BENCH = os.path.join(REPO, "bench", "lib")
sys.path.insert(0, BENCH)

import report  # noqa: E402  (bench/lib/report.py)


def test_code_version_takes_the_commit_from_the_environment(monkeypatch):
    monkeypatch.setenv("INFERSCALE_COMMIT", "abc1234")  # the device machine's tree has no .git
    assert report.code_version() == "abc1234"


def test_code_version_reads_the_checkout(monkeypatch):
    monkeypatch.delenv("INFERSCALE_COMMIT", raising=False)
    root = os.path.dirname(BENCH)
    version = report.code_version()
    git = shutil.which("git") and subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True)
    if not git or git.returncode:  # no git or no checkout: said so, not guessed
        assert version == "unknown"
        return
    head = git.stdout.strip()
    assert version in (head, head + " +changes")


def test_reports_name_the_switches_set_in_the_environment(monkeypatch):
    """An A/B run sets its switch outside the command line: the report's header names it (not the commit or
    the cache folder, named elsewhere), and says nothing when none is set."""
    for key in [k for k in os.environ if k.startswith("INFERSCALE_")]:
        monkeypatch.delenv(key)
    assert report.switch_lines() == []
    monkeypatch.setenv("INFERSCALE_MIXED_MERGE", "jnp")
    monkeypatch.setenv("INFERSCALE_MIXED_SHARED", "sp=3")
    monkeypatch.setenv("INFERSCALE_COMMIT", "abc1234")
    monkeypatch.setenv("INFERSCALE_CACHE", "/tmp/cache")
    monkeypatch.setenv("INFERSCALE_MIXED_DECODE", "")  # (set empty: the default)
    assert report.switch_lines() == ["- switches: `INFERSCALE_MIXED_MERGE=jnp`, `INFERSCALE_MIXED_SHARED=sp=3`"]
