"""`inferscale demo` end to end in a subprocess, on the embedded default model (built fresh)."""

import os
import subprocess
import sys


def test_demo_reports_identical_outputs(tmp_path):
    env = {**os.environ, "INFERSCALE_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "inferscale_jax.cli", "demo", "--max-tokens", "8"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all outputs identical to full prefill: yes" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("Q: ")]
    assert len(rows) == 5 and all(line.split()[-1] == "yes" for line in rows)
    cached = [int(line.split()[-2]) for line in rows]
    assert min(cached) > 800  # the knowledge base (906 tokens) was injected, not recomputed
