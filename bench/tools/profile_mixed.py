"""One layer's attention of the engine's mixed steps, launched a few times and nothing else: a target for
Nsight Compute (``bench/tools/rerun_h200.sh 45``).

    ncu --kernel-name regex:cascade_shared --launch-skip 1 --launch-count 2 -o /tmp/shared \\
        python bench/tools/profile_mixed.py --step spread

The step's inputs are ``bench/kernels/mixed_shared.py``'s (its ``step_case``: 8 segments of 4096 tokens, the
decode rows' own keys and the questions of the named step), and the call is the engine's own
(``kv_cache._attend`` with the Pallas kernels: the cascade shared part, then the ragged kernel started from
its partials).  No timing harness, no ceilings, no profiler session of JAX's: under ncu ``mixed_shared.py``
crashed (bench/NOTES.md, run BE), so this keeps to what the engine runs.  ``--quick``: tiny shapes in
interpret mode (the CPU), for its smoke test.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
from mixed_shared import FULL, SMOKE, step_case  # noqa: E402
from inferscale_jax import kv_cache  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (the CPU)")
    ap.add_argument("--step", default="spread", help="one of mixed_shared.py's steps (cohort, spread, c64, c64q3)")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="afterwards, the output against the jnp references "
                    "(kv_cache's reference path over the same inputs): its max error relative to the largest value")
    args = ap.parse_args()
    cfg = dict(SMOKE if args.quick else FULL)
    kp, vp, sets, real, flops, nbytes = step_case(cfg, *cfg["steps"][args.step])
    q, casc, _ = sets[0]
    attend = jax.jit(lambda k, v, q, meta: kv_cache._attend(q[None], k, v, None, meta, "pallas")[0])
    for _ in range(args.launches):
        out = jax.block_until_ready(attend(kp, vp, q, casc))
    got = np.asarray(out[:real], np.float32)
    print(f"{args.step}: {args.launches} launches, {real} tokens, {flops / 1e9:.1f} GFLOP, {nbytes / 2**20:.0f} MiB; "
          f"finite {bool(np.isfinite(got).all())}, mean |out| {float(np.abs(got).mean()):.4f}", flush=True)
    if args.check:  # (after the launches: nothing of it runs under the profiler's kernel filter)
        ref = np.asarray(kv_cache._attend(q[None], kp, vp, None, casc, "ref")[0][:real], np.float32)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        print(f"check against the references: rel err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
