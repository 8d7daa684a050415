"""GPU benchmark of the decode steps' projections: XLA's dot against the skinny-matmul kernel.

Usage (from the repository root)::

    python bench/kernels/skinny_gemm.py                        # H200 / H100: ~2-3 minutes
    python bench/kernels/skinny_gemm.py --rows 64 --variants n32,k128,s4 n64,k64,s4,p2
    python bench/kernels/skinny_gemm.py --smoke --out /tmp/g    # tiny shapes on the CPU (interpret mode)

Llama-3-8B's four projections of a layer (hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128, bf16):
``qkv`` ``[4096, 6144]``, ``o`` ``[4096, 4096]``, ``gate_up`` ``[4096, 28672]``, ``down`` ``[14336, 4096]``, each at
M activation rows (1 / 16 / 64 / 128 / 256: the decode and small mixed steps).  Forms: ``xla`` is the model's
einsum (``models/transformer.py``'s ``_linear``), ``default`` the kernel with ``default_blocks``' knobs
(``pallas_kernels/gemm.py``), and ``--variants`` of its knobs: ``nN`` block_n, ``kN`` block_k, ``sN`` stages,
``wN`` warps, ``pN`` split_k.  Every output is checked against ``xla`` (bf16 tolerance).

Each of the R timed input sets has its own copy of the weight, so every call reads it from HBM as the engine's
steps do (its 32 layers' weights are far past the L2); the floor is the longer of the weight + activation bytes at
the read ceiling and the FLOPs at the matmul ceiling.  Timing as ``bench/kernels/kernels.py`` (R input sets in one
executable, median) and the GPU's kernel time of the same executable.  Writes ``skinny_gemm.md`` and
``skinny_gemm.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
from common import start_kernel_bench  # noqa: E402
from kernels import check, time_calls_and_device  # noqa: E402
from report import FAILURES, finish, log, plot_forms_by_rows, table  # noqa: E402

from pallas_kernels.gemm import matmul_pallas, matmul_ref  # noqa: E402

SHAPES = {"full": dict(cases={"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                              "down": (14336, 4096)}, reps=6),
          "smoke": dict(cases={"qkv": (64, 96), "down": (128, 64)}, reps=2)}
KNOBS = {"n": "block_n", "k": "block_k", "s": "num_stages", "w": "num_warps", "p": "split_k"}
RESULTS = []  # (case, rows, form, us, device us, floor us)


def knobs_of(variant: str) -> dict:
    """``n32,k128,s4`` -> the kernel's keyword arguments (``default``: none)."""
    if variant == "default":
        return {}
    return {KNOBS[part[0]]: int(part[1:]) for part in filter(None, variant.split(","))}


def _case(name, m, k, n, forms, args, cfg, key):
    ws = [(jax.random.normal(jax.random.fold_in(key, r), (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
          for r in range(cfg["reps"])]
    inputs = [(jax.random.normal(jax.random.fold_in(key, 100 + r), (m, k), jnp.bfloat16), w)
              for r, w in enumerate(ws)]
    floor = max((k * n + m * k + m * n) * 2 / args.ceiling, 2 * m * k * n / args.tflops)
    ref = None
    for form in forms:
        if form == "xla":
            def call(x, w):
                return matmul_ref(x, w)
        else:
            knobs = knobs_of(form)

            def call(x, w, knobs=knobs):
                return matmul_pallas(x, w, **knobs)
        try:
            t, outs, t_dev, kt = time_calls_and_device(call, (), inputs, cfg["reps"])
        except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others still run
            log(f"  {name} M={m} {form}: failed ({type(err).__name__}: {str(err)[:200]})")
            FAILURES.append(f"{name} M={m} {form}: {type(err).__name__}")
            continue
        if ref is None:
            ref = outs
        else:
            for a, b in zip(jax.tree.leaves(outs), jax.tree.leaves(ref)):
                check(f"{name} M={m} {form}", a.astype(jnp.float32), b.astype(jnp.float32), 2e-2)
        top = ", ".join(f"{r[1][:40]} {r[2]:.1f}" for r in kt[:3])
        log(f"  {name} M={m} {form}: {t * 1e6:.1f} us, device {t_dev * 1e6:.1f} us, floor {floor * 1e6:.1f} ({top})")
        RESULTS.append((name, m, form, t * 1e6, t_dev * 1e6, floor * 1e6))
    del ws, inputs


def _best_rows():
    """Per (case, rows): XLA's device time, the best kernel form and its time."""
    out = []
    for case, m in dict.fromkeys((r[0], r[1]) for r in RESULTS):
        rows = [r for r in RESULTS if r[0] == case and r[1] == m]
        xla = next((r for r in rows if r[2] == "xla"), None)
        kern = [r for r in rows if r[2] != "xla"]
        if xla is None or not kern:
            continue
        best = min(kern, key=lambda r: r[4] if r[4] == r[4] else r[3])
        xt, bt = (xla[4], best[4]) if xla[4] == xla[4] else (xla[3], best[3])
        out.append((case, m, f"{xt:.1f}", best[2], f"{bt:.1f}", f"{bt / xt:.2f}", f"{xt / xla[5]:.2f}",
                    f"{bt / best[5]:.2f}"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (the CPU): the harness only")
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--cases", default=None, help="comma-separated subset of qkv,o,gate_up,down")
    ap.add_argument("--variants", nargs="*",
                    default=["default", "n32,k128,s4", "n64,k128,s4", "n64,k64,s5", "n32,k256,s3", "n64,k128,s4,p2",
                             "n128,k64,s4", "n64,k128,s4,w8"],
                    help="the kernel's knobs: nN block_n, kN block_k, sN stages, wN warps, pN split_k; default: "
                         "default_blocks' choice")
    args = ap.parse_args()
    cfg = SHAPES["smoke" if args.smoke else "full"]
    t0 = start_kernel_bench(args, log)
    cases = cfg["cases"] if args.cases is None else {c: cfg["cases"][c] for c in args.cases.split(",")}
    rows = [int(r) for r in args.rows.split(",")] if not args.smoke else [1, 5]
    key = jax.random.PRNGKey(0)
    for name, (k, n) in cases.items():
        for m in rows:
            _case(name, m, k, n, ["xla"] + list(args.variants), args, cfg, jax.random.fold_in(key, m * 7 + k + n))
    table("A layer's projections at M rows (us; device: the GPU's kernel time; floor: max(bytes / read ceiling, "
          "FLOPs / matmul ceiling))",
          ["case", "rows", "form", "call us", "device us", "floor us", "device x floor"],
          [(c, m, f, f"{t:.1f}", f"{td:.1f}", f"{fl:.1f}", f"{(td if td == td else t) / fl:.2f}")
           for c, m, f, t, td, fl in RESULTS])
    table("The kernel's best form against XLA's dot (device us)",
          ["case", "rows", "xla", "best form", "best", "best / xla", "xla x floor", "best x floor"], _best_rows())
    plot_forms_by_rows(RESULTS, args.out, "skinny_gemm.png", "activation rows M",
                       lambda r: (r[4] if r[4] == r[4] else r[3]) / r[5])
    finish(args.out, "skinny_gemm.md", "Skinny matmuls: XLA's dot against pallas_kernels/gemm.py", t0, ROOT,
           [f"read ceiling {args.ceiling / 1e12:.2f} TB/s, matmul ceiling {args.tflops / 1e12:.0f} TFLOP/s"])


if __name__ == "__main__":
    main()
