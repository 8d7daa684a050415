"""The in-process ``AsyncEngine`` path alone, over the model-free paced engine (no HTTP, no model).

``bench/serving/api_overhead.py`` measures the API-server process over ``bench/lib/paced_engine.py``;
this measures what is left without it: C closed-loop client coroutines in one event loop stream
from ``AsyncEngine`` (its engine thread, command queue, per-step delivery, detokenization) while the
paced engine gives every running request one token per ``--step-ms`` (``--hold-ms``: the engine thread
also runs that much Python per step, holding the GIL, as the real engine's host work does).  Reports output tok/s (the
ceiling is ``min(C, max_batch) / step``), rows per step, and TTFT in seconds and in engine steps:
a served loop whose TTFT is many steps more than this loses its rows before the engine, not in it.

    python bench/serving/inproc_paced.py --concurrency 256 --step-ms 16 --requests-per-client 6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=16.0)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=6)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hold-ms", type=float, default=0.0,
                    help="pure-Python work per step on the engine thread, holding the GIL (the real engine's "
                         "host time per step: ~11 ms at 256 rows on the GPU machine, bench/NOTES.md run AK)")
    args = ap.parse_args()

    from paced_engine import PacedEngine  # bench/lib/paced_engine.py

    from inferscale_jax import SamplingParams
    from inferscale_jax.async_engine import AsyncEngine

    engine = PacedEngine(None, args.step_ms, args.max_batch)
    if args.hold_ms > 0:
        paced_step, hold = engine.step, args.hold_ms / 1e3

        def step():
            t, n = time.perf_counter(), 0
            while time.perf_counter() - t < hold:  # bytecode: the GIL is held (switched every 5 ms)
                n += 1
            return paced_step()
        engine.step = step
    aeng = AsyncEngine(engine)
    rng = random.Random(0)
    results = []  # (ttft s, steps to the first token, e2e s)

    async def client(c: int) -> None:
        for i in range(args.requests_per_client):
            t0, s0, first = time.perf_counter(), engine.steps, None
            async for _ in aeng.stream(request_id=f"c{c}-{i}",
                                       prompt_token_ids=[rng.randrange(10, 1000) for _ in range(args.question_tokens)],
                                       sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                               ignore_eos=True)):
                if first is None:
                    first, s1 = time.perf_counter() - t0, engine.steps
            results.append((first, s1 - s0, time.perf_counter() - t0))

    async def run() -> None:
        await asyncio.gather(*[client(c) for c in range(args.concurrency)])

    t0, steps0 = time.perf_counter(), engine.steps
    try:
        asyncio.run(run())
    finally:
        aeng.shutdown()
    wall, steps = time.perf_counter() - t0, engine.steps - steps0
    tokens = len(results) * args.max_tokens
    ceiling = min(args.concurrency, args.max_batch) / (args.step_ms / 1e3)
    print(f"`python bench/serving/inproc_paced.py --concurrency {args.concurrency} --step-ms {args.step_ms:g} "
          f"--requests-per-client {args.requests_per_client} --hold-ms {args.hold_ms:g}`\n")
    print("| out tok/s | ceiling tok/s | rows per step | wall per step ms | TTFT p50 / p90 ms | TTFT p50 / p90 steps "
          "| E2E p50 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ttft, in_steps, e2e = ([r[i] for r in results] for i in range(3))
    print(f"| {tokens / wall:.0f} | {ceiling:.0f} | {engine.step_rows / max(1, engine.steps):.1f} | "
          f"{1e3 * wall / max(1, steps):.1f} | {1e3 * pct(ttft, .5):.1f} / {1e3 * pct(ttft, .9):.1f} | "
          f"{pct(in_steps, .5)} / {pct(in_steps, .9)} | {1e3 * pct(e2e, .5):.0f} |")


if __name__ == "__main__":
    main()
