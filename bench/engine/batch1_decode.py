"""Section d of ``bench/engine/engine_bench.py``: decode at batch 1, three ways, against the weight-read floor.

1. ``generate(max_tokens=64)`` on a 64-token prompt and on a 4k injected segment + 64-token question
   (step = 1 / ``metrics.decode_tokens_per_s``);
2. ``runner.step`` called in a loop on one decode row (one synchronous step: host packing + dispatch
   + device + read-back), over pages prefilled with real KV;
3. the device step alone: ``ModelRunner.replay_last`` replays the last step's executable back to
   back (cache donated, one sync at the end).

Floor = the bytes a decode step must read (every weight but the embedding table) / section a's
bandwidth (the larger of read-only and copy); 'floor + KV' adds the context's KV.  Repetitions
inside which the engine compiled are dropped (``EngineBench.timed``).
"""

from __future__ import annotations

import time
import traceback

from common import EngineBench, kv_token_bytes, median, ms, ratio, timed_generate  # bench/lib/common.py
from report import log, section, table  # bench/lib/report.py
from ttft import Q, ensure_segment  # bench/engine/ttft.py


def fill_pages(b: EngineBench, eng, n_tokens):
    """Pages holding n_tokens of real KV (prefilled with chunk-sized and 64-token steps) plus room for
    one more token; the caller gives them back to the pool."""
    from inferscale_jax.runner import StepRow

    s, chunk = eng.config.page_size, eng.config.prefill_chunk
    pages = eng.pool.allocate(-(-(n_tokens + 1) // s))
    assert pages is not None, "KV pool too small for the decode benchmark"
    ids = b.fresh(n_tokens)
    pos = 0
    while pos < n_tokens:
        m = chunk if n_tokens - pos >= chunk else min(Q, n_tokens - pos)
        eng.runner.step([StepRow(ids[pos:pos + m], pos, pages)])
        pos += m
    return pages


def step_times(b: EngineBench, eng, ctx, reps, replay):
    """(synchronous runner.step median, replayed device step) for one decode step at ctx."""
    from inferscale_jax.runner import StepRow

    runner = eng.runner
    pages = fill_pages(b, eng, ctx)
    try:
        row = StepRow(b.fresh(1), ctx, pages)
        for _ in range(3):  # compiles the bucket when new
            runner.step([row])

        def one():
            t0 = time.perf_counter()
            runner.step([row])
            return time.perf_counter() - t0

        sync_t = median(b.timed(eng, one, reps, f"runner.step at ctx {ctx}"))
        dev_t = None
        try:
            runner.step([row])
            runner.replay_last(3)
            dev_t = median(b.timed(eng, lambda: runner.replay_last(replay), 5, f"replay at ctx {ctx}"))
        except Exception:  # noqa: BLE001 - the synchronous figure stands
            log("  device-step replay failed:\n" + traceback.format_exc())
        return sync_t, dev_t
    finally:
        eng.pool.decref(reversed(pages))


@section
def decode(b: EngineBench):
    s = b.s
    eng = b.engine()
    dec_L = s["dec_L"]
    seg = ensure_segment(b, eng, dec_L)
    res = b.R.setdefault("decode", {})
    cases = [("64-token prompt", []), (f"seg{dec_L} + {Q} injected", [seg])]
    for name, segs in cases:
        c0, t0 = eng.compiles, time.perf_counter()
        timed_generate(eng, b.fresh(Q), segs, max_tokens=8)  # warm up (the T=1 bucket)
        if eng.compiles > c0:
            log(f"  decode warm-up with {eng.compiles - c0} new compile(s): {time.perf_counter() - t0:.1f} s")

        def one(segs=segs):
            out, _ = timed_generate(eng, b.fresh(Q), segs, max_tokens=64)
            assert out.metrics.generated_tokens == 64, out.metrics
            return 1.0 / out.metrics.decode_tokens_per_s

        steps = b.timed(eng, one, s["dec_reps"], f"generate decode, {name}")
        res[name] = {"gen": median(steps)}
        log(f"  generate decode, {name}: {ms(median(steps))} ms/step")
    for name, ctx in (("64-token prompt", 2 * Q), (f"seg{dec_L} + {Q} injected", dec_L + Q)):
        sync_t, dev_t = step_times(b, eng, ctx, s["step_reps"], s["replay"])
        res[name].update(ctx=ctx, sync=sync_t, dev=dev_t)
        log(f"  ctx {ctx}: runner.step {ms(sync_t)} ms, device step {ms(dev_t)} ms")
    bw, W = b.bandwidth(), b.step_read_bytes()
    floor = W / bw if bw else None
    b.R["floor"] = floor
    kv_tok = kv_token_bytes(b.cfg, b.base_config.get("kv_dtype"))
    rows = []
    for name, d in res.items():
        tight = ((W + kv_tok * d["ctx"]) / bw) if bw else None
        rows.append([name, d["ctx"], ms(d["gen"]), ms(d["sync"]), ms(d["dev"]), ms(floor),
                     ratio(d["gen"], floor), ratio(d["dev"], floor), ms(tight), ratio(d["dev"], tight)])
    table(f"d. Decode step, batch 1 (floor = {W / 1e9:.2f} GB of weights a step reads, the embedding table "
          f"left out / {(bw or 0) / 1e9:.0f} GB/s)",
          ["case", "ctx", "generate ms", "runner.step ms", "device ms", "floor ms", "generate/floor",
           "device/floor", "floor + KV ms", "device/(floor + KV)"], rows)
