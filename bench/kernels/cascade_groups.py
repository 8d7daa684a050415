"""GPU benchmark of multi-group cascade decode: many shared segments, each read once per step.

Usage (from the repository root)::

    python bench/kernels/cascade_groups.py                      # H200: 36 compiles, meant to take < 5 minutes
    python bench/kernels/cascade_groups.py --smoke --out /tmp/cg  # tiny shapes on the CPU (interpret mode)

One decode step's attention for one layer (Llama-3-8B shape: 32 q heads, 8 kv heads, head_dim 128,
page 16, bf16) at B in {64, 256} rows spread round-robin over N in {1, 8, 64} shared segments of
4096 tokens, each row with its own suffix of 64-127 tokens (a question and its answer so far).
Three ways to run it:

* ``plain``: ``paged_decode_attention`` over each row's whole page list (segment + suffix): every
  row reads its segment.
* ``single``: the engine's former policy - one cascade group (the largest: segment 0's rows) read
  once through ``shared_prefix_decode_attention`` (the grouped kernel at ``G = 1``), every other
  row plain.  ``--old FILE`` adds ``single (old kernel)``: the same call through an older copy of
  ``pallas_kernels/cascade_attention.py`` (e.g. ``git show 777deb8~1:pallas_kernels/cascade_attention.py``),
  whose shared part walked the prefix for every row block of the batch.
* ``multi``: ``grouped_cascade_decode_attention`` with every segment a group, the group count
  padded to the engine's bucket (``inferscale_jax/buckets.py``); ``multi BR=n`` forces the shared
  part's ``block_rows`` (the default is ``default_block_rows``).  At B = 64 over 64 segments
  every group has one row: measured all the same, though the engine leaves such rows plain (a
  group needs two rows).

Mixed steps (``--mixed``, on by default): the same B - 1 decode rows beside one prefill chunk of
512 tokens over 4096 cached ones (its own pages): the ragged kernel over every row's whole page
list (``ragged``) against what the engine runs when the decode rows form cascade groups
(``ragged + multi``: the ragged kernel over the suffixes, then the grouped cascade for the group
rows, ``inferscale_jax/kv_cache.py``'s ``_attend``), at B = 256.

Each strategy is timed against the KV bytes it must read (K and V of every token it reads once,
plus q and the output): ``floor = bytes / read ceiling``, the ceiling measured in the same run
(``common.read_bandwidth``).  ``of ceiling`` is floor / time; ``vs ideal`` is time over the floor of
the least any strategy must read (every segment once + every suffix).  Timing as
``bench/kernels/kernels.py``: R calls on R input sets (own pages, so K/V rotate through more memory than
L2) compiled into one executable, median of the repetitions divided by R; beside it (decode steps) the GPU's kernel
time of the same calls (``kernels.time_calls_and_device``: no dispatch or sync).  Every output is
checked against ``plain`` (bf16 tolerance).  Writes ``cascade_groups.md`` and ``cascade_groups.png``
to ``--out``; exits non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)
from common import read_bandwidth  # noqa: E402
from kernels import check, time_calls, time_calls_and_device  # noqa: E402
from report import finish, log, pyplot, save_plot, section, table  # noqa: E402
from inferscale_jax import kv_cache  # noqa: E402
from inferscale_jax.buckets import StepBuckets  # noqa: E402
from pallas_kernels.cascade_attention import (  # noqa: E402
    grouped_cascade_decode_attention, shared_prefix_decode_attention)
from pallas_kernels.decode_attention import paged_decode_attention  # noqa: E402

FULL = dict(hq=32, hkv=8, d=128, s=16, seg=4096, suffix=(64, 128), rows=(64, 256), segments=(1, 8, 64),
            mixed_rows=256, chunk=512, chunk_ctx=4096,
            block_rows=(32, 64, 128), min_set_bytes=256 << 20, min_sets=4, max_sets=8, reps=10)
SMOKE = dict(hq=8, hkv=2, d=64, s=8, seg=64, suffix=(4, 12), rows=(6,), segments=(1, 3),
             mixed_rows=6, chunk=16, chunk_ctx=32,
             block_rows=(16,), min_set_bytes=0, min_sets=1, max_sets=1, reps=1)
KNOB_NAMES = dict(bk="block_kv", sp="num_splits", w="num_warps", st="num_stages", ssp="suffix_num_splits",
                  fm="fused_merge",  # fm=0: the shared part merged in jnp (before the suffix kernel took it)
                  pf="prefetch")  # pf=0: each tile's page slots computed in its own iteration (both kernels)
DT = jnp.bfloat16
RESULTS: list = []  # (B, N, strategy, seconds, its floor s, the ideal floor s, bytes it must read)
DEVICE: dict = {}  # (B, N, strategy) -> the GPU's kernel seconds per call (kernels.time_calls_and_device; NaN off it)


def random_pool(key, hkv, num_pages, s, d):
    """Random bf16 K and V pools [Hkv, P, S, D], one head at a time (no big float32 temporaries)."""
    @jax.jit
    def make(k):
        return jax.lax.map(lambda kk: jax.random.normal(kk, (num_pages, s, d), DT), jax.random.split(k, hkv))
    k1, k2 = jax.random.split(key)
    return make(k1), make(k2)


def case(b, n, cfg, sets):
    """The pools and ``sets`` input sets of a step of b rows over n segments (own pages per set).

    Returns (k_pages, v_pages, sets) with each set a dict of numpy / jax arrays."""
    s, seg = cfg["s"], cfg["seg"]
    lo, hi = cfg["suffix"]
    seg_pages = seg // s
    suffix = lo + np.arange(b) % (hi - lo)  # [B] suffix tokens of each row
    suf_pages = -(-suffix // s)
    mp = int(suf_pages.max())
    per_set = n * seg_pages + int(suf_pages.sum())
    kp, vp = random_pool(jax.random.PRNGKey(100 * b + n), cfg["hkv"], 1 + sets * per_set, s, cfg["d"])
    rng = np.random.default_rng(b * 1000 + n)
    out = []
    for i in range(sets):
        ids = 1 + i * per_set + rng.permutation(per_set).astype(np.int32)  # pages of this set, shuffled
        seg_tbl = ids[:n * seg_pages].reshape(n, seg_pages)  # [N, seg pages]
        suf_tbl = np.zeros((b, mp), np.int32)
        at = n * seg_pages
        for r in range(b):
            suf_tbl[r, :suf_pages[r]] = ids[at:at + suf_pages[r]]
            at += suf_pages[r]
        group = np.arange(b) % n  # [B] each row's segment
        full = np.concatenate([seg_tbl[group], suf_tbl], axis=1)  # [B, seg pages + MP]
        q = jax.random.normal(jax.random.PRNGKey(7 + 31 * i + b + n), (b, cfg["hq"], cfg["d"]), DT)
        out.append(dict(q=q, seg_tbl=seg_tbl, suf_tbl=suf_tbl, full=full, group=group, suffix=suffix))
    return kp, vp, out


def strategies(b, n, cfg, old):
    """{name: (fn(k_pages, v_pages, *inputs) -> out [B, Hq, D], build(input set) -> inputs)}."""
    seg = cfg["seg"]
    interp = jax.default_backend() != "gpu"
    gb = StepBuckets.groups_for(n)  # the engine's group bucket

    def plain_inputs(st):
        return (st["q"], jnp.asarray(st["full"]), jnp.asarray(st["suffix"] + seg, jnp.int32))

    def plain(k, v, q, full, lens):
        return paged_decode_attention(q, k, v, full, lens, interpret=interp)

    def single_inputs(st):  # group 0 (segment 0's rows) read once, every other row plain
        rows = st["group"] == 0
        table = np.where(rows[:, None], np.pad(st["suf_tbl"], ((0, 0), (0, st["full"].shape[1] - st["suf_tbl"].shape[1]))),
                         st["full"])
        lens = st["suffix"] + np.where(rows, 0, seg)
        return (st["q"], jnp.asarray(st["seg_tbl"][0]), jnp.asarray(table), jnp.asarray(lens, jnp.int32),
                jnp.asarray(rows))

    def single_with(fn):
        def run(k, v, q, shared, table, lens, rows):
            return fn(q, k, v, shared, jnp.int32(seg), table, lens, rows, interpret=interp)
        return run

    def multi_inputs(st):
        pages = np.zeros((gb, st["seg_tbl"].shape[1]), np.int32)
        pages[:n] = st["seg_tbl"]
        glens = np.zeros((gb,), np.int32)
        glens[:n] = seg
        return (st["q"], jnp.asarray(pages), jnp.asarray(glens), jnp.asarray(st["group"], jnp.int32),
                jnp.asarray(st["suf_tbl"]), jnp.asarray(st["suffix"], jnp.int32))

    def multi_with(block_rows, **knobs):
        def run(k, v, q, pages, glens, rg, table, lens):
            return grouped_cascade_decode_attention(q, k, v, pages, glens, rg, table, lens, block_rows=block_rows,
                                                    interpret=interp, **knobs)
        return run

    out = {"plain": (plain, plain_inputs), "single": (single_with(shared_prefix_decode_attention), single_inputs)}
    if old is not None:
        out["single (old kernel)"] = (single_with(old.shared_prefix_decode_attention), single_inputs)
    out["multi"] = (multi_with(None), multi_inputs)
    for br in cfg["block_rows"]:
        out[f"multi BR={br}"] = (multi_with(br), multi_inputs)
    for spec in cfg.get("knobs", ()):  # --knobs: the shared part's other knobs
        knobs = {KNOB_NAMES[k]: (bool(int(v)) if k in ("fm", "pf") else int(v))
                 for k, v in (kv.split("=") for kv in spec.split(","))}
        out[f"multi {spec}"] = (multi_with(None, **knobs), multi_inputs)
    return out


def must_read(b, n, cfg, st, name) -> int:
    """Bytes a strategy must read: K + V of each token it reads once, q and the output."""
    tok = 2 * cfg["hkv"] * cfg["d"] * 2  # K + V of one token, all kv heads, bf16
    seg, suffix = cfg["seg"], st["suffix"]
    qo = 2 * b * cfg["hq"] * cfg["d"] * 2
    if name == "plain":
        tokens = int((seg + suffix).sum())
    elif name.startswith("single"):
        tokens = seg + int(suffix.sum()) + seg * int((st["group"] != 0).sum())
    else:  # multi: every segment that has rows, once
        tokens = seg * len(set(st["group"].tolist())) + int(suffix.sum())
    return tokens * tok + qo


@section
def groups(args, cfg, old):
    for b in cfg["rows"]:
        for n in cfg["segments"]:
            seg_pages, tok = cfg["seg"] // cfg["s"], 2 * cfg["hkv"] * cfg["d"] * 2
            per_set = (n * seg_pages + b * -(-cfg["suffix"][1] // cfg["s"])) * cfg["s"] * tok
            sets = max(cfg["min_sets"], min(cfg["max_sets"], math.ceil(cfg["min_set_bytes"] / per_set)))
            kp, vp, inputs = case(b, n, cfg, sets)
            ideal = must_read(b, n, cfg, inputs[0], "multi")
            base = None
            for name, (fn, build) in strategies(b, n, cfg, old).items():
                t, outs, DEVICE[b, n, name], _ = time_calls_and_device(fn, (kp, vp), [build(st) for st in inputs],
                                                                       cfg["reps"])
                if base is None:
                    base = outs[0]
                else:
                    check(f"B={b} N={n} {name} vs plain", outs[0], base)
                nbytes = must_read(b, n, cfg, inputs[0], name)
                RESULTS.append((b, n, name, t, nbytes / args.ceiling, ideal / args.ceiling, nbytes))
                log(f"  B={b} N={n} {name}: {t * 1e6:.1f} us, must read {nbytes / 2**20:.1f} MiB, "
                    f"floor {nbytes / args.ceiling * 1e6:.1f} us")
                del outs
            del kp, vp, inputs
    rows = []
    plain_t = {(b, n): t for b, n, name, t, *_ in RESULTS if name == "plain"}
    for b, n, name, t, floor, ideal, nbytes in RESULTS:
        dev = DEVICE.get((b, n, name), math.nan)
        rows.append([b, n, name, f"{t * 1e6:.1f}", f"{nbytes / 2**20:.1f}", f"{floor * 1e6:.1f}",
                     f"{floor / t:.0%}", f"{t / ideal:.2f}x", f"{plain_t[b, n] / t:.2f}x",
                     "" if math.isnan(dev) else f"{dev * 1e6:.1f}", "" if math.isnan(dev) else f"{floor / dev:.0%}"])
    table(f"Cascade decode over N shared segments of {cfg['seg']} tokens ({cfg['hq']}/{cfg['hkv']} heads, "
          f"d={cfg['d']}, page {cfg['s']}, bf16, suffixes {cfg['suffix'][0]}-{cfg['suffix'][1] - 1} tokens; "
          f"read ceiling {args.ceiling / 1e12:.2f} TB/s)",
          ["B", "segments", "strategy", "us", "must read MiB", "floor us", "of ceiling", "vs ideal floor",
           "speedup vs plain", "GPU kernel us", "of ceiling by kernel time"], rows)


def mixed_case(b, n, cfg, sets):
    """Inputs of a mixed step: b - 1 decode rows over n segments (as ``case``) and one chunk row of
    ``chunk`` new tokens over ``chunk_ctx`` cached ones, on its own pages.  Per set: (q [N, Hq, D],
    plain AttnMeta, cascade AttnMeta, decode rows' groups [b - 1])."""
    s, seg, chunk, ctx = cfg["s"], cfg["seg"], cfg["chunk"], cfg["chunk_ctx"]
    kp, vp, inputs = case(b - 1, n, cfg, sets)
    own = -(-(ctx + chunk) // s)  # the chunk row's pages
    extra = jnp.asarray(np.arange(sets * own, dtype=np.int32).reshape(sets, own) + kp.shape[1])
    kx, vx = random_pool(jax.random.PRNGKey(9 + b + n), cfg["hkv"], sets * own, s, cfg["d"])
    kp, vp = jnp.concatenate([kp, kx], axis=1), jnp.concatenate([vp, vx], axis=1)
    cu = jnp.asarray(np.concatenate([np.arange(b), [b - 1 + chunk]]), jnp.int32)  # [R + 1]
    out = []
    for i, st in enumerate(inputs):
        q = jnp.concatenate([st["q"], jax.random.normal(jax.random.PRNGKey(i), (chunk, cfg["hq"], cfg["d"]), DT)])
        width = max(st["full"].shape[1], own)
        full = np.zeros((b, width), np.int32)
        full[:b - 1, :st["full"].shape[1]] = st["full"]
        full[b - 1, :own] = np.asarray(extra[i])
        suf = np.zeros((b, width), np.int32)
        suf[:b - 1, :st["suf_tbl"].shape[1]] = st["suf_tbl"]
        suf[b - 1] = full[b - 1]
        lens_full = np.concatenate([st["suffix"] + seg, [ctx + chunk]]).astype(np.int32)
        lens_suf = np.concatenate([st["suffix"], [ctx + chunk]]).astype(np.int32)
        gb = StepBuckets.groups_for(min(64, max(1, b // 2)))  # the engine's mixed-step bucket
        pages = np.zeros((gb, st["seg_tbl"].shape[1]), np.int32)
        pages[:n] = st["seg_tbl"]
        glens = np.zeros((gb,), np.int32)
        glens[:n] = seg
        rg = np.concatenate([st["group"], [-1]]).astype(np.int32)
        plain = kv_cache.AttnMeta(slots=None, page_table=jnp.asarray(full), q_lens=None,
                                  kv_lens=jnp.asarray(lens_full), cu_q_lens=cu, ragged=True)
        casc = kv_cache.AttnMeta(slots=None, page_table=jnp.asarray(suf), q_lens=None, kv_lens=jnp.asarray(lens_suf),
                                 cu_q_lens=cu, ragged=True, group_pages=jnp.asarray(pages),
                                 group_lens=jnp.asarray(glens), row_group=jnp.asarray(rg))
        out.append((q, plain, casc, st["group"], st["suffix"]))
    return kp, vp, out


@section
def mixed(args, cfg):
    b, chunk, ctx, seg = cfg["mixed_rows"], cfg["chunk"], cfg["chunk_ctx"], cfg["seg"]
    tok = 2 * cfg["hkv"] * cfg["d"] * 2
    impl = "pallas" if jax.default_backend() == "gpu" else "ref"  # (interpret mode would take minutes)
    rows = []
    for n in cfg["segments"]:
        sets = cfg["min_sets"]
        kp, vp, inputs = mixed_case(b, n, cfg, sets)
        group, suffix = inputs[0][3], inputs[0][4]
        qo = 2 * (b - 1 + chunk) * cfg["hq"] * cfg["d"] * 2
        plain_bytes = int((seg + suffix).sum() + ctx + chunk) * tok + qo
        casc_bytes = int(seg * len(set(group.tolist())) + suffix.sum() + ctx + chunk) * tok + qo

        def run(k, v, q, meta):
            return kv_cache._attend(q[None], k, v, None, meta, impl)[0]
        t_p, outs_p = time_calls(run, (kp, vp), [(q, p) for q, p, _, _, _ in inputs], cfg["reps"])
        t_c, outs_c = time_calls(run, (kp, vp), [(q, c) for q, _, c, _, _ in inputs], cfg["reps"])
        check(f"mixed B={b} N={n} ragged + multi vs ragged", outs_c[0], outs_p[0])
        for name, t, nbytes in (("ragged", t_p, plain_bytes), ("ragged + multi", t_c, casc_bytes)):
            floor = nbytes / args.ceiling
            rows.append([b, n, name, f"{t * 1e6:.1f}", f"{nbytes / 2**20:.1f}", f"{floor * 1e6:.1f}",
                         f"{floor / t:.0%}", f"{t / (casc_bytes / args.ceiling):.2f}x", f"{t_p / t:.2f}x"])
            log(f"  mixed B={b} N={n} {name}: {t * 1e6:.1f} us, must read {nbytes / 2**20:.1f} MiB")
        del kp, vp, inputs, outs_p, outs_c
    table(f"Mixed step: {b - 1} decode rows over N shared segments of {seg} tokens + one {chunk}-token chunk "
          f"over {ctx} ({impl} kernels)",
          ["B", "segments", "strategy", "us", "must read MiB", "floor us", "of ceiling", "vs ideal floor",
           "speedup vs ragged"], rows)


def plot(out_dir):
    plt = pyplot()
    if plt is None or not RESULTS:
        return
    cases = list(dict.fromkeys((b, n) for b, n, *_ in RESULTS))
    names = list(dict.fromkeys(name for _, _, name, *_ in RESULTS))
    t = {(b, n, name): tt for b, n, name, tt, *_ in RESULTS}
    ideal = {(b, n): i for b, n, _, _, _, i, _ in RESULTS}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    x = np.arange(len(cases))
    for j, name in enumerate(names):
        ax.bar(x + j * width, [t.get((b, n, name), np.nan) * 1e6 for b, n in cases], width, label=name)
    ax.scatter(x + 0.4 - width / 2, [ideal[c] * 1e6 for c in cases], color="k", marker="_", s=400, zorder=3,
               label="ideal floor (each segment once)")
    ax.set_xticks(x + 0.4 - width / 2)
    ax.set_xticklabels([f"B={b}\nN={n}" for b, n in cases])
    ax.set_yscale("log")
    ax.set_ylabel("us per call (log)")
    ax.set_title(f"Cascade decode over N shared segments ({jax.devices()[0].device_kind})", fontsize=9)
    ax.legend(fontsize=7)
    save_plot(fig, out_dir, "cascade_groups.png")


def load_old(path):
    spec = importlib.util.spec_from_file_location("cascade_old", os.path.abspath(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (the CPU): the harness only")
    ap.add_argument("--old", default=None, help="an older copy of pallas_kernels/cascade_attention.py to add")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-mixed", dest="mixed", action="store_false", help="leave out the mixed-step section")
    ap.add_argument("--no-groups", dest="groups", action="store_false", help="leave out the decode-step section")
    ap.add_argument("--rows", help="row counts B, comma-separated (default: 64,256)")
    ap.add_argument("--segments", help="shared segment counts N, comma-separated (default: 1,8,64)")
    ap.add_argument("--knobs", nargs="*", default=[], help="more multi variants, each 'bk=128,w=8,st=3,sp=4,ssp=2,fm=0' "
                    "(block_kv, num_warps, num_stages, num_splits, suffix_num_splits, fused_merge)")
    args = ap.parse_args()
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["reps"] = args.reps or cfg["reps"]
    cfg["knobs"] = args.knobs
    for key in ("rows", "segments"):
        if getattr(args, key):
            cfg[key] = tuple(int(x) for x in getattr(args, key).split(","))
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    log(f"devices: {jax.devices()}  jax {jax.__version__}  interpret={jax.default_backend() != 'gpu'}")
    args.ceiling = read_bandwidth(64 << 20 if args.smoke else 2 << 30, reps=cfg["reps"])
    log(f"read ceiling {args.ceiling / 1e9:.1f} GB/s")
    if args.groups:
        groups(args, cfg, load_old(args.old) if args.old else None)
    if args.mixed:
        mixed(args, cfg)
    plot(args.out)
    finish(args.out, "cascade_groups.md", "Cascade decode over many shared segments", t0, ROOT,
           [f"- read ceiling (common.read_bandwidth, this run): {args.ceiling / 1e12:.3f} TB/s"])


if __name__ == "__main__":
    main()
