"""A/B of the paged decode kernel: an older version of ``pallas_kernels/decode_attention.py`` against the
current one, interleaved on the same inputs, calls timed back to back (``common.back_to_back``).

Usage (from the repository root)::

    git show 64ed3dc:pallas_kernels/decode_attention.py > /tmp/decode_old.py
    python bench/kernels/decode_ab.py /tmp/decode_old.py          # H200: bf16 and int8 pages, three shapes, ~20 s
    python bench/kernels/decode_ab.py /tmp/decode_old.py --quick  # CPU (interpret mode): the harness only

Prints, per shape and page dtype, the median time of each version over interleaved rounds, their ratio, and
whether the outputs are bit-identical (a change meant to leave a path alone should give ``True``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import back_to_back, paged_decode_inputs  # noqa: E402  (bench/lib/common.py)

from pallas_kernels.decode_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.quant import quantize_kv  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="a copy of an older pallas_kernels/decode_attention.py")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("decode_old", os.path.abspath(args.old))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    versions = {"old": mod.paged_decode_attention, "new": paged_decode_attention}
    hq, hkv, d, s = (8, 2, 16, 8) if args.quick else (32, 8, 128, 16)
    shapes = [(2, 64)] if args.quick else [(32, 16384), (128, 4096), (32, 32768)]
    interp = jax.default_backend() != "gpu"
    for b, ctx in shapes:
        q, k, v, tbl, lens = paged_decode_inputs(b, ctx, hq, hkv, d, s)
        for name in ("bfloat16", "int8"):
            if name == "int8":
                (kp, ks), (vp, vs) = quantize_kv(k, jnp.int8), quantize_kv(v, jnp.int8)
                scales = dict(k_scale=ks, v_scale=vs)
            else:
                kp, vp, scales = k, v, {}
            fs = {n: jax.jit(lambda q, kp, vp, tbl, lens, sc, f=f: f(q, kp, vp, tbl, lens, interpret=interp, **sc))
                  for n, f in versions.items()}
            outs = {n: jax.block_until_ready(f(q, kp, vp, tbl, lens, scales)) for n, f in fs.items()}
            same = bool(jnp.array_equal(outs["old"], outs["new"]))
            ts = {n: [] for n in fs}
            for _ in range(args.rounds):  # interleaved, so a drift of the machine hits both alike
                for n, f in fs.items():
                    ts[n].append(back_to_back(lambda f=f: f(q, kp, vp, tbl, lens, scales), reps=1, inner=20))
            med = {n: sorted(x)[len(x) // 2] * 1e6 for n, x in ts.items()}
            print(f"B={b} ctx={ctx} {name}: old {med['old']:.1f} us, new {med['new']:.1f} us, "
                  f"new/old {med['new'] / med['old']:.3f}, bit-identical {same}; "
                  f"rounds old {[round(x * 1e6) for x in ts['old']]} new {[round(x * 1e6) for x in ts['new']]}",
                  flush=True)


if __name__ == "__main__":
    main()
