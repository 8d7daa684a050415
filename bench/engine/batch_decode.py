"""Section e of ``bench/engine/engine_bench.py``: decode tokens/s at batch B over one shared context vs private ones.

At B in 1/8/32/64/128 every request names ONE shared 4k segment + its own 16-token question
(max_tokens=32, greedy, ignore_eos), all submitted at once and driven by ``engine.step()``; three
cases, each on its own engine over the same weights (``EngineBench.engine``; the previous engine is
dropped first, so one pool is alive at a time):

- shared, plain paged decode (``cascade_decode=False``): each row reads the shared pages itself;
- shared, cascade decode (``cascade_decode=True``): the shared pages read once per row block;
- private: each request its own registered 4k context (different random tokens), on the plain
  engine, for the B whose contexts fit the pool.

The pool: the device memory left after the weights less 8 GiB of headroom for step activations,
capped at what the private case at the largest B can use.  tok/s = tokens generated after every
request holds its first token / wall time of that decode window (host clock around ``step()``,
which reads back every step); one warm-up run per B (compiles its buckets), then the median of 3
timed runs, a run that compiled dropped.  Floors: B / (weight bytes a step reads / bandwidth), and
floors that add the KV bytes a step must read (the shared context once, or every private context).
"""

from __future__ import annotations

import json
import time
import traceback

from common import EngineBench, abort_all, greedy, kv_token_bytes, median, ms, ratio  # bench/lib/common.py
from report import MD, log, section, table  # bench/lib/report.py

def run_batch(eng, reqs):
    """Submit every request at once, then ``step()`` until all finish.

    Decode window: from the end of the first ``step()`` after which every request holds its
    first token, to the end of the last ``step()``.  tok/s = tokens produced in the window /
    its wall time (so prefill and TTFT stay out; every step in the window is a decode step
    over the requests still running).  Also returns the sum of per-request
    ``metrics.decode_tokens_per_s`` as a cross-check (equal for requests in lockstep)."""
    assert not eng.has_unfinished(), "engine has unfinished requests from an earlier run"
    st0, c0 = eng.stats(), eng.compiles
    t0 = time.perf_counter()
    ids = []
    first, outs = {}, {}
    t_all = None
    n_win = steps_win = 0
    steps = 0
    try:
        ids = [eng.submit(**r) for r in reqs]
        while eng.has_unfinished():
            res = eng.step()
            now = time.perf_counter()
            steps += 1
            for o in res:
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    if t_all is not None:
                        n_win += len(o.new_token_ids)
                if o.finished:
                    outs[o.request_id] = o.output
            if t_all is not None:
                steps_win += 1
            elif len(first) == len(ids):
                t_all = now
    except BaseException:
        abort_all(eng, ids)
        raise
    t_end = time.perf_counter()
    st1 = eng.stats()
    missing = [r for r in ids if r not in outs]
    assert not missing, f"{len(missing)} requests never finished"
    win = t_end - t_all if t_all is not None else 0.0
    return dict(
        tok_s=n_win / win if win > 0 and n_win else None,
        step=win / steps_win if steps_win else None,
        steps_win=steps_win, tokens_win=n_win,
        sum_dec=sum(outs[r].metrics.decode_tokens_per_s for r in ids),
        all_first=(t_all - t0) if t_all is not None else None,
        ttft=median([outs[r].metrics.ttft_s for r in ids]),
        generated=sum(outs[r].metrics.generated_tokens for r in ids),
        cached=[outs[r].metrics.cached_tokens for r in ids],
        wall=t_end - t0, steps=steps, compiles=eng.compiles - c0,
        preemptions=st1.get("preemptions", 0) - st0.get("preemptions", 0),
        outs=[outs[r] for r in ids])


def best_of(b: EngineBench, eng, make_reqs, reps, label):
    """One warm-up run (compiles its buckets), then ``reps`` timed runs; median tok/s.  A
    timed run that compiled is reported and not used."""
    w = run_batch(eng, make_reqs())
    if w["compiles"]:
        log(f"  {label}: warm-up compiled {w['compiles']} bucket(s) in {w['wall']:.1f} s")
    runs = b.timed(eng, lambda: run_batch(eng, make_reqs()), reps, label)
    runs.sort(key=lambda r: r["tok_s"] or 0.0)
    m = runs[len(runs) // 2]
    m["tok_s_all"] = [r["tok_s"] for r in runs]
    m["preemptions"] = sum(r["preemptions"] for r in runs)
    return m


def profile_decode(eng, make_reqs, B):
    """Device time per decode step by kernel (profiler trace) for one run of B shared-context
    requests with cascade decode: where the step time goes besides attention."""
    from profile_ops import kernel_times
    box = {}

    def run():
        box["r"] = run_batch(eng, make_reqs())
    rows = kernel_times(run, 1, top=25)
    steps = box["r"]["steps"]
    tot = sum(t for _, _, t, _ in rows)
    table(f"e'. Device time by kernel, one run of B={B} shared-context requests with cascade decode "
          f"({steps} steps incl. prefill; per step = total / steps; top 25 kernel names, {tot / 1e3:.1f} ms "
          f"of device time in all, {box['r']['wall'] * 1e3:.1f} ms wall)",
          ["kernel", "us per step", "launches per step"],
          [[k, f"{t / steps:.1f}", f"{c / steps:.1f}"] for _, k, t, c in rows])


def private_runs(b: EngineBench, eng, res, pBs, private, reqs, ctx):
    """e, private case: register max(pBs) private contexts (names appended to ``private`` so the
    caller deletes them whatever happens), then run each B in pBs."""
    s = b.s
    if not pBs:
        return
    t0 = time.perf_counter()
    ev0 = json.dumps(eng.stats().get("tiers"), default=str)
    for i in range(max(pBs)):
        name = f"private_ctx{i}"
        eng.register_segment(name, token_ids=b.fresh(ctx))
        private.append(name)
    res["private_register_s"] = time.perf_counter() - t0
    log(f"  registered {len(private)} private contexts of {ctx} tokens: {res['private_register_s']:.1f} s")
    for B in pBs:
        r = best_of(b, eng, lambda: reqs(B, private[:B]), s["e_reps"], f"private B={B}")
        bad = sum(c != ctx for c in r["cached"])
        if bad:
            b.failures.append(f"e private B={B}: cached_tokens != {ctx} in {bad}/{B} requests "
                            "(a private context left HBM?)")
        res["private"][B] = r
        log(f"  private B={B:4d}: {r['tok_s']:.0f} tok/s ({ms(r['step'])} ms/step), preemptions "
            f"{r['preemptions']}")
    ev1 = json.dumps(eng.stats().get("tiers"), default=str)
    if ev0 != ev1:
        log(f"  note: tier stats changed during the private runs: {ev0} -> {ev1}")


def shared_decode_table(b: EngineBench, res, ps):
    s, cfg = b.s, b.cfg
    ctx, q, mt, Bs = s["e_ctx"], s["e_q"], s["e_max_tokens"], s["e_Bs"]
    bw, W = b.bandwidth(), b.step_read_bytes()
    kvt = kv_token_bytes(cfg, b.base_config.get("kv_dtype"))
    kv_ctx = kvt * (ctx + q + mt // 2)  # one sequence's KV at the middle of decode
    rows = []
    for B in Bs:
        sh, pr, ca = res["shared"].get(B, {}), res["private"].get(B, {}), res["cascade"].get(B, {})
        floor = B / (W / bw) if bw else None
        floor_sh = B / ((W + kvt * ctx + B * kvt * (q + mt // 2)) / bw) if bw else None
        floor_pr = B / ((W + B * kv_ctx) / bw) if bw else None
        res.setdefault("floor", {})[B] = (floor, floor_sh, floor_pr)
        f0 = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
        capped = res.get("cap") is not None and B > res["cap"]
        rows.append([B, f0(sh.get("tok_s")), ms(sh.get("step")), f0(ca.get("tok_s")), ms(ca.get("step")),
                     ratio(ca.get("tok_s"), sh.get("tok_s")),
                     f0(pr.get("tok_s")) if pr else (f"(B > {res['cap']})" if capped else "n/a"), ms(pr.get("step")),
                     ratio(sh.get("tok_s"), pr.get("tok_s")), ratio(ca.get("tok_s"), pr.get("tok_s")),
                     f0(floor), ratio(max(sh.get("tok_s") or 0, ca.get("tok_s") or 0) or None, floor),
                     f0(floor_sh), f0(floor_pr), ms(sh.get("all_first")), f0(sh.get("sum_dec"))])
    kvd = b.base_config.get("kv_dtype") or "bfloat16"
    table(f"e. Decode tokens/s at batch B, context {ctx} + {q}-token question, {mt} tokens each "
          f"(greedy, ignore_eos; median of {s['e_reps']} runs; {kvd} KV pages)",
          ["B", "shared tok/s", "shared ms/step", "shared+cascade tok/s", "cascade ms/step", "cascade/shared",
           "private tok/s", "private ms/step", "shared/private", "cascade/private",
           "weight floor tok/s", "best/floor", "floor+KV shared", "floor+KV private",
           "shared: all first tokens ms", "shared: sum of per-request tok/s"], rows)
    MD.extend([
        f"tok/s = tokens generated after every request of the batch holds its first token / wall time "
        f"from then to the last token (host clock around `engine.step()`, which reads back every step); "
        f"'shared' = plain paged decode (each row reads the shared pages itself), 'shared+cascade' = "
        f"`EngineConfig.cascade_decode=True` (the shared pages read once per row block of the batch); "
        f"ms/step = that window / its steps.  Weight floor = B / (weight bytes a step reads {W / 1e9:.2f} GB / "
        f"{(bw or 0) / 1e9:.0f} GB/s, section a's ceiling).  floor+KV adds the KV bytes one decode step must read at "
        f"least: shared = the shared context once plus each request's own tokens; private = every "
        f"request's whole context ({kvt / 1024:g} KB/token).  'shared: sum of per-request tok/s' sums "
        f"`metrics.decode_tokens_per_s` (a cross-check).",
        (f"Private contexts: each request holds its own {ctx}-token context ({res.get('per_req_pages')} "
         f"pages with its own tokens); the pool ({res.get('pool_pages')} pages of {ps} tokens) holds at most "
         f"B = {res.get('cap')} of them, so larger B are not run privately." if res.get("cap") is not None
         else "Private contexts: not run (`--e-modes` left them out)."), ""])


# ---------------------------------------------------------------- (f) TTFT under arrivals


def pool_pages(b: EngineBench) -> int | None:
    """Pages for section e's engines: as many as fit in the device memory this process has left
    (after the weights, with 8 GiB of headroom for step activations), capped at what the private case
    at the largest batch can use; the settings' fixed pool where the device reports no memory."""
    import jax

    s = b.s
    per_page = kv_token_bytes(b.cfg, b.base_config.get("kv_dtype")) * 16
    if s.get("kv_budget_gb"):  # a fixed KV budget: the same bytes hold 2D / (D + 4) as many pages when compressed
        pages = 1 + int(s["kv_budget_gb"] * 1e9 // per_page)
        log(f"pool: {pages - 1} pages ({(pages - 1) * per_page / 1e9:.1f} GB of "
            f"{b.base_config.get('kv_dtype') or 'bfloat16'} KV, the --kv-budget-gb)")
        return pages
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return s["hbm_pages"]
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - (8 << 30)
    per_req = -(-s["e_ctx"] // 16) + -(-(s["e_ctx"] + s["e_q"] + s["e_max_tokens"]) // 16) - s["e_ctx"] // 16
    want = max(s["e_Bs"]) * per_req + 512
    pages = 1 + max(s["hbm_pages"] - 1, min(want, free // per_page))
    log(f"pool: {pages - 1} pages ({(pages - 1) * per_page / 1e9:.1f} GB of KV; device limit "
        f"{stats['bytes_limit'] / 1e9:.1f} GB, in use {stats.get('bytes_in_use', 0) / 1e9:.1f} GB)")
    return pages


def run_case(b: EngineBench, eng, key, B, make_reqs, ctx, mt, res):
    """One (case, B) point into ``res[key][B]``; a failure is reported and the other points go on."""
    try:
        r = best_of(b, eng, make_reqs, b.s["e_reps"], f"{key} B={B}")
    except Exception:  # noqa: BLE001 - report, go on with the other batch sizes
        tb = traceback.format_exc()
        log(tb)
        b.failures.append(f"batch_decode ({key}, B={B}): {tb.strip().splitlines()[-1]}")
        return
    bad = sum(c != ctx for c in r["cached"])
    if bad:
        b.failures.append(f"e {key} B={B}: cached_tokens != {ctx} in {bad}/{B} requests")
    if r["generated"] != B * mt:
        b.failures.append(f"e {key} B={B}: generated {r['generated']} != {B * mt}")
    res[key][B] = r
    log(f"  {key:7s} B={B:4d}: {r['tok_s']:.0f} tok/s ({ms(r['step'])} ms/step over "
        f"{r['steps_win']} steps; runs {[round(x) for x in r['tok_s_all']]}), all first tokens "
        f"{ms(r['all_first'])} ms, preemptions {r['preemptions']}")


@section
def batch_decode(b: EngineBench, modes=("plain", "cascade", "private"), profile_step=False):
    """e. Decode tokens/s at batch B: one shared segment (plain and cascade decode engines) vs a
    private context per request vs the weight-read floor."""
    s = b.s
    ps = b.base_config["page_size"]
    ctx, q, mt, Bs = s["e_ctx"], s["e_q"], s["e_max_tokens"], s["e_Bs"]
    res = {"shared": {}, "cascade": {}, "private": {}}
    b.R["batch"] = res
    b.drop_engine()  # the earlier sections' engine and segments: the pool below takes their memory
    pages = pool_pages(b)
    shared_ids = b.fresh(ctx)

    def reqs(B, segs):
        return [dict(prompt_token_ids=b.fresh(q), segments=[segs[i % len(segs)]], sampling=greedy(mt))
                for i in range(B)]

    for mode in [m for m in ("cascade", "plain") if m in modes or (m == "plain" and "private" in modes)]:
        eng = b.engine(hbm_pages=pages, cascade_decode=mode == "cascade")
        key = "shared" if mode == "plain" else "cascade"
        t0 = time.perf_counter()
        eng.register_segment("shared_ctx", token_ids=shared_ids)
        log(f"  {mode} engine: registered shared_ctx ({ctx} tokens): {time.perf_counter() - t0:.2f} s")
        private: list[str] = []
        held = ["shared_ctx"]
        try:
            if mode in modes:
                for B in Bs:
                    run_case(b, eng, key, B, lambda B=B: reqs(B, ["shared_ctx"]), ctx, mt, res)
            if mode == "cascade" and profile_step and max(Bs) in res["cascade"]:
                profile_decode(eng, lambda: reqs(max(Bs), ["shared_ctx"]), max(Bs))
            if mode == "plain" and "private" in modes:
                b.drop_segments(eng, held)
                held.clear()
                # private: as many B as the pool holds (segment pages + each request's own pages)
                per_req = -(-ctx // ps) + -(-(ctx + q + mt) // ps) - ctx // ps
                free = eng.pool.num_free
                cap = int((free * 0.98) // per_req)
                res["cap"], res["per_req_pages"], res["pool_pages"] = cap, per_req, eng.pool.num_pages - 1
                pBs = [B for B in Bs if B <= cap]
                log(f"  private: {per_req} pages per request, {free} free pages of {eng.pool.num_pages - 1}: "
                    f"up to B={cap}; running B in {pBs}")
                try:
                    private_runs(b, eng, res, pBs, private, reqs, ctx)
                except Exception:  # noqa: BLE001 - keep the shared numbers; report the private failure
                    tb = traceback.format_exc()
                    log(tb)
                    b.failures.append(f"batch_decode (private case): {tb.strip().splitlines()[-1]}")
        finally:
            b.drop_segments(eng, private + held)
        eng = None  # noqa: F841 - the next engine's pool needs this one's memory (EngineBench.engine drops it)
    b.drop_engine()
    shared_decode_table(b, res, ps)
