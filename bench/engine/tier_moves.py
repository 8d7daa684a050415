"""Tier benchmark: promotion bandwidth, snapshot restore and TTFT with the segment in each tier.

Usage (from the repository root)::

    python bench/engine/tier_moves.py --out bench/results        # H200, Llama-3-8B shape, bf16
    python bench/engine/tier_moves.py --quick --out /tmp/tq      # small model on CPU, ~30 s
    python bench/engine/tier_moves.py --quick --dtype float32    # the same in fp32 (CPU scatter is fast in fp32)

Model: Llama-3-8B shape (32 layers, 8 kv heads, d=128: 128 KiB of bf16 KV per token) with
random weights made on the device, or a small model with --quick.  One ``Engine``, page 16.

Sections (each guarded: a failure prints its traceback and the run goes on):

a. Transfer ceilings, same run: a pinned-host array of exactly one L-token segment's KV bytes
   moved to the device with ``jax.device_put`` (the host -> HBM ceiling), and the same bytes
   from a numpy array; the device -> pinned-host copy too.  Median of reps, synced.
b. Promotion host -> HBM of the L-token segment: ``tiers.demote(seg, "host")`` then
   ``kv.promote(seg)`` and a sync of the cache (allocation + one transfer + the jitted
   scatter), median of reps after a warm-up; bandwidth = segment bytes / latency, and as a
   fraction of (a)'s pinned ceiling (target >= 80%).  The engine's own transfer-only figure
   (``stats()["tiers"]["promotion_gbps_last"]``) is listed too.  Also disk -> HBM (the disk
   tier file fsynced and dropped from the page cache with ``posix_fadvise``: a cold read).
c. Snapshot restore disk -> HBM: N segments of L tokens (4 GB on the GPU) registered and saved
   (``save_snapshot``: duration, size), the files dropped from the page cache, then a new
   ``Engine`` on the same ``snapshot_dir``: restore wall time, compile time, GB/s without the
   one-time compile.  The same again with the files in the page cache (hot).
d. TTFT of an L-token segment + a Q-token fresh question, max_tokens=1 (``metrics.ttft_s``, which
   includes the promotion at admission) with the segment in HBM / host / disk (demoted again
   before every rep), and a full prefill of L + Q fresh tokens.

Writes ``tiers.md`` (and ``tiers.png`` when matplotlib is importable) to ``--out``.
"""

from __future__ import annotations

import datetime
import gc
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import model_config, shape  # noqa: E402  (bench/lib/common.py)
from report import FAILURES, MD, code_version, log, pyplot, save_plot, section, table, write_md  # noqa: E402  (bench/lib/report.py)
from sections import parser, run_sections  # noqa: E402  (bench/lib/sections.py)

R: dict = {}
RNG = np.random.default_rng(1234)


def med(xs):
    return statistics.median(xs) if xs else None


def settings(quick):
    if quick:
        return dict(shape=shape(True, hidden=128, inter=256, layers=4, heads=8, kv=8, head_dim=64, max_pos=32768),
                    L=1024, Q=16, n_snap=8, reps=5, chunk=512)
    return dict(shape=shape(False), L=4096, Q=64, n_snap=8, reps=10, chunk=2048)  # 8 x 512 MiB of bf16 KV = 4 GiB


class State:
    params = cfg = engine = None
    seg_bytes = None


ST = State()


def fresh(n):
    return RNG.integers(0, ST.cfg.vocab_size, n).tolist()


def make_engine(args, snapshot_dir=None, pages=None):
    from inferscale_jax import Engine, EngineConfig
    s = args.s
    per_seg = -(-s["L"] // 16)
    pages = pages or 1 + per_seg * (s["n_snap"] + 3)  # the snapshot's segments + requests + headroom
    conf = EngineConfig(dtype=s["dtype"], page_size=16, hbm_pages=pages, prefill_chunk=s["chunk"],
                        min_table_pages=2 * per_seg, snapshot_dir=snapshot_dir, max_batch=8,
                        kv_dtype=s.get("kv_dtype"))
    return Engine(ST.params, ST.cfg, None, conf)


def setup(args):
    from models import init_params
    ST.cfg = model_config(args.s["shape"])
    t0 = time.time()
    ST.params = init_params(ST.cfg, jax.random.PRNGKey(0), dtype=jnp.dtype(args.s["dtype"]))
    jax.block_until_ready(ST.params)
    log(f"params: {sum(x.nbytes for x in jax.tree_util.tree_leaves(ST.params)) / 1e9:.2f} GB in "
        f"{time.time() - t0:.1f} s")
    ST.engine = make_engine(args, pages=1 + 4 * -(-args.s["L"] // 16))
    ST.engine.register_segment("seg", token_ids=fresh(args.s["L"]))
    t = ST.engine.tiers
    # what a tier moves for the segment: its pages' K and V (+ a scale per row when compressed)
    ST.seg_bytes = t.page_nbytes * -(-args.s["L"] // 16)
    log(f"segment: {args.s['L']} tokens, {ST.seg_bytes / 2**20:.1f} MiB of KV; host tier memory kind: "
        f"{t.stats()['host']['memory_kind']}")


def drop_page_cache(path):
    """fsync then POSIX_FADV_DONTNEED every file under path (clean pages leave the page cache)."""
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gbps(nbytes, sec):
    return nbytes / sec / 1e9 if sec else None


def fmt(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


# ---------------------------------------------------------------- (a) ceilings

@section
def ceilings(args):
    e = ST.engine
    t = e.tiers
    shape = t.shape(-(-args.s["L"] // 16))
    key = jax.random.PRNGKey(1)
    if t.block_dtype == np.uint8:  # compressed pages: the tiers move packed bytes (values + scales)
        src = np.asarray(jax.random.bits(key, shape, jnp.uint8))
    else:
        src = np.asarray(jax.random.normal(key, shape, jnp.float32).astype(e.dtype))
    rows = []
    if t.host_sharding is not None:
        pinned = jax.device_put(src, t.host_sharding)
        times = []
        for i in range(args.s["reps"] + 2):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(pinned, t.device_sharding))
            if i >= 2:
                times.append(time.perf_counter() - t0)
        R["pinned_h2d"] = gbps(src.nbytes, med(times))
        rows.append(["pinned host -> device", fmt(med(times) * 1e3), fmt(R["pinned_h2d"])])
        dev = jax.device_put(src, t.device_sharding)
        times = []
        for i in range(args.s["reps"] + 2):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(dev, t.host_sharding))
            if i >= 2:
                times.append(time.perf_counter() - t0)
        R["d2h"] = gbps(src.nbytes, med(times))
        rows.append(["device -> pinned host", fmt(med(times) * 1e3), fmt(R["d2h"])])
    times = []
    for i in range(args.s["reps"] + 2):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(src, t.device_sharding))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    R["numpy_h2d"] = gbps(src.nbytes, med(times))
    rows.append(["numpy -> device", fmt(med(times) * 1e3), fmt(R["numpy_h2d"])])
    table(f"a. Transfer ceilings ({src.nbytes / 2**20:.0f} MiB = one {args.s['L']}-token segment's KV)",
          ["transfer", "median ms", "GB/s"], rows)


# ---------------------------------------------------------------- (b) promotion

@section
def promotion(args):
    e = ST.engine
    seg = e.store.resolve("seg", "default")
    t = e.tiers
    res = {}
    for tier in ("host", "disk"):
        lat, demote_s, engine_gbps = [], [], []
        for i in range(args.s["reps"] + 1):
            d0 = time.perf_counter()
            t.demote(seg, tier)
            demote_s.append(time.perf_counter() - d0)
            if tier == "disk":
                drop_page_cache(t._entries[seg.uid].path)
            t0 = time.perf_counter()
            e.kv.promote(seg)
            jax.block_until_ready(e.runner.cache.k)
            if i:  # the first is the warm-up (compiles)
                lat.append(time.perf_counter() - t0)
                engine_gbps.append(t.stats()["promotion_gbps_last"])
        res[tier] = dict(lat=med(lat), gbps=gbps(ST.seg_bytes, med(lat)), engine=med(engine_gbps),
                         demote=med(demote_s[1:]))
    R["promotion"] = res
    ceiling = R.get("pinned_h2d")
    rows = []
    for tier, r in res.items():
        frac = f"{r['gbps'] / ceiling:.0%}" if ceiling and r["gbps"] else "n/a"
        rows.append([f"{tier} -> HBM", fmt(r["lat"] * 1e3), fmt(args.s["L"] / r["lat"] / 1e6), fmt(r["gbps"]), frac,
                     fmt(r["engine"]) if tier == "host" else "-",
                     f"{fmt(r['demote'] * 1e3)} ms ({fmt(gbps(ST.seg_bytes, r['demote']))} GB/s)"])
    table(f"b. Promotion of one {args.s['L']}-token segment ({ST.seg_bytes / 2**20:.0f} MiB of "
          f"{args.s.get('kv_dtype') or args.s['dtype']} KV); pinned ceiling {fmt(ceiling)} GB/s",
          ["promotion", "median ms", "M tokens/s", "GB/s", "of pinned ceiling", "engine transfer-only GB/s",
           "demotion to that tier"], rows)


# ---------------------------------------------------------------- (c) restore

@section
def restore(args):
    s = args.s
    d = tempfile.mkdtemp(prefix="inferscale-bench-tiers-")
    try:
        ST.engine = None  # free the first engine's pool
        gc.collect()
        e = make_engine(args, snapshot_dir=d)
        for i in range(s["n_snap"]):
            e.register_segment(f"s{i}", token_ids=fresh(s["L"]))
        saved = e.save_snapshot()
        e.close()
        del e
        gc.collect()
        log(f"snapshot: {saved['segments']} segments, {saved['bytes'] / 1e9:.2f} GB of KV "
            f"({saved['disk_bytes'] / 1e9:.2f} GB on disk) in {saved['duration_s']:.2f} s")
        rows = []
        for label, cold in (("cold (page cache dropped)", True), ("hot (page cache)", False)):
            if cold:
                drop_page_cache(os.path.join(d, "snapshots"))
            t0 = time.perf_counter()
            e = make_engine(args, snapshot_dir=d)
            wall = time.perf_counter() - t0
            st = e.stats()["snapshot"]
            busy = st["restore_s"] - st["restore_compile_s"]
            rows.append([label, fmt(wall, 2), fmt(st["restore_s"], 2), fmt(st["restore_compile_s"], 2),
                         fmt(st["restore_read_s"], 2), fmt(gbps(st["restore_bytes"], busy)),
                         f"{st['restored_hbm']} / {st['restored_host']}"])
            R.setdefault("restore", {})[label] = gbps(st["restore_bytes"], busy)
            e.close()
            del e
            gc.collect()
        R["snapshot"] = saved
        table(f"c. Snapshot restore disk -> HBM: {saved['segments']} x {s['L']} tokens = "
              f"{saved['bytes'] / 1e9:.2f} GB (save: {saved['duration_s']:.2f} s, "
              f"{fmt(gbps(saved['bytes'], saved['duration_s']))} GB/s incl. fsync)",
              ["files", "engine construction s", "restore s", "of which compile s", "of which read+check s",
               "GB/s (without compile)", "to HBM / host"], rows)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- (d) TTFT per tier

@section
def ttft(args):
    from inferscale_jax import SamplingParams
    s = args.s
    if ST.engine is None:
        ST.engine = make_engine(args, pages=1 + 4 * -(-s["L"] // 16))
        ST.engine.register_segment("seg", token_ids=fresh(s["L"]))
    e = ST.engine
    seg = e.store.resolve("seg", "default")
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    res = {}
    for tier in ("hbm", "host", "disk", "full prefill"):
        times = []
        for i in range(s["reps"] + 1):
            if tier in ("host", "disk"):
                e.tiers.demote(seg, tier)
                if tier == "disk":
                    drop_page_cache(e.tiers._entries[seg.uid].path)
            if tier == "full prefill":
                out = e.generate(prompt_token_ids=fresh(s["L"] + s["Q"]), sampling=sp)
            else:
                out = e.generate(prompt_token_ids=fresh(s["Q"]), segments=["seg"], sampling=sp)
                assert out.metrics.cached_tokens == s["L"], out.metrics
            if i:
                times.append(out.metrics.ttft_s)
        res[tier] = med(times)
    R["ttft"] = res
    base = res["full prefill"]
    table(f"d. TTFT: {s['L']}-token segment + {s['Q']}-token question (median of {s['reps']})",
          ["segment in", "TTFT ms", "vs full prefill"],
          [[k, fmt(v * 1e3), f"{v / base:.2f}x" if base else "n/a"] for k, v in res.items()])


# ---------------------------------------------------------------- report

def write_report(args, total_s):
    dev = jax.devices()[0]
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    head = [f"# Tier benchmark ({'quick, small model' if args.quick else 'Llama-3-8B shape, random bf16'})", "",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
            f"- command: `python {cmd}`", f"- code: {code_version()}", f"- dtype: {args.s['dtype']}",
            f"- total time: {total_s:.0f} s", ""]
    if dev.platform == "cpu":
        head += ["On the CPU, host and device memory are the same RAM and XLA's scatter of 2-byte types is "
                 "emulated (slow): these figures check the code path; the GPU run measures the tiers.", ""]
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    p, c = R.get("promotion", {}).get("host", {}), R.get("pinned_h2d")
    summ = ["## Summary", "", "| figure | value | target |", "|---|---|---|"]
    if p.get("gbps") and c:
        summ.append(f"| promotion host -> HBM / pinned host -> device | {p['gbps']:.1f} / {c:.1f} GB/s = "
                    f"{p['gbps'] / c:.0%} | >= 80% |")
    for label, v in R.get("restore", {}).items():
        summ.append(f"| snapshot restore disk -> HBM, {label} | {fmt(v)} GB/s | - |")
    for tier, v in R.get("ttft", {}).items():
        summ.append(f"| TTFT, segment in {tier} | {fmt(v * 1e3)} ms | - |")
    summ.append("")
    write_md(args.out, "tiers.md", head + summ + MD)
    plt = pyplot()
    if plt is None:
        return
    try:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        bw = [("pinned->dev\n(ceiling)", R.get("pinned_h2d")), ("numpy->dev", R.get("numpy_h2d")),
              ("promote\nhost->HBM", p.get("gbps")),
              ("promote\ndisk->HBM", R.get("promotion", {}).get("disk", {}).get("gbps"))]
        bw += [(f"restore\n{k.split()[0]}", v) for k, v in R.get("restore", {}).items()]
        bw = [(k, v) for k, v in bw if v]
        bars = ax1.bar([k for k, _ in bw], [v for _, v in bw], color="tab:blue")
        ax1.bar_label(bars, [f"{v:.1f}" for _, v in bw], fontsize=7)
        ax1.set_yscale("log")
        ax1.set_ylabel("GB/s (log scale)")
        ax1.set_title("transfer bandwidth")
        ax1.tick_params(axis="x", labelsize=7)
        tt = [(k, v * 1e3) for k, v in R.get("ttft", {}).items() if v]
        bars = ax2.bar([k for k, _ in tt], [v for _, v in tt], color="tab:orange")
        ax2.bar_label(bars, [f"{v:.1f}" for _, v in tt], fontsize=7)
        ax2.set_ylabel("TTFT ms")
        ax2.set_title(f"TTFT, {args.s['L']}-token segment in ...")
        fig.suptitle(f"{dev.device_kind}, {'small model' if args.quick else 'Llama-3-8B shape bf16'}")
        save_plot(fig, args.out, "tiers.png")
    except Exception:  # noqa: BLE001 - the report is written already
        log("tiers.png failed:\n" + traceback.format_exc())


def main():
    ap = parser(__doc__, "small model, runs on CPU")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="KV and weight dtype (CPU: XLA's bf16 scatter is emulated and slow; float32 is not)")
    ap.add_argument("--kv-dtype", default=None, choices=("int8", "float8_e4m3fn"),
                    help="compressed KV pages (EngineConfig.kv_dtype): the tiers move values + scales")
    ap.add_argument("--sections", default="abcd", help="subset of a (ceilings), b (promotion), c (restore), "
                                                      "d (TTFT per tier)")
    args = ap.parse_args()
    args.s = settings(args.quick)
    args.s["dtype"] = args.dtype
    args.s["kv_dtype"] = args.kv_dtype
    plan = [(None, setup), ("a", ceilings), ("b", promotion), ("d", ttft), ("c", restore)]
    return run_sections(args, plan, lambda a, t0: write_report(a, time.time() - t0), note=f"settings {args.s}")


if __name__ == "__main__":
    sys.exit(main())
