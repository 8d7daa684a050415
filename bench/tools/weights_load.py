"""How long ``models.load_params`` takes to read a checkpoint onto the device, one tensor at a time
against several on a thread pool (the largest part of ``serve``'s warm restart after the warm-up).

    python bench/tools/weights_load.py --model /tmp/llama8b --workers 1,4,8

The first load is what a starting server pays: it compiles the per-shape placing ops (on a GPU,
the backend's first programs) and, unless the files were read recently, fills the page cache; its
row says so.  Every timed load after it reads from memory, as a restart on the same machine does.
Each row: seconds to every leaf on the device (``block_until_ready``), and GB/s of checkpoint bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import ModelConfig, load_params  # noqa: E402
from models.loader import safetensors_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", default="1,8", help="comma-separated thread counts to time")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    cfg = ModelConfig.from_pretrained(args.model)
    size = sum(os.path.getsize(p) for p in set(safetensors_files(args.model).values())) / 1e9
    t = time.perf_counter()
    jax.block_until_ready(load_params(args.model, cfg, jnp.bfloat16))  # (primes the page cache, compiles)
    first = time.perf_counter() - t
    print(f"| workers | seconds (best of {args.repeat}) | GB/s |\n| --- | --- | --- |")
    print(f"| default, the first load in this process | {first:.3f} | {size / first:.2f} |", flush=True)
    for w in [int(x) for x in args.workers.split(",")]:
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            p = load_params(args.model, cfg, jnp.bfloat16, workers=w)
            jax.block_until_ready(p)
            best = min(best, time.perf_counter() - t)
            del p
        print(f"| {w} | {best:.3f} | {size / best:.2f} |", flush=True)


if __name__ == "__main__":
    main()
