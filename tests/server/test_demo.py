"""`inferscale demo` end to end in a subprocess, on the embedded default model (built fresh)."""

import os
import subprocess
import sys


def test_demo_reports_identical_outputs(tmp_path):
    env = {**os.environ, "INFERSCALE_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "inferscale_cli", "demo", "--max-tokens", "8"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all outputs identical to full prefill: yes" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("Q: ")]
    assert len(rows) == 5 and all(line.split()[-1] == "yes" for line in rows)
    # the default tokenizer adds no BOS and the warm-up question is not in the table, so every row
    # reuses exactly the knowledge base's KV (906 tokens) and computes the question
    assert "knowledge base segment 'kb': 906 tokens" in r.stdout
    assert [int(line.split()[-2]) for line in rows] == [906] * 5
    assert "cached = tokens whose KV was reused" in r.stdout
    # a progress line per phase on stderr, the compile phase named, no traceback
    progress = [line for line in r.stderr.splitlines() if line.startswith("[")]
    assert [p.split("] ")[1].split()[0] for p in progress] == ["loading", "compiling", "registering", "warming", "ready"]
    assert "Traceback" not in r.stderr
