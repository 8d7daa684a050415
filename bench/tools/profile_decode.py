"""Launch the paged decode kernel a few times on bf16 and int8 pages, for a profiler to attach to.

Usage on the GPU machine (Nsight Compute reads hardware counters on the Firecracker runtime only: check
``uname -r`` first - 4.4.0 is gVisor, where ncu fails to initialise)::

    ncu --clock-control none --kernel-name regex:paged_decode --launch-skip 1 --launch-count 4 \
        --set full --import-source yes -o /tmp/decode python bench/tools/profile_decode.py
    ncu --import /tmp/decode.ncu-rep --page details --print-details all > $OUT/decode_ncu.txt
    ncu --import /tmp/decode.ncu-rep --page source --print-source sass > $OUT/decode_sass.txt

``python bench/tools/profile_decode.py --quick`` runs the harness on the CPU (interpret mode).  Each page dtype is
launched ``--launches`` times (the first compiles), bf16 first, then int8, at one shape (B=32 over 16k by
default; ``--batch`` / ``--ctx``): with ``--launch-skip 1 --launch-count 4`` ncu captures bf16's launches 2-3
and int8's 1-2.  What to read (bench/NOTES.md): warp stall reasons (long scoreboard = memory, short scoreboard /
MIO = shared memory, math pipe throttle = the convert), achieved occupancy, and in the SASS the count of
byte-wide shared loads (``LDS.U8``) against ``LDSM`` in the PV dot.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import paged_decode_inputs  # noqa: E402  (bench/lib/common.py)

from pallas_kernels.decode_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.quant import quantize_kv  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    hq, hkv, d, s = (8, 2, 16, 8) if args.quick else (32, 8, 128, 16)
    b, ctx = (2, 64) if args.quick else (args.batch, args.ctx)
    q, k, v, tbl, lens = paged_decode_inputs(b, ctx, hq, hkv, d, s)
    interp = jax.default_backend() != "gpu"
    f = jax.jit(lambda q, kp, vp, sc: paged_decode_attention(q, kp, vp, tbl, lens, interpret=interp, **sc))
    (kq, ks), (vq, vs) = quantize_kv(k, jnp.int8), quantize_kv(v, jnp.int8)
    for name, args_ in (("bfloat16", (k, v, {})), ("int8", (kq, vq, dict(k_scale=ks, v_scale=vs)))):
        for _ in range(args.launches):
            out = jax.block_until_ready(f(q, *args_))
        print(f"{name}: {args.launches} launches, B={b} ctx={ctx}, out[0, 0, :4] {out[0, 0, :4]}", flush=True)


if __name__ == "__main__":
    main()
