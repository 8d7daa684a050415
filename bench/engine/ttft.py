"""Section b of ``bench/engine/engine_bench.py``: our TTFT with an injected segment, a full prefill and the question alone.

For L in the settings' lengths (1k, 4k, 16k on the GPU): a segment of L random tokens registered
once (timed, with the compiles of new buckets it needed), then per request new random question
tokens (``Q`` = 64): (1) the question after the injected segment, (2) a full prefill of L + 64
fresh tokens (no prefix-cache hit possible), (3) the question alone.  ``max_tokens=1``, greedy;
``metrics.ttft_s`` and the wall clock around ``generate``, medians; a repetition inside which the
engine compiled is dropped (``EngineBench.timed``).

Floors (roofline, section a's ceilings): max(weights a step reads x steps / bandwidth, FLOPs /
measured matmul ceiling), with the FLOPs of ``common.forward_flops`` (the LM head for the one
sampled token); MFU = FLOPs / TTFT / 989 TFLOP/s.
"""

from __future__ import annotations

import time

from common import H200_BF16_PEAK, EngineBench, forward_flops, median, ms, ratio, timed_generate  # bench/lib/common.py
from report import log, section, table  # bench/lib/report.py

Q = 64  # question tokens


def ensure_segment(b: EngineBench, eng, L: int) -> str:
    """Register seg{L} once in ``eng`` (timed; its first use of a chunk bucket includes the compile)."""
    if L in b.segments:
        return f"seg{L}"
    ids = b.fresh(L)
    c0, t0 = eng.compiles, time.perf_counter()
    eng.register_segment(f"seg{L}", token_ids=ids)
    dt = time.perf_counter() - t0
    b.segments[L] = ids
    b.R.setdefault("registered", {})[L] = (dt, eng.compiles - c0)
    log(f"  registered seg{L}: {dt:.2f} s ({eng.compiles - c0} new compiles)")
    return f"seg{L}"


def measure_ttft(b: EngineBench, eng, name, n_tokens, segs, warm, reps, expect_cached):
    """Median (ttft_s, wall) over ``reps`` requests of ``n_tokens`` new tokens, after ``warm`` warm-ups."""
    c0, t0 = eng.compiles, time.perf_counter()
    for _ in range(warm):
        timed_generate(eng, b.fresh(n_tokens), segs)
    if eng.compiles > c0:
        log(f"  {name}: warm-up with {eng.compiles - c0} new compile(s): {time.perf_counter() - t0:.1f} s")
    runs = b.timed(eng, lambda: timed_generate(eng, b.fresh(n_tokens), segs), reps, name)
    ttft = [o.metrics.ttft_s for o, _ in runs]
    wall = [w for _, w in runs]
    bad = sum(o.metrics.cached_tokens != expect_cached for o, _ in runs)
    if bad:
        b.failures.append(f"{name}: cached_tokens != {expect_cached} in {bad}/{len(runs)} runs")
        log(f"  WARNING {name}: cached_tokens != {expect_cached} in {bad}/{len(runs)} runs")
    log(f"  {name}: ttft {ms(median(ttft))} ms (min {ms(min(ttft))}, max {ms(max(ttft))}), "
        f"wall {ms(median(wall))} ms")
    return median(ttft), median(wall)


def floor_and_mfu(b: EngineBench, T: int, C: int, ttft):
    """(floor seconds, MFU vs the datasheet peak) of a request computing T tokens over C cached."""
    chunk = b.base_config["prefill_chunk"]
    steps = -(-T // chunk)
    flops = forward_flops(b.sh, T, C, lm_head_tokens=1)
    parts = [x for x in ((steps * b.step_read_bytes() / b.bandwidth()) if b.bandwidth() else None,
                         (flops / b.mm_flops) if b.mm_flops else None) if x is not None]
    return (max(parts) if parts else None), (flops / ttft / H200_BF16_PEAK if ttft else None)


@section
def ttft(b: EngineBench):
    s = b.s
    eng = b.engine()
    for L in s["Ls"]:
        ensure_segment(b, eng, L)
    res = b.R.setdefault("ours", {})
    # the question alone first: compiles the T=64 bucket every later request shares
    b.R["question"] = measure_ttft(b, eng, "question alone", Q, [], 2, s["reps"], 0)
    for L in s["Ls"]:
        res.setdefault(L, {})["inj"] = measure_ttft(b, eng, f"injected seg{L} + {Q}", Q, [f"seg{L}"], 2,
                                                    s["reps"], L)
    for L in s["Ls"]:
        reps = s["reps_full"] if L < 16384 else max(3, s["reps_full"] - 2)
        res[L]["full"] = measure_ttft(b, eng, f"full prefill {L}+{Q}", L + Q, [], 1, reps, 0)
    q = b.R["question"][0]

    def row(name, T, C, tokens, d):
        fl, mfu = floor_and_mfu(b, T, C, d[0])
        return [name, tokens, ms(d[0]), ms(d[1]), ratio(d[0], q), ms(fl), ratio(d[0], fl),
                "n/a" if mfu is None else f"{mfu:.1%}"]

    rows = [row("question alone", Q, 0, Q, b.R["question"])]
    for L in s["Ls"]:
        rows.append(row(f"injected seg{L}", Q, L, L + Q, res[L]["inj"]))
        rows.append(row("full prefill", L + Q, 0, L + Q, res[L]["full"]))
    b.R["ttft_floor"] = {r[0] + (f" {r[1]}" if r[0] == "full prefill" else ""): r[5] for r in rows}
    table("b. Our TTFT (max_tokens=1, greedy; medians; floor = max(weights read per step x steps / "
          "bandwidth, FLOPs / matmul ceiling); MFU vs 989 TFLOP/s)",
          ["request", "tokens", "ttft ms", "wall ms", "/ question alone", "floor ms", "/ floor", "MFU"], rows)
    rows = [[L, f"{dt:.2f}", n] for L, (dt, n) in sorted(b.R["registered"].items())]
    table("b. Segment registration (one-shot, includes compiles of new buckets)",
          ["L", "seconds", "new compiles"], rows)
