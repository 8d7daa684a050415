"""GPU benchmark of the engine's mixed-step attention with questions over shared segments, by shared-part knob.

Usage (from the repository root)::

    python bench/kernels/mixed_shared.py                          # H200 / H100: ~2 minutes
    python bench/kernels/mixed_shared.py --variants sp=1 br=128,w=8,sp=1
    python bench/kernels/mixed_shared.py --smoke --out /tmp/ms     # tiny shapes on the CPU (interpret mode)

One layer's attention of the two mixed steps the served loop runs (bench/NOTES.md, run AN), Llama-3-8B shape
(32 q heads, 8 kv heads, head_dim 128, page 16, bf16), N = 8 shared segments of 4096 tokens, every row in
its segment's cascade group, as ``inferscale_jax/kv_cache.py``'s ``_mixed`` runs it (the ragged kernel over
each row's own tokens, the grouped kernel's shared part over the segments, the ragged kernel continuing each
group token from the shared part's partials since session 39, ``INFERSCALE_MIXED_MERGE``):

* ``cohort``: the 2048-token bucket of a closed loop's wave: 200 decode rows (own tokens 64-127) and
  28 questions of 64 tokens (1992 tokens, 228 rows of 256);
* ``spread``: the 512-token bucket of spread answer lengths: 250 decode rows and 3 questions (442 tokens,
  253 rows);
* ``c64`` (``--steps c64``): C = 64's 128-token bucket, 61 decode rows and one question (125 tokens, 62 rows of
  64);
* ``c64q3`` (``--steps c64q3``): C = 64's 256-token bucket with three questions, each in its own segment's group
  (61 decode rows, 253 tokens, 64 rows of 64): the step whose shared part run AW's profile found 1.7x the
  one-question step's (bench/NOTES.md, run AW 5).

Each variant sets ``INFERSCALE_MIXED_SHARED`` (``pallas_kernels/common.py``: ``br`` block_rows, ``bk``
block_kv, ``w`` num_warps, ``st`` num_stages, ``sp`` num_splits; ``cb`` / ``cw``: the chunks' tokens in a
launch of their own with ``cb``-row blocks and ``cw`` warps) before tracing (a variant ``INFERSCALE_X=value``
sets that switch instead, e.g. ``INFERSCALE_SHARED_Q=kernel``; parts joined by ``+`` set several, e.g.
``INFERSCALE_SHARED_Q=kernel+w=8``); ``engine`` is the engine's default
(``kv_cache.MIXED_SPLIT_BUCKETS``: since run AV 2 splits from 128 tokens and 1 from 1024, since run AX 3 at
256-511; since run AW, 3
pipeline stages on 64-token bf16 tiles: ``kv_cache.MIXED_SHARED_STAGES``; a variant inherits whatever it does not
set, so ``st=2`` is the old stage count), over the group table the engine's step takes
(``INFERSCALE_MIXED_GROUPS``: the smallest warmed bucket that holds the step's groups by default, 16 for 8
segments; ``max``: the most the step's rows can hold, 64, as in run AV's tables).  ``ragged`` is the ragged
kernel alone over each row's whole page list (no cascade; the engine before run AK).  Every output is
checked against ``engine`` (bf16 tolerance).  Floors: the FLOPs of the attention (4 x query rows x keys x
head_dim, each question token over its segment and its causal prefix) at the run's matmul ceiling, and
the K/V bytes (each segment and own token once) at its read ceiling; ``x floor`` is against the larger.
Timing as ``bench/kernels/kernels.py`` (R input sets compiled into one executable, median), and the GPU's
kernel time of the same executable (the profiler's: no launch gaps).  Writes
``mixed_shared.md`` and ``mixed_shared.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
from cascade_groups import random_pool  # noqa: E402
from common import matmul_ceiling, read_bandwidth  # noqa: E402
from kernels import check, time_calls_and_device  # noqa: E402
from report import FAILURES, finish, log, save_plot, step_axes, table  # noqa: E402
from inferscale_jax import kv_cache  # noqa: E402
from inferscale_jax.buckets import StepBuckets  # noqa: E402

FULL = dict(hq=32, hkv=8, d=128, s=16, seg=4096, segments=8, rows=256, own=(64, 128), question=64, sets=4, reps=10,
            steps=dict(cohort=(200, 28, 2048), spread=(250, 3, 512), c64=(61, 1, 128, 64), c64q3=(61, 3, 256, 64)))
SMOKE = dict(hq=8, hkv=2, d=64, s=8, seg=64, segments=3, rows=16, own=(4, 12), question=8, sets=1, reps=1,
             steps=dict(cohort=(6, 4, 64), spread=(10, 1, 32), c64=(5, 1, 16, 8), c64q3=(5, 2, 32, 8)))
VARIANTS = ("engine", "st=2", "sp=1", "sp=3", "br=128", "br=128,w=8", "br=128,w=8,st=2", "cb=128,cw=8",
            "cb=128,cw=8,cs=4", "cb=128,cw=8,cs=8", "br=128,w=8,sp=1",
            "br=128,bk=128,w=8,sp=1")  # (bk=128: the kernel's 2 stages, kv_cache.py)
RESULTS: list = []  # (step, variant, seconds, floor seconds, device seconds, its top kernels)


def step_case(cfg, decode, questions, tokens, rows=None):
    """The pools and ``cfg['sets']`` input sets of one mixed step (``rows``: its bucket's rows, default
    ``cfg['rows']``): (q [T, Hq, D], the engine's AttnMeta, the whole-page-list AttnMeta, real tokens, flops,
    bytes)."""
    s, seg, n, hq, hkv, d = (cfg[k] for k in ("s", "seg", "segments", "hq", "hkv", "d"))
    rows = cfg["rows"] if rows is None else rows
    lo, hi = cfg["own"]
    qlen = np.array([1] * decode + [cfg["question"]] * questions, np.int32)  # [R real]
    own = np.concatenate([lo + np.arange(decode) % (hi - lo), [cfg["question"]] * questions]).astype(np.int32)
    real = len(qlen)
    assert real <= rows and int(qlen.sum()) <= tokens, (real, int(qlen.sum()), tokens)
    seg_pages = seg // s
    own_pages = -(-own // s)
    width = seg_pages + int(own_pages.max())
    per_set = n * seg_pages + int(own_pages.sum())
    kp, vp = random_pool(jax.random.PRNGKey(tokens), hkv, 1 + cfg["sets"] * per_set, s, d)
    rng = np.random.default_rng(tokens)
    group = np.arange(real) % n
    # the engine's mixed-step group bucket, as ``StepBuckets.key`` picks it (``INFERSCALE_MIXED_GROUPS``)
    buckets = StepBuckets(max_rows=rows, max_tokens=max(rows, tokens), max_pages_per_seq=width)
    gb = next(c for c in buckets.mixed_group_buckets(rows) if c >= n)
    q_lens = np.zeros((rows,), np.int32)
    q_lens[:real] = qlen
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    sets = []
    for i in range(cfg["sets"]):
        ids = 1 + i * per_set + rng.permutation(per_set).astype(np.int32)
        seg_tbl = ids[:n * seg_pages].reshape(n, seg_pages)
        suf = np.zeros((rows, width), np.int32)
        full = np.zeros((rows, width), np.int32)
        at = n * seg_pages
        for r in range(real):
            suf[r, :own_pages[r]] = ids[at:at + own_pages[r]]
            full[r, :seg_pages] = seg_tbl[group[r]]
            full[r, seg_pages:seg_pages + own_pages[r]] = ids[at:at + own_pages[r]]
            at += own_pages[r]
        lens = np.zeros((rows,), np.int32)
        lens[:real] = own
        pages = np.zeros((gb, width), np.int32)
        pages[:n, :seg_pages] = seg_tbl
        glens = np.zeros((gb,), np.int32)
        glens[:n] = seg
        rg = np.full((rows,), -1, np.int32)
        rg[:real] = group
        casc = kv_cache.AttnMeta(slots=None, page_table=jnp.asarray(suf), q_lens=None, kv_lens=jnp.asarray(lens),
                                 cu_q_lens=cu, ragged=True, group_pages=jnp.asarray(pages),
                                 group_lens=jnp.asarray(glens), row_group=jnp.asarray(rg))
        flat = kv_cache.AttnMeta(slots=None, page_table=jnp.asarray(full), q_lens=None,
                                 kv_lens=jnp.asarray(np.where(np.arange(rows) < real, lens + seg, 0), jnp.int32),
                                 cu_q_lens=cu, ragged=True)
        q = jax.random.normal(jax.random.PRNGKey(31 * i + tokens), (tokens, hq, d), jnp.bfloat16)
        sets.append((q, casc, flat))
    keys = qlen * seg + (own - qlen) * qlen + qlen * (qlen + 1) // 2  # each row's query-key pairs
    flops = 4 * hq * d * int(keys.sum())
    nbytes = (n * seg + int(own.sum())) * 2 * hkv * d * 2 + 2 * tokens * hq * d * 2
    return kp, vp, sets, int(qlen.sum()), flops, nbytes


def variant_env(spec: str) -> dict:
    """The environment a variant sets: each ``+``-joined part ``INFERSCALE_X=value`` as that switch, any other part
    as ``INFERSCALE_MIXED_SHARED`` (module docstring; ``""``: the engine's defaults, the knobs left empty)."""
    return dict(part.split("=", 1) if part.startswith("INFERSCALE_") else ("INFERSCALE_MIXED_SHARED", part)
                for part in spec.split("+"))


def run_step(args, cfg, name, decode, questions, tokens, rows=None):
    kp, vp, sets, real, flops, nbytes = step_case(cfg, decode, questions, tokens, rows)
    floor = max(flops / args.tflops, nbytes / args.ceiling)
    log(f"  {name}: {decode} decode rows + {questions} questions = {real} tokens in the {tokens} bucket; "
        f"{flops / 1e9:.1f} GFLOP, {nbytes / 2**20:.0f} MiB; floor {floor * 1e6:.1f} us")

    def attend(k, v, q, meta):  # (the Pallas kernels; interpret mode on the CPU: the smoke run)
        return kv_cache._attend(q[None], k, v, None, meta, "pallas")[0]

    base = None
    for variant in args.variants[:1] + ["ragged"] + args.variants[1:]:  # (every output checked against engine's)
        spec = "" if variant in ("engine", "ragged") else variant
        # a variant "INFERSCALE_X=value" sets that switch instead (e.g. INFERSCALE_SHARED_Q=kernel); parts
        # joined by "+" set several (INFERSCALE_SHARED_Q=kernel+w=8)
        env = variant_env(spec)
        if "+" in spec:
            log(f"  {name} {variant}: sets " + ", ".join(f"{k}={v}" for k, v in env.items()))
        os.environ.update(env)
        try:  # (time_calls jits a new function each call: traced again, reading the switch)
            inputs = [(q, flat if variant == "ragged" else casc) for q, casc, flat in sets]
            t, outs, t_dev, kt = time_calls_and_device(attend, (kp, vp), inputs, cfg["reps"])
        except Exception as err:  # noqa: BLE001 - a variant that does not compile (shared memory) is reported
            log(f"  {name} {variant}: failed ({type(err).__name__}: {str(err)[:200]})")
            FAILURES.append(f"{name} {variant}: {type(err).__name__}: {str(err)[:200]}")
            RESULTS.append((name, variant, float("nan"), floor, float("nan"), ""))
            if variant == "engine":  # (nothing to check the others against)
                return
            continue
        finally:
            for var in env:
                os.environ.pop(var, None)
        out = np.asarray(outs[0][:real], np.float32)
        if variant == "engine":
            base = out
        elif base is not None:
            check(f"{name} {variant} vs engine", out, base)
        top = ", ".join(f"`{k[1][:44]}` {k[2]:.1f}" for k in kt[:3])  # (with cb, two shared launches and ragged)
        RESULTS.append((name, variant, t, floor, t_dev, top))
        log(f"  {name} {variant}: {t * 1e6:.1f} us ({t / floor:.2f}x floor), device {t_dev * 1e6:.1f} us ({top})")
        del outs


def row(step: str, variant: str, t: float, floor: float, t_dev: float, top: str) -> list[str]:
    """A report row: the time, its floor and ratio, and the engine's time over it (NaN: it failed); then the
    same by the GPU's kernel time (the profiler's; empty off the GPU) and the top kernels."""
    if math.isnan(t):
        return [step, variant, "failed", f"{floor * 1e6:.1f}", "", "", "", "", ""]
    engine, engine_dev = next(((r[2], r[4]) for r in RESULTS if r[0] == step and r[1] == "engine"), (math.nan,) * 2)
    dev = not math.isnan(t_dev)
    return [step, variant, f"{t * 1e6:.1f}", f"{floor * 1e6:.1f}", f"{t / floor:.2f}x",
            "" if math.isnan(engine) else f"{engine / t:.2f}x", f"{t_dev * 1e6:.1f}" if dev else "",
            f"{engine_dev / t_dev:.2f}x" if dev and not math.isnan(engine_dev) else "", top]


def plot(out_dir):
    fig, panels = step_axes(RESULTS, 6, 4.5)
    if fig is None:
        return
    for ax, step in panels:
        rows = [r for r in RESULTS if r[0] == step]
        ax.barh([r[1] for r in rows], [r[2] * 1e6 for r in rows], color="tab:blue")
        ax.axvline(rows[0][3] * 1e6, color="k", ls="--", label="floor")
        ax.set_xlabel("us per layer")
        ax.set_title(f"{step} mixed step ({jax.devices()[0].device_kind})", fontsize=9)
        ax.invert_yaxis()
        ax.legend(fontsize=7)
    save_plot(fig, out_dir, "mixed_shared.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (the CPU): the harness only")
    ap.add_argument("--variants", nargs="*", default=None,
                    help=f"INFERSCALE_MIXED_SHARED values to time after 'engine', or another switch as "
                    f"INFERSCALE_X=value (default: {' '.join(VARIANTS[1:])})")
    ap.add_argument("--steps", default="cohort,spread", help="which steps: cohort, spread, c64 (C = 64's 128-token "
                    "bucket: 61 decode rows and one question, 64 rows), c64q3 (its 256-token bucket, three questions)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-ceilings", action="store_true", help="skip measuring the read and matmul ceilings "
                    "(floors read NaN): under a kernel profiler, which need not see their long copies and matmuls")
    args = ap.parse_args()
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["reps"] = args.reps or cfg["reps"]
    args.variants = ["engine"] + (list(VARIANTS[1:]) if args.variants is None else args.variants)
    if args.smoke and args.variants[1:] == list(VARIANTS[1:]):
        args.variants = ["engine", "sp=1", "br=16,sp=2", "cb=32,cw=8"]  # (the CPU's tiny tiles: interpret mode
        # takes minutes)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    log(f"devices: {jax.devices()}  jax {jax.__version__}")
    if args.no_ceilings:
        args.ceiling = args.tflops = math.nan
    else:
        args.ceiling = read_bandwidth(64 << 20 if args.smoke else 2 << 30, reps=cfg["reps"])
        args.tflops = matmul_ceiling(256 if args.smoke else 8192, reps=cfg["reps"])
    log(f"read ceiling {args.ceiling / 1e12:.2f} TB/s, matmul ceiling {args.tflops / 1e12:.0f} TFLOP/s")
    for name in args.steps.split(","):
        run_step(args, cfg, name, *cfg["steps"][name])
    table(f"One layer's attention in the engine's mixed steps over {cfg['segments']} segments of {cfg['seg']} tokens "
          f"(read ceiling {args.ceiling / 1e12:.2f} TB/s, matmul {args.tflops / 1e12:.0f} TFLOP/s)",
          ["step", "variant (INFERSCALE_MIXED_SHARED)", "us", "floor us", "x floor", "vs engine", "device us",
           "device: vs engine", "top kernels (device us)"],
          [row(*r) for r in RESULTS])
    plot(args.out)
    finish(args.out, "mixed_shared.md", "The engine's mixed-step attention by shared-part knob", t0, ROOT,
           [f"- read ceiling {args.ceiling / 1e12:.3f} TB/s, matmul ceiling {args.tflops / 1e12:.0f} TFLOP/s "
            "(this run)"])


if __name__ == "__main__":
    main()
