"""Section g of ``bench/engine/engine_bench.py``: TTFT of a request over 3 segments in each injection mode.

3 segments of 2k + a 64-token question (max_tokens=1, greedy): exact on a cold chain (the chain
nodes [a, b] and [a, b, c] computed inside the request; 3 fresh triples), exact on the warm chain,
compose and blend (their first call, with its compiles, listed apart); exact over one segment and
a full prefill of 6144 + 64 as references.  Repetitions inside which the engine compiled are
dropped (``EngineBench.timed``) - except the listed first calls and the cold chains, which are
first uses by design and report their compiles.
"""

from __future__ import annotations

import time

from common import EngineBench, median, ms, ratio  # bench/lib/common.py
from report import MD, log, section, table  # bench/lib/report.py
from ttft import Q  # bench/engine/ttft.py


@section
def modes(b: EngineBench):
    """g. TTFT of a request over 3 segments (+ a 64-token question) in each injection mode."""
    s = b.s
    eng = b.engine()
    n = s["g_ctx"]
    # triples: 0 for compose, 1 for blend (chains never computed), 2.. for exact cold / warm
    sets = [[f"mode{k}_{c}" for c in "abc"] for k in range(s["g_cold"] + 2)]
    t0 = time.perf_counter()
    for names in sets:
        for name in names:
            eng.register_segment(name, token_ids=b.fresh(n))
    log(f"  registered {3 * len(sets)} segments of {n} tokens: {time.perf_counter() - t0:.2f} s")
    res = {}
    b.R["modes"] = res

    def one(segs, mode, prompt_n=Q):
        from inferscale_jax.sampling import SamplingParams
        c0, n0 = eng.compiles, len(eng.store.nodes())
        t = time.perf_counter()
        out = eng.generate(prompt_token_ids=b.fresh(prompt_n), segments=segs, mode=mode,
                           sampling=SamplingParams(max_tokens=1, temperature=0.0))
        return (out.metrics.ttft_s, time.perf_counter() - t, out.metrics.cached_tokens, eng.compiles - c0,
                len(eng.store.nodes()) - n0)

    def record(name, runs, note=""):
        res[name] = dict(ttft=median([r[0] for r in runs]), wall=median([r[1] for r in runs]),
                         cached=runs[-1][2], n=len(runs), compiles=sum(r[3] for r in runs),
                         nodes=sum(r[4] for r in runs), note=note)
        log(f"  {name}: ttft {ms(res[name]['ttft'])} ms (wall {ms(res[name]['wall'])}, cached "
            f"{res[name]['cached']}, n={len(runs)}, compiles {res[name]['compiles']}, new chain nodes "
            f"{res[name]['nodes']}) {note}")

    try:
        one(sets[0][:1], "exact")  # every bucket used below exists after this (chunk + question)
        # exact, cold chain: nodes [a, b] and [a, b, c] are computed inside the request
        record("exact, cold chain", [one(names, "exact") for names in sets[2:]],
               f"first use of each of {len(sets) - 2} segment triples")
        record("exact, warm chain", b.timed(eng, lambda: one(sets[2], "exact"), s["g_reps"], "exact, warm chain"))
        record("exact, one segment (a) + question",
               b.timed(eng, lambda: one(sets[2][:1], "exact"), s["g_reps"], "exact, one segment"))
        record(f"full prefill {3 * n}+{Q} (no segments)",
               b.timed(eng, lambda: one([], "exact", 3 * n + Q), max(2, s["g_reps"] // 4), "full prefill"))
        for mode, names in (("compose", sets[0]), ("blend", sets[1])):
            try:
                # a triple whose chain exact never computed: a mode that fell back to exact would
                # show new chain nodes (and cached = {n} on its first call)
                record(f"{mode}, first call", [one(names, mode)], "includes its compiles")
                record(mode, b.timed(eng, lambda: one(names, mode), s["g_reps"], mode))
                if res[f"{mode}, first call"]["nodes"] or res[mode]["nodes"]:
                    res[mode]["note"] = "added chain nodes: ran as exact?"
                    log(f"  WARNING {mode}: added chain nodes, so it behaved like exact (not implemented yet?)")
            except NotImplementedError as e:
                log(f"  {mode}: not implemented ({e})")
                res[mode] = dict(ttft=None, wall=None, cached=None, n=0, compiles=0, nodes=0,
                                 note=f"not implemented: {e}")
    finally:
        b.drop_segments(eng, [x for names in sets for x in names])
    base = res.get("exact, warm chain", {}).get("ttft")
    rows = [[name, ms(d["ttft"]), ms(d["wall"]), d["cached"], ratio(d["ttft"], base), d["n"], d["compiles"],
             d["nodes"], d["note"]] for name, d in res.items()]
    table(f"g. TTFT by injection mode: 3 segments of {n} tokens + {Q}-token question (max_tokens=1, greedy; "
          "medians)", ["request", "ttft ms", "wall ms", "cached tokens", "/ exact warm", "runs", "compiles",
                       "new chain nodes", "note"], rows)
    MD.extend([
        "ttft = `metrics.ttft_s` (from `submit()`, inside `generate`, to the first sample; includes "
        "computing missing chain nodes at admission); wall = host clock around `generate`.  compose / "
        "blend keep no chain cache: every call splices (and blend recomputes) anew, so they run on a "
        "triple whose chain exact never computed and must add no chain nodes ('new chain nodes' > 0 "
        "means the mode ran as exact); their first call (compiles) is listed separately.", ""])
