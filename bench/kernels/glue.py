"""GPU benchmark of a layer's glue: the residual add + RMSNorm after each output projection, and RoPE.

Usage (from the repository root)::

    python bench/kernels/glue.py                       # H200 / H100: ~1-2 minutes
    python bench/kernels/glue.py --rows 256,512 --variants r1,w4 r2,w8
    python bench/kernels/glue.py --smoke --out /tmp/g   # tiny shapes on the CPU (interpret mode)

Llama-3-8B shape (hidden 4096, intermediate 14336, 32 q heads, 8 kv heads, head_dim 128, bf16), a step's
N token rows (64 / 128 / 256 / 512 / 2048: the engine's decode and mixed buckets).  Each case is what one layer
runs between two matmuls, timed together with the matmul that feeds it (XLA may fold the residual add into
that matmul's epilogue, so the glue alone would not be the engine's work):

* ``o``: ``x + attn @ wo`` then ``rms_norm`` (the attention half's end and the MLP's norm);
* ``down``: ``x + act @ w_down`` then ``rms_norm`` (the MLP's end and the next layer's norm);
* ``rope``: q / k / v out of the fused qkv projection's ``[N, 6144]`` output, RoPE on q and k
  (``models/transformer.py``'s ``project_qkv`` less the matmul), as jnp and as one kernel
  (``pallas_kernels/rope.py``, ``--rope-variants``: ``tN`` tokens a program, ``wN`` warps).

Forms: ``xla`` is the model's jnp (``models/transformer.py``), ``pallas`` the add + norm in one kernel
(``pallas_kernels/norm.py``: the matmul writes ``delta``, the kernel reads ``x`` and ``delta`` once and writes
the sum and the normalised rows) with ``--variants`` of its knobs (``rN`` rows a program, ``wN`` warps).  Every
output is checked against ``xla`` (bf16 tolerance).  Floor: the longer of the matmul's FLOPs at the run's matmul
ceiling and the bytes the case must move (the weights, the matmul's input, x; the sum and the normalised rows out)
at the read ceiling.  The weights are one array across the timed input sets, so they come from the GPU's L2 after
the first call: at 64-256 rows, where the matmul is bound by reading them, a device time can fall under the floor
(run AY's file predates the weights in the floor: it added compute and the glue's bytes).  Timing as
``bench/kernels/kernels.py`` (R input sets in one executable, median) and the GPU's kernel time of the same
executable.  Writes ``glue.md`` and ``glue.png`` to ``--out``.
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
from report import FAILURES, finish, log, log_timed, plot_forms_by_rows, table  # noqa: E402

from pallas_kernels.norm import add_rms_norm_pallas, add_rms_norm_ref  # noqa: E402
from pallas_kernels.rope import qkv_rope_pallas, qkv_rope_ref  # noqa: E402

SHAPES = {"full": dict(h=4096, inter=14336, hq=32, hkv=8, d=128, reps=8),
          "smoke": dict(h=64, inter=128, hq=4, hkv=2, d=16, reps=2)}
EPS = 1e-5
RESULTS = []  # (case, rows, form, us, device us, floor us)


def _knobs(variant: str) -> dict:
    out = {}
    for part in filter(None, variant.split(",")):
        key, val = part[0], int(part[1:])
        out[{"r": "block_rows", "w": "num_warps", "t": "block_tokens"}[key]] = val
    return out


def _norm_case(name, n, k, cfg, forms, args, key):
    """x + a @ w then rms_norm, by form; a [N, k], w [k, H]."""
    h = cfg["h"]
    ks = jax.random.split(key, 4)
    w = (jax.random.normal(ks[0], (k, h), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    g = (1 + 0.1 * jax.random.normal(ks[1], (h,))).astype(jnp.bfloat16)
    inputs = [(jax.random.normal(jax.random.fold_in(ks[2], r), (n, h), jnp.bfloat16),
               jax.random.normal(jax.random.fold_in(ks[3], r), (n, k), jnp.bfloat16)) for r in range(cfg["reps"])]

    def xla(w, g, x, a):
        return add_rms_norm_ref(x, a @ w, g, EPS)

    def pallas(knobs):
        def call(w, g, x, a):
            return add_rms_norm_pallas(x, a @ w, g, EPS, **knobs)
        return call

    # the matmul's FLOPs or its bytes (weights, a, x; the sum and normed rows out), whichever is longer; the weights
    # are one array for every input set, so past the first call they come from L2 (device times under the floor)
    floor = max(2 * n * k * h / args.tflops, (k * h + n * k + 3 * n * h) * 2 / args.ceiling)
    ref_box = [None]  # the xla form's outputs, once run
    for form in forms:
        _run(name, n, form, xla if form == "xla" else pallas(_knobs(form)), (w, g), inputs, floor, cfg, ref_box)


def _rope_case(n, cfg, forms, args, key):
    """q, k, v out of qkv [N, (Hq + 2 Hkv) D], RoPE on q and k: the model's jnp, then the kernel by knob."""
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    freq = 1.0 / (500000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    inputs = [(jax.random.normal(jax.random.fold_in(key, r), (n, (hq + 2 * hkv) * d), jnp.bfloat16),
               jnp.arange(n, dtype=jnp.int32) * 7 + 4096 + r) for r in range(cfg["reps"])]

    def xla(freq, qkv, pos):
        return qkv_rope_ref(qkv, pos, freq, hq, hkv)

    def pallas(knobs):
        def call(freq, qkv, pos):
            return qkv_rope_pallas(qkv, pos, freq, hq, hkv, **knobs)
        return call

    floor = 2 * n * (hq + 2 * hkv) * d * 2 / args.ceiling
    ref_box = [None]
    for form in forms:
        _run("rope", n, form, xla if form == "xla" else pallas(_knobs(form)), (freq,), inputs, floor, cfg, ref_box)


def _run(name, n, form, call, shared, inputs, floor, cfg, ref_box):
    try:
        t, outs, t_dev, kt = time_calls_and_device(call, shared, inputs, cfg["reps"])
    except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others still run
        log(f"  {name} N={n} {form}: failed ({type(err).__name__}: {str(err)[:200]})")
        FAILURES.append(f"{name} N={n} {form}: {type(err).__name__}")
        return
    if ref_box[0] is None:
        ref_box[0] = outs
    else:
        for a, b in zip(jax.tree.leaves(outs), jax.tree.leaves(ref_box[0])):
            check(f"{name} N={n} {form}", a.astype(jnp.float32), b.astype(jnp.float32), 2e-2)
    log_timed(f"{name} N={n} {form}", t, t_dev, floor, kt)
    RESULTS.append((name, n, form, t * 1e6, t_dev * 1e6, floor * 1e6))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (the CPU): the harness only")
    ap.add_argument("--rows", default="64,128,256,512,2048")
    ap.add_argument("--variants", nargs="*", default=["r1,w4", "r2,w8", "r4,w8", "r4,w16"],
                    help="the add + norm kernel's knobs: rN rows a program, wN warps")
    ap.add_argument("--rope-variants", nargs="*", default=["t8,w4", "t16,w4", "t32,w4", "t32,w8"],
                    help="the qkv + RoPE kernel's knobs: tN tokens a program, wN warps")
    args = ap.parse_args()
    cfg = SHAPES["smoke" if args.smoke else "full"]
    t0 = start_kernel_bench(args, log)
    forms = ["xla"] + list(args.variants)
    key = jax.random.PRNGKey(0)
    rows = [int(r) for r in args.rows.split(",")] if not args.smoke else [5, 16]
    for n in rows:
        _norm_case("o", n, cfg["h"], cfg, forms, args, jax.random.fold_in(key, n))
        _norm_case("down", n, cfg["inter"], cfg, forms, args, jax.random.fold_in(key, n + 1))
        _rope_case(n, cfg, ["xla"] + list(args.rope_variants), args, jax.random.fold_in(key, n + 2))
    table("A layer's glue with the matmul that feeds it (us; device: the GPU's kernel time)",
          ["case", "rows", "form", "call us", "device us", "floor us", "device x floor"],
          [(c, n, f, f"{t:.1f}", f"{td:.1f}", f"{fl:.1f}", f"{td / fl:.2f}") for c, n, f, t, td, fl in RESULTS])
    plot_forms_by_rows(RESULTS, args.out, "glue.png", "token rows", lambda r: r[4] / r[5])
    finish(args.out, "glue.md", "A layer's glue: residual add + RMSNorm, RoPE", t0, ROOT,
           [f"read ceiling {args.ceiling / 1e12:.2f} TB/s, matmul ceiling {args.tflops / 1e12:.0f} TFLOP/s"])


if __name__ == "__main__":
    main()
