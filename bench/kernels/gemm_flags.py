"""The 8B's matmuls at a step's row counts, under each of XLA's GEMM choices.

Usage (from the repository root)::

    python bench/kernels/gemm_flags.py --out bench/results          # H100 / H200: ~3-6 minutes
    python bench/kernels/gemm_flags.py --smoke --out /tmp/gf         # the CPU: the harness only

The graph-mode profiles of the engine's steps (bench/NOTES.md, run AQ) show the same weights read
slower at 64 rows than at one: the decode step's five matmuls take 5.06 ms a step at 1 row and
5.70 ms at 64 (qkv and o at ~2.0 TB/s, 65% of the read ceiling), though at either count they read
the same 16 GB.  XLA picks each GEMM's kernel itself (its Triton GEMM with autotuned tiles and
split-K, or cuBLAS), so the cheapest fix, if there is one, is one of its flags.  This tool times
the model's matmul shapes (``[M, K] x [K, N]`` bf16, N and K of Llama-3-8B's qkv, o, gate-up, down
and lm_head) at the step's row counts, one process per flag set (``XLA_FLAGS`` is read once, when
the backend starts):

- ``default``: XLA as the engine runs it today;
- ``exhaustive``: ``--xla_gpu_exhaustive_tiling_search=true`` (the autotuner tries every Triton tile);
- ``cublas``: ``--xla_gpu_enable_triton_gemm=false`` (cuBLAS for every GEMM).

Each shape runs as ``L`` separate weight arrays in one executable (32, as the model's layers;
lm_head 4), so the weights come from HBM, not L2; ``--reps`` calls go back to back before one wait
(the middle of three such batches), so the host's dispatch and the wait overlap the device's work.
(Run AQ's first version timed each call alone: a call's ~0.4 ms of dispatch and wait was then
counted in 32 matmuls, and at one row the rates came out 1.25x (gate-up) to 1.9x (qkv, o) low.)  The
table gives microseconds per matmul, the read rate (weight bytes / time) against this device's read
ceiling (``bench/lib/common.read_bandwidth``), and the kernel XLA chose (from the optimized HLO);
the last table sums a step's matmuls (32 layers of qkv, o, gate-up and down, one lm_head) per flag
set and row count.  A flag set that fails to start (an unknown flag in this jaxlib) is reported as such.

Writes ``gemm_flags.md`` and ``gemm_flags.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]
from report import finish, log, pyplot, table  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}  # name: (K, N) of Llama-3-8B
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # matmuls of each shape in one step
FLAG_SETS = {"default": "", "exhaustive": "--xla_gpu_exhaustive_tiling_search=true",
             "cublas": "--xla_gpu_enable_triton_gemm=false"}


def kernel_of(hlo: str | None) -> str:
    """The GEMM kind in an optimized HLO module: cuBLAS, or XLA's Triton GEMM (``gemm_fusion`` /
    ``__triton...`` fusions) with its split-K; else the fusion kinds and custom-call targets seen."""
    if not hlo:
        return "no HLO text"
    if re.search(r'custom_call_target="__cublas', hlo):
        return "cuBLAS"
    if re.search(r"gemm_fusion|__triton|triton_gemm", hlo, re.I):
        split = re.search(r'"split_k":"?(\d+)', hlo)
        return f"Triton split-K {split.group(1)}" if split and split.group(1) != "1" else "Triton"
    kinds = sorted(set(re.findall(r'"kind":"([^"]+)"', hlo)) | set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    return "other: " + (", ".join(kinds)[:80] or "none")


def child(rows: list[int], smoke: bool, reps: int) -> None:
    """Time every shape at every row count in this process (its ``XLA_FLAGS``); one JSON line each."""
    import jax
    import jax.numpy as jnp

    from common import read_bandwidth

    scale = 64 if smoke else 1
    ceiling = read_bandwidth(64 << 20 if smoke else 2 << 30)
    print(json.dumps({"ceiling": ceiling}), flush=True)
    key = jax.random.PRNGKey(0)
    for name, (k, n) in SHAPES.items():
        k, n = k // scale, n // scale
        layers = 2 if smoke else (4 if name == "lm_head" else 32)
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02 for i in range(layers)]

        def mats(x, ws):
            return [jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16) for w in ws]

        for m in rows:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.bfloat16)
            exe = jax.jit(mats).lower(x, ws).compile()
            outs = exe(x, ws)
            ref = jnp.dot(x[:1], ws[-1], preferred_element_type=jnp.float32)
            err = float(jnp.max(jnp.abs(outs[-1][:1].astype(jnp.float32) - ref)))
            times = []
            for _ in range(3):  # calls back to back, one wait: the host's dispatch overlaps the device
                t0 = time.perf_counter()
                for _ in range(reps):
                    outs = exe(x, ws)
                jax.block_until_ready(outs)
                times.append((time.perf_counter() - t0) / reps)
            sec = sorted(times)[1] / layers
            print(json.dumps({"shape": name, "m": m, "us": sec * 1e6, "bytes": k * n * 2, "err": err,
                              "kernel": kernel_of(exe.as_text())}), flush=True)
        del ws


def run_set(name: str, flags: str, args) -> dict:
    """Run one flag set's child; its results by (shape, m), the ceiling, or why it failed."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rows", args.rows, "--reps", str(args.reps)]
    if args.smoke:
        cmd.append("--smoke")
    t0 = time.time()
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
        out, err, rc = run.stdout, run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {args.child_timeout} s", -1
    res = {"results": {}, "ceiling": None, "error": None, "seconds": time.time() - t0}
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "ceiling" in d:
                res["ceiling"] = d["ceiling"]
            else:
                res["results"][(d["shape"], d["m"])] = d
    if rc != 0:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        res["error"] = f"rc {rc}: {tail[0][:200]}"
    log(f"  {name} ({flags or 'no flags'}): {len(res['results'])} points, {res['seconds']:.0f} s"
        + (f"; {res['error']}" if res["error"] else ""))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="shapes / 64 and two layers (the CPU): the harness only")
    ap.add_argument("--rows", default=None, help="row counts M (default 1,64,128,256,512; --smoke: 1,4)")
    ap.add_argument("--sets", default=",".join(FLAG_SETS), help=f"flag sets to run, of {','.join(FLAG_SETS)}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child-timeout", type=int, default=240, help="seconds for one flag set's process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rows = args.rows or ("1,4" if args.smoke else "1,64,128,256,512")
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        child(rows, args.smoke, args.reps)
        return
    t0 = time.time()
    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in FLAG_SETS]
    if unknown:
        ap.error(f"--sets {','.join(unknown)}: unknown; choose from {','.join(FLAG_SETS)}")
    got = {s: run_set(s, FLAG_SETS[s], args) for s in sets}
    ceiling = next((g["ceiling"] for g in got.values() if g["ceiling"]), None)
    head = ["shape", "M"] + [f"{s}: us / TB/s / kernel" for s in sets]
    body = []
    for name in SHAPES:
        for m in rows:
            cells = []
            for s in sets:
                d = got[s]["results"].get((name, m))
                cells.append(f"{d['us']:.1f} / {d['bytes'] / d['us'] / 1e6:.3g} / {d['kernel']}" if d else "n/a")
            body.append([name, m] + cells)
    table(f"Microseconds per matmul, weight read rate and XLA's kernel (read ceiling "
          f"{ceiling / 1e12:.2f} TB/s)" if ceiling else "Microseconds per matmul", head, body)
    step_rows, series = [], {s: [] for s in sets}
    scale = 64 * 64 if args.smoke else 1  # (the smoke run's shapes are K / 64 x N / 64)
    floor_ms = (sum(PER_STEP[n] * k * nn * 2 for n, (k, nn) in SHAPES.items()) / scale / ceiling * 1e3
                if ceiling else None)
    for m in rows:
        cells = []
        for s in sets:
            pts = [got[s]["results"].get((n, m)) for n in SHAPES]
            ms = sum(PER_STEP[n] * p["us"] for n, p in zip(SHAPES, pts)) / 1e3 if all(pts) else None
            series[s].append(ms)
            cells.append(f"{ms:.3f}" if ms is not None else "n/a")
        step_rows.append([m] + cells + ([f"{floor_ms:.3f}"] if floor_ms else []))
    table("A step's matmuls (32 x qkv, o, gate-up, down + lm_head), ms, by flag set",
          ["M"] + sets + (["read floor"] if floor_ms else []), step_rows)
    errs = [max((d["err"] for d in g["results"].values()), default=0.0) for g in got.values()]
    table("Flag sets", ["set", "XLA_FLAGS added", "seconds", "max abs error (first row vs jnp.dot)", "error"],
          [[s, FLAG_SETS[s] or "(none)", f"{g['seconds']:.0f}", f"{e:.3g}", g["error"] or ""]
           for (s, g), e in zip(got.items(), errs)])
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in sets:
            pts = [(m, v) for m, v in zip(rows, series[s]) if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        if floor_ms:
            ax.axhline(floor_ms, color="gray", ls="--", label="weight-read floor")
        ax.set(xscale="log", xlabel="rows M", ylabel="ms per step (matmuls only)",
               title="Llama-3-8B matmuls per step by XLA GEMM flags")
        ax.legend()
        fig.tight_layout()
        os.makedirs(args.out, exist_ok=True)
        fig.savefig(os.path.join(args.out, "gemm_flags.png"), dpi=110)
    finish(args.out, "gemm_flags.md", "The 8B's matmuls by XLA GEMM flags", t0, ROOT)


if __name__ == "__main__":
    main()
