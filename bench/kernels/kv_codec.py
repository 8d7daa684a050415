"""Does a lossless codec pay on KV bytes?  Compression ratio and speed on real KV pages (issue 17, item 5).

Usage (from the repository root)::

    python bench/kernels/kv_codec.py --model /tmp/small-lm-cpu --out bench/results    # a trained checkpoint
    python bench/kernels/kv_codec.py --out /tmp/kvc                                   # random weights (says little)

An engine per KV dtype (the model's bf16, int8, float8_e4m3fn) registers one segment of ``--tokens`` tokens
(with ``--model``: held-out English text, as ``bench/kernels/kv_dtype.py`` draws it); its KV block is copied out
as the host and disk tiers and snapshots hold it (``Tiers.host_copies``; without the zero pages that pad
a block to its page bucket), and each codec compresses it: zlib (deflate, the standard library's; level 1 and 6), alone and after a byte-plane shuffle (the bytes
of each value split into planes - the high bytes of bf16 hold sign and exponent, which repeat - the
transform Blosc and tensorstore's shuffle filters apply).  Reported: ratio (raw / compressed), compress
and decompress GB/s of raw bytes on one core, and what the ratio would save against the disk tier's
measured read rate (1.3 GB/s on the H200 machine, ``bench/results/tiers.md``): it pays only when
decompressing is faster than reading the bytes it saves would have been.  Writes ``kv_codec.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from kv_dtype import model_for, text_tokens  # noqa: E402  (bench/kernels/kv_dtype.py)
from report import MD, finish, log, table  # noqa: E402  (bench/lib/report.py)

DISK_READ_GBS = 1.3  # the disk tier's read rate on the H200 machine (bench/results/tiers.md)


def shuffle(raw: bytes, itemsize: int) -> bytes:
    """Byte planes: every value's byte 0, then every byte 1, ... (lossless; its inverse is a transpose)."""
    a = np.frombuffer(raw, np.uint8)
    return a.reshape(-1, itemsize).T.tobytes() if itemsize > 1 else raw


def timed(fn, reps=3):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--model", default=None, help="an HF checkpoint folder (default: random weights)")
    ap.add_argument("--corpus-mb", type=float, default=24.0, help="--model: its training's --corpus-mb")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    t0 = time.time()
    from inferscale_jax import Engine, EngineConfig

    cfg, params = model_for(args)
    tokens = text_tokens(args, cfg, np.random.default_rng(5), args.tokens)
    rows = []
    for kv_dtype in (None, "int8", "float8_e4m3fn"):
        e = Engine(params, cfg, None, EngineConfig(dtype="bfloat16", page_size=16, kv_dtype=kv_dtype,
                                                   hbm_pages=8 + args.tokens // 16, prefill_chunk=512))
        e.register_segment("s", token_ids=tokens)
        block = e.kv.tiers.host_copies(e.kv.store.all_segments())
        seg = e.kv.store.all_segments()[0]
        pages = -(-(len(e.bos_prefix) + len(seg.token_ids)) // 16)  # the block is padded to a page bucket
        arr = np.ascontiguousarray(next(iter(block.values()))[:, :, :, :pages])
        # a block's rows: bf16 values, or (compressed KV) D bytes + a float32 scale: planes of the values
        itemsize = 2 if kv_dtype is None else 1
        raw = arr.tobytes()
        name = kv_dtype or "bfloat16"
        for shuffled in (False, True):
            data = shuffle(raw, itemsize) if shuffled else raw
            for level in (1, 6):
                comp, tc = timed(lambda: zlib.compress(data, level))
                back, td = timed(lambda: zlib.decompress(comp))
                assert back == data
                ratio = len(raw) / len(comp)
                saved_s = (len(raw) - len(comp)) / (DISK_READ_GBS * 1e9)  # read time the ratio saves
                rows.append([name, f"zlib {level}" + (" + byte planes" if shuffled else ""), f"{len(raw) / 1e6:.1f}",
                             f"{ratio:.3f}", f"{len(raw) / tc / 1e9:.2f}", f"{len(raw) / td / 1e9:.2f}",
                             "yes" if td < saved_s else "no"])
                log(f"  {name} zlib {level} shuffled={shuffled}: ratio {ratio:.3f}, "
                    f"{len(raw) / tc / 1e9:.2f} / {len(raw) / td / 1e9:.2f} GB/s")
        e.close()
    table(f"Lossless codecs on one segment's KV block ({args.tokens} tokens, "
          f"{'model ' + args.model if args.model else 'random weights'}), one CPU core",
          ["pages", "codec", "MB raw", "ratio", "compress GB/s", "decompress GB/s",
           f"pays vs a {DISK_READ_GBS} GB/s disk read"], rows)
    MD.extend(["'pays': decompressing takes less time than reading the bytes the codec saved would have.", ""])
    finish(args.out, "kv_codec.md", "Lossless codecs on KV pages", t0, ROOT)


if __name__ == "__main__":
    main()
