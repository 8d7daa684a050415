"""GPU benchmark of the step's sampler: ``sampling.sample_tokens`` at the engine's row counts, by draw.

Usage (from the repository root)::

    python bench/kernels/sampler.py                     # H200 / H100: ~1 minute
    python bench/kernels/sampler.py --rows 64,256
    python bench/kernels/sampler.py --smoke --out /tmp/s  # tiny shapes on the CPU

What one engine step runs after its LM head (``inferscale_jax/runner.py``'s ``_sample_rows``): the log-softmax of
the rows' float32 logits ``[R, V]`` (V = 128256, Llama-3's vocabulary), the greedy argmax, a draw for the sampled
rows, the chosen token's log-prob; no top-k / top-p rows (``filtered=False``: the engine's variant without the
vocabulary sort) and no log-probs asked.  Two row mixes: ``greedy`` (every row at temperature 0: the served
benchmark's requests) and ``sampled`` (every row at 0.8).  Two draws (``INFERSCALE_SAMPLER``): ``gumbel``
(``jax.random.categorical``: threefry bits and two logs for every row and vocabulary entry, computed for greedy
rows too when a row of the batch samples: no data-dependent branch) and ``cdf`` (``sampling._draw_by_cdf``: one uniform a row,
block sums of the probabilities, the block and then the token the uniform falls in); for the greedy rows also
``none`` (``sampled=False``: the argmax and log-probs alone, the engine's model step since the draw moved to its
own executable for steps with a drawing row).  Floor: reading the logits
once at the run's read ceiling.  Greedy rows' tokens are checked equal between the draws.  Timing as
``bench/kernels/kernels.py`` (R input sets in one executable, median) and the GPU's kernel time of the same
executable.  Writes ``sampler.md`` and ``sampler.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
from common import start_kernel_bench  # noqa: E402
from kernels import time_calls_and_device  # noqa: E402
from report import FAILURES, finish, log, log_timed, plot_forms_by_rows, table  # noqa: E402

from inferscale_jax.sampling import SAMPLER_DRAWS, request_key, sample_tokens  # noqa: E402

SHAPES = {"full": dict(vocab=128256, reps=8), "smoke": dict(vocab=1000, reps=2)}
RESULTS = []  # (mix, rows, draw, us, device us, floor us)


def _case(mix: str, n: int, cfg, args, key) -> None:
    v = cfg["vocab"]
    temp = jnp.full((n,), 0.0 if mix == "greedy" else 0.8, jnp.float32)
    top_k, top_p = jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.float32)
    keys = jnp.asarray(np.stack([request_key(i) for i in range(n)]))
    inputs = [(jax.random.normal(jax.random.fold_in(key, r), (n, v), jnp.float32) * 3,
               jnp.full((n,), r, jnp.int32)) for r in range(cfg["reps"])]
    floor = n * v * 4 / args.ceiling
    first = None
    # ("none": the model step's own sampler since the draw left it, runner.py - the argmax and log-probs alone;
    # greedy rows only, as the engine runs it)
    for draw in SAMPLER_DRAWS + (("none",) if mix == "greedy" else ()):
        def call(temp, top_k, top_p, keys, logits, steps, draw=draw):
            return sample_tokens(logits, temp, top_k, top_p, keys, steps, 0, None, False, None,
                                 draw="gumbel" if draw == "none" else draw, sampled=draw != "none")[:2]
        try:
            t, outs, t_dev, kt = time_calls_and_device(call, (temp, top_k, top_p, keys), inputs, cfg["reps"])
        except Exception as err:  # noqa: BLE001 - a failing draw is reported, the others still run
            log(f"  {mix} R={n} {draw}: failed ({type(err).__name__}: {str(err)[:200]})")
            FAILURES.append(f"{mix} R={n} {draw}: {type(err).__name__}")
            continue
        toks = np.asarray(outs[0][0])
        if mix == "greedy":  # the argmax either way
            if first is None:
                first = toks
            elif not np.array_equal(toks, first):
                log(f"  check {mix} R={n} {draw}: FAIL (greedy tokens differ from gumbel's)")
                FAILURES.append(f"{mix} R={n} {draw}: greedy tokens differ")
            else:
                log(f"  check {mix} R={n} {draw}: greedy tokens equal")
        log_timed(f"{mix} R={n} {draw}", t, t_dev, floor, kt, width=36, top=3)
        RESULTS.append((mix, n, draw, t * 1e6, t_dev * 1e6, floor * 1e6))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the harness only")
    ap.add_argument("--rows", default="1,64,256")
    args = ap.parse_args()
    cfg = SHAPES["smoke" if args.smoke else "full"]
    t0 = start_kernel_bench(args, log)
    key = jax.random.PRNGKey(0)
    for n in [int(r) for r in args.rows.split(",")]:
        for mix in ("greedy", "sampled"):
            _case(mix, n, cfg, args, jax.random.fold_in(key, n))
    table("The step's sampler by draw (us; device: the GPU's kernel time)",
          ["rows", "mix", "draw", "call us", "device us", "floor us", "device x floor"],
          [(n, m, d, f"{t:.1f}", f"{td:.1f}", f"{fl:.1f}", f"{td / fl:.2f}") for m, n, d, t, td, fl in RESULTS])
    plot_forms_by_rows(RESULTS, args.out, "sampler.png", "rows", lambda r: r[4] / r[5])
    finish(args.out, "sampler.md", "The step's sampler by draw", t0, ROOT,
           [f"read ceiling {args.ceiling / 1e12:.2f} TB/s", f"vocabulary {cfg['vocab']}"])


if __name__ == "__main__":
    main()
