"""Does the kernel harness's clock measure the kernels?  One kernel call timed four ways.

Usage (from the repository root)::

    python bench/tools/timing_check.py                        # H100 / H200: ~1-2 minutes
    python bench/tools/timing_check.py --smoke --out /tmp/tc  # tiny shapes on the CPU: the harness only

The kernel benchmarks (``bench/kernels/kernels.py``'s ``time_calls``: R input sets in one executable,
host clock around each blocking call, median of reps) gave the mixed step's kernels 2-3.5x the time the
graph-mode profile of the engine loop gives the same kernels (bench/NOTES.md, runs AU and the session-37
check of ``shared_ceiling.py``).  If a fixed cost rides on every harness call, the harness's ratios between
forms are compressed toward 1 and its decisions are wrong.  This times the same calls of
``bench/kernels/shared_ceiling.py``'s steps (the engine's shared part; the dense cuDNN and Mosaic GPU forms)

* ``harness``: ``time_calls`` as the benchmarks used it before run AV, right after compiling (its warm-up,
  ``kernels.WARM_S``, off for this column);
* ``after spin``: the same after ~2 s of back-to-back matmuls (the SM clock boosted, if it was not);
* ``chained``: N calls in one ``lax.fori_loop``, each call's query depending on the last call's output (so the
  calls are not merged; what does not depend on the query, e.g. the engine's row layout, XLA may hoist out of
  the loop, and each iteration adds the small add that carries the dependency), host clock / N;
* ``device``: the profiler's kernel durations of the same calls (``kernels.device_time_calls``), summed
  per call: what the GPU spent, no dispatch or sync time.

and the SM clock (``nvidia-smi``) before and after the spin.  Writes ``timing_check.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
import kernels  # noqa: E402
from kernels import _median, device_time_calls, time_calls  # noqa: E402
from report import finish, log, table  # noqa: E402
from shared_ceiling import FULL, SMOKE, folded_q, padded_q, step_case  # noqa: E402
from pallas_kernels.cascade_attention import grouped_shared_prefix_attention  # noqa: E402

ROWS: list = []  # [step, form, harness us, after spin us, chained us, device us]


def sm_clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except Exception:  # noqa: BLE001 - no nvidia-smi (the CPU): no clock
        return "n/a"


def spin(seconds: float) -> None:
    """Back-to-back matmuls for ``seconds`` (the GPU's clock boosts under sustained load)."""
    x = jnp.ones((2048, 2048), jnp.bfloat16)
    f = jax.jit(lambda a: [a := (a @ a * 1e-3).astype(jnp.bfloat16) for _ in range(8)][-1])
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = f(x)
    x.block_until_ready()


def chained(fn, inputs, n: int, reps: int) -> float:
    """Seconds per call of ``n`` dependent calls in one fori_loop (the first input is the carried one)."""
    def loop(first, *rest):
        def body(_, x):
            out = fn(x, *rest)
            return (x.astype(jnp.float32) + 0.0 * out.astype(jnp.float32).reshape(x.shape)).astype(x.dtype)
        return jax.lax.fori_loop(0, n, body, first)
    f = jax.jit(loop)
    jax.block_until_ready(f(*inputs))
    return _median(lambda: f(*inputs), reps) / n


def measure(step: str, form: str, fn, sets, n_chain: int, reps: int, smoke: bool) -> None:
    """``fn(first, *rest)`` over R input sets; the four timings of one form."""
    warm, kernels.WARM_S = kernels.WARM_S, 0.0  # (the harness before run AV: no warm-up)
    try:
        t_h, _ = time_calls(fn, (), sets, reps)
        if not smoke:
            spin(2.0)
        t_s, _ = time_calls(fn, (), sets, reps)
    finally:
        kernels.WARM_S = warm
    t_c = chained(fn, sets[0], n_chain, reps)
    t_d, kt = device_time_calls(fn, (), sets, reps)
    top = ", ".join(f"{r[1][:40]} {r[2]:.1f}" for r in kt[:3])
    log(f"  {form}: harness {t_h * 1e6:.1f} us, after spin {t_s * 1e6:.1f}, chained {t_c * 1e6:.1f}, "
        f"device {t_d * 1e6:.1f} ({top})")
    ROWS.append([step, form, f"{t_h * 1e6:.1f}", f"{t_s * 1e6:.1f}", f"{t_c * 1e6:.1f}",
                 "" if math.isnan(t_d) else f"{t_d * 1e6:.1f}", top])


def run_step(args, cfg, name, decode, questions):
    sets, group, slot, count, t = step_case(cfg, decode, questions)
    hq, hkv, d, seg, g = (cfg[k] for k in ("hq", "hkv", "d", "seg", "groups"))
    scale = 1.0 / math.sqrt(d)
    row_group, glens = jnp.asarray(group), jnp.full((g,), seg, jnp.int32)
    log(f"{name}: {t} tokens in {g} groups; SM clock {sm_clock()}")

    def engine(q, kp, vp, pages):
        return grouped_shared_prefix_attention(q, kp, vp, pages, glens, row_group, real_groups=g, real_rows=t)[0]

    measure(name, "engine", engine, [(x["q"], x["kp"], x["vp"], x["pages"]) for x in sets], args.chain, cfg["reps"],
            args.smoke)
    if args.smoke:
        return
    qlen = jnp.asarray(count)

    def cudnn(qg, k, v):
        return jax.nn.dot_product_attention(qg, k, v, scale=scale, query_seq_lengths=qlen, implementation="cudnn")

    width = int(count.max())
    measure(name, "cudnn", cudnn, [(padded_q(x["q"], group, slot, count, width), x["k"], x["v"]) for x in sets],
            args.chain, cfg["reps"], args.smoke)
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    tuning = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
    folded = [folded_q((x["q"].astype(jnp.float32) * scale).astype(jnp.float16), group, slot, count, hkv, 128)[0]
              for x in sets]
    measure(name, "mosaic f16 bq64 bkv64 c2", lambda qf, k, v: attention_mgpu.attention(qf, k, v, tuning),
            [(f, x["k"].astype(jnp.float16), x["v"].astype(jnp.float16)) for f, x in zip(folded, sets)],
            args.chain, cfg["reps"], args.smoke)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU, interpret mode): the harness only")
    ap.add_argument("--chain", type=int, default=20, help="calls in the chained form's loop")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else FULL
    if args.smoke:
        args.chain = 2
    t0 = time.time()
    log(f"devices: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
        f"SM clock {sm_clock()}")
    steps = cfg["steps"] if args.smoke else {k: v for k, v in cfg["steps"].items() if not k.startswith("cohort")}
    for name, (decode, questions) in steps.items():
        run_step(args, cfg, name, decode, questions)
    log(f"SM clock at the end: {sm_clock()}")
    table("One call, four clocks (us per call)",
          ["step", "form", "harness", "after a 2 s spin", f"chained x{args.chain}", "device (profiler)",
           "top kernels (us per call)"], ROWS)
    finish(args.out, "timing_check.md", "Does the kernel harness's clock measure the kernels?", t0, ROOT)


if __name__ == "__main__":
    main()
