"""What a step call's argument count costs the host, and whether stacked per-layer weights cost a copy.

Usage (from the repository root)::

    python bench/tools/call_args.py --out bench/results          # H100 / H200: ~1 minute
    python bench/tools/call_args.py --smoke --out /tmp/ca         # the CPU: the harness only

The engine calls each step's executable with the model's weights as one array per layer and kind
(~195 for Llama-3-8B: qkv, o, gate-up, down and two norms per layer) and the paged cache as one K and
one V array per layer (64, donated), and the profile of the bare loop puts 1.7-2.6 ms of host time
inside that call on the GPU machines (bench/NOTES.md, runs AH and AP) - as much as the whole pack.
Two questions decide whether stacking them (one ``[L, ...]`` array per kind) is worth building:

1. **Host time per call by argument count.**  A compiled executable of ``W`` weight arrays and ``C``
   donated cache arrays (small shapes: the call's own cost, not the device's), called back to back:
   the wall time per call while the device keeps up, for today's counts and for stacked ones.
2. **A layer's slice of a stacked weight.**  ``x @ w[i]`` for i over L layers of a stacked ``[L, K,
   N]`` bf16 weight against the same matmuls over L separate arrays (the 8B's gate-up shape): if XLA
   copies each slice before the matmul, the stacked form reads and writes every weight once more.  The
   time per pass says so; beside it, the optimized HLO's copy and slice ops (a slice the matmul reads
   in place is one too, so the count alone proves nothing) and XLA's bytes-accessed estimate.

Writes ``call_args.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]
from report import finish, log, table  # noqa: E402

COUNTS = ((195, 64), (195, 2), (9, 64), (9, 2), (1, 1))  # (weight arrays, cache arrays): today's 8B, stacked
# (the 8B: six arrays per layer and kind x 32 + embedding, final norm, lm_head; stacked: one per kind)


def call_time(num_weights: int, num_cache: int, calls: int) -> float:
    """Seconds of host time per call of an executable taking ``num_weights`` arrays and
    ``num_cache`` donated ones (each returned updated), called back to back."""
    weights = [jnp.full((8, 128), i, jnp.bfloat16) for i in range(num_weights)]
    cache = [jnp.zeros((8, 128), jnp.bfloat16) for _ in range(num_cache)]
    ints = jnp.zeros((128,), jnp.int32)

    def step(weights, cache, ints):
        s = sum(w[0, 0] for w in weights).astype(jnp.float32) + ints[0]
        return [c + s.astype(c.dtype) for c in cache], s

    exe = jax.jit(step, donate_argnums=1).lower(weights, cache, ints).compile()
    for _ in range(10):
        cache, s = exe(weights, cache, ints)
    jax.block_until_ready(s)
    t0 = time.perf_counter()
    for _ in range(calls):
        cache, s = exe(weights, cache, ints)
    host = (time.perf_counter() - t0) / calls
    jax.block_until_ready(s)
    return host


def stacked_matmuls(layers: int, m: int, k: int, n: int, reps: int) -> list[list]:
    """(form, ms per pass, copies in the optimized HLO) of ``x @ w_i`` over ``layers`` weights kept
    as separate arrays and as one stacked array sliced per layer."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.01 for i in range(layers)]
    stacked = jnp.stack(ws)

    def separate(x, ws):
        acc = jnp.zeros((m, n), jnp.float32)
        for w in ws:
            acc = acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
        return acc

    def sliced(x, st):
        acc = jnp.zeros((m, n), jnp.float32)
        for i in range(layers):
            acc = acc + jnp.dot(x, st[i], preferred_element_type=jnp.float32)
        return acc

    rows = []
    outs = []
    for name, fn, w in (("separate arrays", separate, ws), ("one stacked array, sliced", sliced, stacked)):
        exe = jax.jit(fn).lower(x, w).compile()
        hlo = exe.as_text()
        ops = len(re.findall(r"= \S+ (?:copy|copy-start|slice|dynamic-slice)\(", hlo))  # (a slice may be a view)
        cost = exe.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        gb = cost.get("bytes accessed", float("nan")) / 1e9
        out = exe(x, w)
        jax.block_until_ready(out)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(x, w))
            times.append(time.perf_counter() - t0)
        times.sort()
        outs.append(out)
        rows.append([name, f"{times[len(times) // 2] * 1e3:.3f}", ops, f"{gb:.3f}"])
    err = float(jnp.max(jnp.abs(outs[0] - outs[1])))
    rows.append(["max abs difference (the two sums)", f"{err:.3g}", "", ""])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU): the harness only")
    ap.add_argument("--calls", type=int, default=None)
    args = ap.parse_args()
    t0 = time.time()
    calls = args.calls or (20 if args.smoke else 300)
    log(f"devices: {jax.devices()}  jax {jax.__version__}")
    rows = []
    for w, c in COUNTS:
        host = call_time(w, c, calls)
        rows.append([w, c, w + 2 * c, f"{host * 1e6:.1f}"])
        log(f"  {w} weight arrays, {c} cache arrays: {host * 1e6:.1f} us per call")
    table(f"Host time per call by argument count ({calls} calls back to back)",
          ["weight arrays", "cache arrays (donated)", "arguments + outputs", "us per call"], rows)
    shape = (4, 2, 64, 128, 3) if args.smoke else (32, 256, 4096, 28672, 20)  # L, M, K, N (8B gate-up), reps
    table(f"{shape[0]} matmuls [{shape[1]}, {shape[2]}] x [{shape[2]}, {shape[3]}] bf16: separate weights or one "
          "stacked array sliced per layer", ["form", "ms per pass (median)", "copy / slice ops in the HLO",
                                             "GB accessed (XLA's cost analysis)"],
          stacked_matmuls(*shape))
    finish(args.out, "call_args.md", "A step call's argument count, and stacked per-layer weights", t0, ROOT)


if __name__ == "__main__":
    main()
