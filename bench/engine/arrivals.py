"""Section f of ``bench/engine/engine_bench.py``: TTFT percentiles under seeded Poisson arrivals.

Each request names one of 4 shared 2k segments + a 64-token question, max_tokens=16, greedy; it is
submitted when the host clock passes its arrival time, ``step()`` runs in between (the host sleeps
only when the engine is idle).  1000 requests per rate (so p99 is the 10th largest, not the
maximum), default rates 10 and 50 req/s.  Every step bucket is compiled first (``Engine.warmup``)
and a warm-up run made; a compile inside a timed run is a reported failure.  TTFT = host time at
the end of the ``step()`` that returned the request's first token - its scheduled arrival time;
``metrics.ttft_s`` (from ``submit()``) is shown beside it.
"""

from __future__ import annotations

import time

import numpy as np
from common import EngineBench, abort_all, greedy, ms, pct  # bench/lib/common.py
from report import MD, log, section, table  # bench/lib/report.py


def precompile(eng) -> int:
    """Compile every step bucket now (``Engine.warmup``: decode, cascade and mixed buckets), so a
    timed run does not compile; returns the number of new compiles."""
    c0, t0 = eng.compiles, time.perf_counter()
    if not eng.runner.warm:
        eng.warmup()
    log(f"  precompiled {eng.compiles - c0} bucket(s): {time.perf_counter() - t0:.1f} s")
    return eng.compiles - c0


def arrival_run(eng, vocab, segs, rate, n, q, mt, seed):
    """Poisson arrivals (seeded) at ``rate`` req/s: each request is submitted when the host
    clock passes its arrival time (between ``step()`` calls), then ``step()`` runs while
    anything is unfinished (the host sleeps only when the engine is idle).  TTFT = host time
    at the end of the ``step()`` that returned the request's first token - its scheduled
    arrival time (so it includes the wait for an in-flight step and the rest of the step that
    sampled it).  ``metrics.ttft_s`` counts from ``submit()`` to the sample inside that step."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    which = rng.integers(0, len(segs), n)
    prompts = [rng.integers(0, vocab, q).tolist() for _ in range(n)]
    assert not eng.has_unfinished()
    st0, c0 = eng.stats(), eng.compiles
    arr, sub, first, outs = {}, {}, {}, {}
    running, steps = [], 0
    i = 0
    t0 = time.perf_counter()
    try:
        while i < n or eng.has_unfinished():
            now = time.perf_counter() - t0
            while i < n and arrivals[i] <= now:
                rid = eng.submit(prompt_token_ids=prompts[i], segments=[segs[which[i]]], sampling=greedy(mt))
                arr[rid], sub[rid] = arrivals[i], time.perf_counter() - t0
                i += 1
            if eng.has_unfinished():
                running.append(len(eng.scheduler.running) + len(eng.scheduler.waiting))
                res = eng.step()
                steps += 1
                t = time.perf_counter() - t0
                for o in res:
                    if o.new_token_ids:
                        first.setdefault(o.request_id, t)
                    if o.finished:
                        outs[o.request_id] = o.output
            elif i < n:
                time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
    except BaseException:
        abort_all(eng, list(arr))
        raise
    span = time.perf_counter() - t0
    st1 = eng.stats()
    ttft = [first[r] - arr[r] for r in arr]
    m_ttft = [outs[r].metrics.ttft_s for r in arr]
    lag = [sub[r] - arr[r] for r in arr]
    return dict(rate=rate, n=n, span=span, achieved=n / arrivals[-1], steps=steps,
                p50=pct(ttft, 50), p90=pct(ttft, 90), p99=pct(ttft, 99), max=max(ttft), mean=float(np.mean(ttft)),
                m_p50=pct(m_ttft, 50), m_p99=pct(m_ttft, 99), lag_p99=pct(lag, 99),
                e2e_p50=pct([outs[r].metrics.e2e_s for r in arr], 50),
                in_flight=float(np.mean(running)) if running else 0.0,  # running + waiting, per step
                compiles=eng.compiles - c0,
                preemptions=st1.get("preemptions", 0) - st0.get("preemptions", 0),
                generated=sum(outs[r].metrics.generated_tokens for r in arr))


@section
def arrivals(b: EngineBench):
    """f. TTFT p50/p99 under Poisson arrivals: each request names one of 4 shared segments and
    adds a 64-token question."""
    s = b.s
    eng = b.engine()
    vocab = b.cfg.vocab_size
    segs = [f"arr_ctx{i}" for i in range(s["f_segs"])]
    t0 = time.perf_counter()
    for name in segs:
        eng.register_segment(name, token_ids=b.fresh(s["f_ctx"]))
    log(f"  registered {len(segs)} segments of {s['f_ctx']} tokens: {time.perf_counter() - t0:.2f} s")
    b.R["arrival"] = {}
    try:
        precompile(eng)
        # warm-up: a short run at the highest rate (host paths, any bucket not precompiled)
        w = arrival_run(eng, vocab, segs, max(s["f_rates"]), max(8, s["f_n"] // 4), s["f_q"], s["f_max_tokens"], 999)
        log(f"  warm-up: {w['n']} requests, {w['compiles']} compile(s), p50 {ms(w['p50'])} ms")
        for k, rate in enumerate(s["f_rates"]):
            r = arrival_run(eng, vocab, segs, rate, s["f_n"], s["f_q"], s["f_max_tokens"], 100 + k)
            b.R["arrival"][rate] = r
            if r["compiles"]:
                b.failures.append(f"f rate {rate}: {r['compiles']} compile(s) inside the timed run")
            if r["generated"] != r["n"] * s["f_max_tokens"]:
                b.failures.append(f"f rate {rate}: generated {r['generated']} != {r['n'] * s['f_max_tokens']}")
            log(f"  rate {rate:g}/s: ttft p50 {ms(r['p50'])} p99 {ms(r['p99'])} ms, mean in flight "
                f"{r['in_flight']:.1f}, {r['steps']} steps in {r['span']:.1f} s, compiles {r['compiles']}")
    finally:
        b.drop_segments(eng, segs)
    rows = [[f"{rate:g}", f"{r['achieved']:.1f}", r["n"], ms(r["p50"]), ms(r["p90"]), ms(r["p99"]), ms(r["max"]),
             ms(r["m_p50"]), ms(r["m_p99"]), ms(r["lag_p99"]), ms(r["e2e_p50"]), f"{r['in_flight']:.1f}",
             r["preemptions"], r["compiles"]]
            for rate, r in b.R["arrival"].items()]
    table(f"f. TTFT under Poisson arrivals: one of {s['f_segs']} shared {s['f_ctx']}-token segments + "
          f"{s['f_q']}-token question, max_tokens={s['f_max_tokens']} (greedy)",
          ["rate req/s", "achieved", "requests", "ttft p50 ms", "p90", "p99", "max", "metrics ttft p50",
           "metrics p99", "submit lag p99", "e2e p50 ms", "mean in flight", "preemptions", "compiles"], rows)
    MD.extend([
        "ttft = host clock at the end of the `step()` that returned the first token - the scheduled "
        "(Poisson, seeded) arrival time: it includes waiting for the step in flight at arrival and the "
        "decode step that follows the prefill inside the same `step()`.  `metrics.ttft_s` counts from "
        "`submit()` (made at the first loop turn after the arrival time: 'submit lag') to the sample "
        "in the prefill step.  'mean in flight' = running + waiting requests, averaged over steps.  "
        + (f"With {s['f_n']} requests per rate p99 is close to the max: read p90.  " if s["f_n"] < 1000 else
           f"{s['f_n']} requests per rate.  ")
        + "Step buckets "
        "were precompiled and a warm-up run made first; 'compiles' counts compiles inside the timed run.", ""])
