"""End-to-end engine benchmark: TTFT with injected segments, full prefill, decode, the HF peer, batches,
arrivals and injection modes - one run, one report.

Usage (from the repository root)::

    python bench/engine/engine_bench.py --out bench/results              # H200, Llama-3-8B shape, ~8 min
    python bench/engine/engine_bench.py --quick --out /tmp/eq            # tiny model on CPU, ~2 min
    python bench/engine/engine_bench.py --sections abcd                  # only some sections
    python bench/engine/engine_bench.py --sections ef --rates 10,50      # batch decode and arrivals only
    python bench/engine/engine_bench.py --sections e --e-modes private --e-batches 32,64,128 --kv-budget-gb 40 \
        --kv-dtype int8 --out /tmp/e-int8                   # private contexts in 40 GB of int8 KV

Model: Llama-3-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads, d=128, vocab 128256), random bf16
weights generated on the device once (``common.EngineBench.weights``) and shared by every engine of
the run.  Engines: page 16, ``prefill_chunk=2048``, ``min_table_pages=2048``, ``max_batch=128``,
a 5120-page pool (10.7 GB) for sections b/d/f/g; section e builds its own engines (cascade decode on,
then off) with a pool sized from free device memory.  Buckets compile lazily on first use (warm-up
repetitions) except in f, which compiles them all first (``Engine.warmup``); a timed repetition
inside which the engine compiled is dropped and counted (``EngineBench.timed``).

Sections, one module each on ``bench/lib/common.py`` (each guarded: a failure prints its traceback and
the run goes on; the order is a, b, c, d, f, g, e so that e's engines come last):

a. ``bandwidth.py``: copy and read-only bandwidth, the bf16 matmul ceiling.
b. ``ttft.py``: our TTFT for L in {1k, 4k, 16k}: injected segment + 64-token question, full prefill,
   the question alone; floors and MFU.
c. ``hf_peer.py``: HF transformers in the same run: full prefill, prefix reuse eager (cache crop) and
   with ``StaticCache`` + ``torch.compile(mode="reduce-overhead")``, one decode step.
d. ``batch1_decode.py``: decode at batch 1 (generate, synchronous step, replayed device step) vs the floor.
e. ``batch_decode.py``: decode tok/s at batch B over one shared 4k segment (plain and cascade decode)
   vs private contexts vs floors.
f. ``arrivals.py``: TTFT p50/p90/p99 under Poisson arrivals (1000 requests per rate).
g. ``injection_modes.py``: compose / blend / exact TTFT over 3 segments.

Targets (engine.md's table, met or missed): TTFT(4k injected) / TTFT(question alone) <= 1.5; HF full
prefill / ours injected >= 15x at 4k; HF's best prefix reuse / ours injected >= 5x at 4k; decode step
at batch 1 / floor <= 1.3.  Writes ``engine.md``, ``engine.png`` (TTFT) and ``engine_batch.png``
(section e) to ``--out`` and prints the summary last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch (HF peer)

import datetime  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
from arrivals import arrivals  # noqa: E402  (bench/engine/arrivals.py)
from bandwidth import bandwidth  # noqa: E402  (bench/engine/bandwidth.py)
from batch1_decode import decode  # noqa: E402  (bench/engine/batch1_decode.py)
from batch_decode import batch_decode  # noqa: E402  (bench/engine/batch_decode.py)
from common import EngineBench, ms, ratio  # noqa: E402  (bench/lib/common.py)
from hf_peer import hf_peer, hf_reuse  # noqa: E402  (bench/engine/hf_peer.py)
from injection_modes import modes  # noqa: E402  (bench/engine/injection_modes.py)
from report import FAILURES, MD, code_version, log, pyplot, save_plot, table, write_md  # noqa: E402  (bench/lib/report.py)
from sections import parser, run_sections  # noqa: E402  (bench/lib/sections.py)
from ttft import Q, ttft  # noqa: E402  (bench/engine/ttft.py)


def settings(args):
    if args.quick:
        s = dict(Ls=[64, 256], dec_L=256, chunk=128, min_table=64, hbm_pages=1 + 1024,
                 reps=3, reps_full=2, dec_reps=2, step_reps=5, replay=5, hf_reps=2,
                 max_batch=8,
                 # e: shared vs private context decode
                 e_Bs=[1, 2, 4, 8], e_ctx=256, e_q=16, e_max_tokens=8, e_reps=2,
                 # f: arrivals
                 f_segs=4, f_ctx=128, f_q=Q, f_max_tokens=8, f_n=24, f_rates=[50.0, 200.0],
                 f_prefill_b=8, f_decode_b=8,
                 # g: compose / blend vs exact
                 g_ctx=128, g_cold=2, g_reps=3)
    else:
        s = dict(Ls=[1024, 4096, 16384], dec_L=4096, chunk=2048, min_table=2048,
                 hbm_pages=1 + 5120,  # 81920 tokens: 10.7 GB of bf16 KV (sized from free memory with e)
                 reps=10, reps_full=5, dec_reps=3, step_reps=30, replay=20, hf_reps=5,
                 max_batch=128,
                 e_Bs=[1, 8, 32, 64, 128], e_ctx=4096, e_q=16, e_max_tokens=32, e_reps=3,
                 f_segs=4, f_ctx=2048, f_q=Q, f_max_tokens=16, f_n=1000, f_rates=[10.0, 50.0],
                 f_prefill_b=8, f_decode_b=32,
                 g_ctx=2048, g_cold=3, g_reps=10)
    if args.e_batches:
        s["e_Bs"] = [int(x) for x in args.e_batches.split(",")]
    s["kv_budget_gb"] = args.kv_budget_gb
    if args.rates:
        s["f_rates"] = [float(x) for x in args.rates.split(",")]
    if args.reps:
        s.update(reps=args.reps, reps_full=max(1, args.reps // 2), hf_reps=max(1, args.reps // 2))
    return s


def base_config(args) -> dict:
    s = args.s
    return dict(dtype="bfloat16", page_size=16, hbm_pages=s["hbm_pages"], prefill_chunk=s["chunk"],
                max_batch=s["max_batch"], min_table_pages=s["min_table"], overlap_decode=not args.no_overlap,
                kv_dtype=args.kv_dtype)


def targets(R, args):
    """[target, ours, peer or ceiling, ratio, goal, verdict] rows."""
    L = args.s["dec_L"]
    inj = R.get("ours", {}).get(L, {}).get("inj", (None, None))[0]
    q = R.get("question", (None, None))[0]
    hf = R.get("hf") or {}
    dec = (R.get("decode") or {}).get(f"seg{L} + {Q} injected", {})
    floor = R.get("floor")
    out = []
    for name, ours, peer, peer_name, goal, le in (
            (f"TTFT, {L} injected + {Q} vs the {Q}-token question alone", inj, q, "question alone", 1.5, True),
            (f"TTFT, {L} injected + {Q} vs HF full prefill", inj, hf.get("full", {}).get(L), "HF full prefill", 15, False),
            (f"TTFT, {L} injected + {Q} vs HF prefix reuse (best of eager and StaticCache + compile)", inj,
             hf_reuse(hf, L), "HF reuse", 5, False),
            ("decode step, batch 1, generate, 4k injected", dec.get("gen"), floor, "weight-read floor", 1.3, True),
            ("decode step, batch 1, device (replayed), 4k injected", dec.get("dev"), floor, "weight-read floor", 1.3, True)):
        if ours is None or peer is None:
            out.append([name, ms(ours), ms(peer), "n/a", ("<= " if le else ">= ") + str(goal), "n/a"])
            continue
        val = ours / peer if le else peer / ours
        met = val <= goal if le else val >= goal
        out.append([name, f"{ms(ours)} ms", f"{peer_name} {ms(peer)} ms", f"{val:.2f}",
                    ("<= " if le else ">= ") + str(goal), "met" if met else "missed"])
    return out


def summary_rows(R, args):
    s = args.s
    hf = R.get("hf") or {}
    q = R.get("question", (None, None))[0]
    rows = []
    for L in s["Ls"]:
        d = R.get("ours", {}).get(L, {})
        inj = d.get("inj", (None, None))[0]
        full = d.get("full", (None, None))[0]
        hff, hfr = hf.get("full", {}).get(L), hf_reuse(hf, L)
        rows.append([L, ms(inj), ms(full), ms(q), ms(hff), ms(hfr), ratio(inj, q), ratio(hff, inj),
                     ratio(hfr, inj)])
    return rows


def new_summaries(R, args):
    """Compact e / f / g tables for the end of the console output."""
    out = []
    b = R.get("batch") or {}
    if b.get("shared"):
        f0 = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
        rows = []
        for B in args.s["e_Bs"]:
            sh, pr = b["shared"].get(B, {}), b["private"].get(B, {})
            ca = (b.get("cascade") or {}).get(B, {})
            fl = (b.get("floor") or {}).get(B, (None, None, None))
            rows.append([B, f0(sh.get("tok_s")), f0(ca.get("tok_s")), ratio(ca.get("tok_s"), sh.get("tok_s")),
                         f0(pr.get("tok_s")) if pr else "-",
                         ratio(sh.get("tok_s"), pr.get("tok_s")), f0(fl[0]), ratio(sh.get("tok_s"), fl[0]),
                         ms(sh.get("step")), ms(ca.get("step")), ms(pr.get("step"))])
        out.append((f"Decode tok/s vs batch (ctx {args.s['e_ctx']}; private up to B={b.get('cap')})",
                    ["B", "shared", "cascade", "ca/sh", "private", "sh/pr", "weight floor", "sh/floor",
                     "sh ms/step", "ca ms/step", "pr ms/step"], rows))
    if R.get("arrival"):
        out.append(("TTFT under Poisson arrivals (ms)", ["rate/s", "p50", "p99", "max", "mean in flight", "compiles"],
                    [[f"{k:g}", ms(r["p50"]), ms(r["p99"]), ms(r["max"]), f"{r['in_flight']:.1f}", r["compiles"]]
                     for k, r in R["arrival"].items()]))
    if R.get("modes"):
        base = R["modes"].get("exact, warm chain", {}).get("ttft")
        out.append(("TTFT by injection mode, 3 segments (ms)", ["request", "ttft", "/ exact warm"],
                    [[k, ms(d["ttft"]), ratio(d["ttft"], base)] for k, d in R["modes"].items()]))
    return out


def plot_batch(R, args, plt, dev):
    b = R.get("batch") or {}
    if not b.get("shared"):
        return
    Bs = args.s["e_Bs"]
    fig, ax = plt.subplots(figsize=(7, 4.8))

    def line(d, key, **kw):
        xs = [B for B in Bs if d.get(B) is not None and (d[B] if key is None else d[B].get(key)) is not None]
        ys = [d[B] if key is None else d[B][key] for B in xs]
        if xs:
            ax.plot(xs, ys, **kw)

    line(b["shared"], "tok_s", marker="o", label=f"shared {args.s['e_ctx']}-token context, plain decode")
    line(b.get("cascade") or {}, "tok_s", marker="^", label="shared context, cascade decode")
    line(b["private"], "tok_s", marker="s", label=f"private contexts (pool holds B <= {b.get('cap')})")
    fl = b.get("floor") or {}
    line({B: v[0] for B, v in fl.items()}, None, ls="--", color="k", label="weight-read floor")
    line({B: v[1] for B, v in fl.items()}, None, ls=":", color="C0", label="floor: weights + shared KV once")
    line({B: v[2] for B, v in fl.items()}, None, ls=":", color="C1", label="floor: weights + private KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(Bs, [str(B) for B in Bs])
    ax.set_xlabel("batch (requests decoding together)")
    ax.set_ylabel("decode tokens/s (log scale)")
    ax.set_title(f"Decode throughput, {dev.device_kind}, {'tiny model' if args.quick else 'Llama-3-8B shape bf16'}")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    save_plot(fig, args.out, "engine_batch.png")


def write_report(R, args, total_s):
    dev = jax.devices()[0]
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    head = [f"# Engine benchmark ({'quick, tiny model' if args.quick else 'Llama-3-8B shape, random bf16'})",
            "", f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
            f"- command: `python {cmd}`", f"- code: {code_version()}",
            f"- engines built: {args.bench.engines_built}, compiles over all of them: {args.bench.compiles_total}, "
            f"timed repetitions dropped because they compiled: {args.bench.dropped_reps}",
            f"- total time: {total_s:.0f} s"]
    hf = R.get("hf") or {}
    if hf:
        head.append(f"- HF peer: transformers {hf.get('transformers')}, torch {hf.get('torch')}, "
                    f"{hf.get('device')}, {hf.get('dtype')}, {hf.get('where')}")
    head.append("")
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    summ = ["## Summary: TTFT medians (ms) and ratios", "",
            "| L | ours injected | ours full prefill | question alone | HF full | HF reuse (best of eager, StaticCache + compile) | "
            "inj/question | HF full/inj | HF reuse/inj |", "|" + "---|" * 9]
    summ += ["| " + " | ".join(map(str, r)) + " |" for r in summary_rows(R, args)] + [""]
    summ += ["## Targets", "", "| target | ours | peer / ceiling | ratio | goal | verdict |", "|---|---|---|---|---|---|"]
    summ += ["| " + " | ".join(map(str, r)) + " |" for r in targets(R, args)] + [""]
    b = R.get("batch") or {}
    casc = [B for B in args.s["e_Bs"] if B in b.get("shared", {}) and B in b.get("cascade", {})]
    if casc:
        summ += ["Cascade decode (section e): shared-context decode throughput cascade / plain = " + ", ".join(
            f"{ratio(b['cascade'][B]['tok_s'], b['shared'][B]['tok_s'])} at B={B}" for B in casc) + ".", ""]
    both = [B for B in args.s["e_Bs"] if B in b.get("shared", {}) and B in b.get("private", {})]
    if both:
        summ += ["Shared vs private context (section e): decode throughput shared / private = " + ", ".join(
            f"{ratio(b['shared'][B]['tok_s'], b['private'][B]['tok_s'])} at B={B}" for B in both)
            + f"; private runs stop at B={b.get('cap')} (pool).", ""]
    write_md(args.out, "engine.md", head + summ + MD)
    plt = pyplot()
    if plt is None:
        return
    try:
        plot_batch(R, args, plt, dev)
    except Exception:  # noqa: BLE001
        log("engine_batch.png failed:\n" + traceback.format_exc())
    Ls = args.s["Ls"]
    hf = R.get("hf") or {}
    q = R.get("question", (None, None))[0]
    series = [("ours injected", [R.get("ours", {}).get(L, {}).get("inj", (None,))[0] for L in Ls]),
              ("ours full prefill", [R.get("ours", {}).get(L, {}).get("full", (None,))[0] for L in Ls]),
              ("ours question alone", [q for _ in Ls]),
              ("HF full prefill", [hf.get("full", {}).get(L) for L in Ls]),
              ("HF prefix reuse", [hf_reuse(hf, L) for L in Ls])]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    w = 0.16
    x = np.arange(len(Ls))
    for i, (name, vals) in enumerate(series):
        v = [np.nan if t is None else t * 1e3 for t in vals]
        bars = ax.bar(x + (i - 2) * w, v, w, label=name)
        for b, t in zip(bars, v):
            if np.isfinite(t):
                ax.annotate(f"{t:.0f}" if t >= 10 else f"{t:.1f}", (b.get_x() + b.get_width() / 2, t),
                            ha="center", va="bottom", fontsize=6)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{L} + {Q}" for L in Ls])
    ax.set_xlabel("context tokens + question tokens")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(f"TTFT, {dev.device_kind}, {'tiny model' if args.quick else 'Llama-3-8B shape bf16'}")
    ax.legend(fontsize=7)
    save_plot(fig, args.out, "engine.png")


def main():
    ap = parser(__doc__, "tiny model, runs on CPU")
    ap.add_argument("--sections", default="abcdefg",
                    help="subset of a (ceilings), b (our TTFT), c (HF), d (decode), e (shared vs private context "
                         "decode at batch B), f (TTFT under Poisson arrivals), g (compose/blend vs exact)")
    ap.add_argument("--e-modes", default="plain,cascade,private",
                    help="section e cases: plain (shared context, paged decode), cascade (shared context, "
                         "cascade decode), private (a private context per request)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="EngineConfig(overlap_decode=False): read each decode step before the next")
    ap.add_argument("--profile-step", action="store_true",
                    help="section e: device time by kernel of one cascade run at the largest B")
    ap.add_argument("--e-batches", default=None, help="section e batch sizes, comma separated")
    ap.add_argument("--rates", default=None, help="section f arrival rates, req/s, comma separated")
    ap.add_argument("--reps", type=int, default=None, help="override the TTFT repetitions")
    ap.add_argument("--kv-dtype", default=None, choices=["bfloat16", "int8", "float8_e4m3fn"],
                    help="every engine's EngineConfig.kv_dtype (default: the model's dtype)")
    ap.add_argument("--kv-budget-gb", type=float, default=None,
                    help="section e: the pool holds this many GB of KV whatever the KV dtype (compare how "
                         "many private contexts fit), instead of the device memory left")
    ap.add_argument("--no-hf-child", action="store_true", help="do not retry the HF peer in a child process")
    args = ap.parse_args()
    args.s = settings(args)
    args.bench = EngineBench(args.quick, args.s, base_config(args), log, FAILURES)

    def on_bench(fn, **kw):
        return lambda a: fn(a.bench, **kw)

    plan = [("abdeg", on_bench(bandwidth)), ("b", on_bench(ttft)), ("c", on_bench(hf_peer, no_child=args.no_hf_child)),
            ("d", on_bench(decode)), ("f", on_bench(arrivals)), ("g", on_bench(modes)),
            ("e", on_bench(batch_decode, modes=tuple(args.e_modes.split(",")), profile_step=args.profile_step)),
            (None, lambda a: a.bench.drop_engine())]
    return run_sections(args, plan, summary, note=f"sections {args.sections}  settings {args.s}")


def summary(args, t0):
    """Write the report, then print the summary the lead sees."""
    b = args.bench
    total = time.time() - t0
    R = b.R
    write_report(R, args, total)
    # the last thing printed: the summary the lead sees
    log(f"\nengines built {b.engines_built}, compiles {b.compiles_total}, timed repetitions dropped "
        f"(compiled) {b.dropped_reps}")
    if R.get("decode"):
        rows = [[n, d.get("ctx"), ms(d.get("gen")), ms(d.get("sync")), ms(d.get("dev")), ms(R.get("floor")),
                 ratio(d.get("gen"), R.get("floor")), ratio(d.get("dev"), R.get("floor"))]
                for n, d in R["decode"].items()]
        hf_dec = (R.get("hf") or {}).get("decode")
        if hf_dec:
            rows.append([f"HF transformers, seg{args.s['dec_L']} + {Q} reuse", args.s["dec_L"] + Q, ms(hf_dec),
                         "", "", ms(R.get("floor")), ratio(hf_dec, R.get("floor")), ""])
        table("Decode step, batch 1 (ms)", ["case", "ctx", "generate", "runner.step", "device", "floor",
                                            "gen/floor", "dev/floor"], rows, md=False)
    for title, headers, rows in new_summaries(R, args):
        table(title, headers, rows, md=False)
    log(f"\ncopy bandwidth {b.copy_bw / 1e9:.0f} GB/s, read-only {b.read_bw / 1e9:.0f} GB/s, matmul "
        f"{b.mm_flops / 1e12:.0f} TFLOP/s" if b.copy_bw else "\nceilings n/a")
    table(f"Summary: TTFT medians ms ({jax.devices()[0].device_kind}, total {total:.0f} s)",
          ["L", "ours inj", "ours full", "question", "HF full", "HF reuse", "inj/q", "HFfull/inj",
           "HFreuse/inj"], summary_rows(R, args), md=False)
    table("Targets", ["target", "ours", "peer / ceiling", "ratio", "goal", "verdict"], targets(R, args), md=False)


if __name__ == "__main__":
    sys.exit(main())
