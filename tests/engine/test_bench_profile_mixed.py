"""bench/tools/profile_mixed.py (Nsight Compute's target for the mixed step's attention) runs as documented on the
CPU (``--quick``: interpret mode) and launches the engine's call: its output equals the jnp references'."""

import re
import subprocess
import sys

import pytest

from tests.support.server_util import REPO


@pytest.mark.parametrize("step", ["spread", "c64q3"])
def test_profile_mixed_launches_the_engines_attention(step):
    run = subprocess.run([sys.executable, "bench/tools/profile_mixed.py", "--quick", "--step", step, "--launches", "2",
                          "--check"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(rf"^{step}: 2 launches, \d+ tokens, .* finite True", run.stdout, re.M), run.stdout
    err = float(re.search(r"rel err ([\d.e+-]+)", run.stdout).group(1))
    assert err < 2e-2, run.stdout  # (bf16 inputs; the kernels accumulate in fp32)
