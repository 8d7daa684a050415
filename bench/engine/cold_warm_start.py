"""Cold vs warm start with JAX's persistent compilation cache and the executable store.

Three fresh processes run the same fixed workload on the same model shape with one new, empty
cache folder: the first compiles every step bucket the workload touches and writes it to the
folder (*cold*: JAX's cache and ``exe_store.py``'s), the second loads them from the executable
store without tracing (*warm*), the third with the store off (``INFERSCALE_EXE_STORE=0``) traces
each step to find it in JAX's cache (*warm, JAX's cache only*).  ``--warmup``: each runs
``Engine.warmup()`` first (every bucket, as ``serve`` does).  The three must give the same tokens.
Each reports the seconds from process start to the engine built, its warm-up, to the workload
done, its step-bucket count, JAX's cache hits and misses (``stats()``) and the store's loads.  The workload: register a ``--segment`` token segment, then ``--requests`` requests
naming it with 16 new tokens each and ``--max-tokens`` generated, as one batch (prefill chunks,
decode buckets, the cascade path), then one request alone (batch-1 buckets).  Random bf16 weights
of the Llama-3-8B shape (``bench/lib/common.py``), or a tiny shape with ``--quick``.

    python bench/engine/cold_warm_start.py            # H200: the 8B shape
    python bench/engine/cold_warm_start.py --warmup   # as a `serve` restart: every bucket first
    python bench/engine/cold_warm_start.py --quick    # CPU: the harness only
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
LIB = os.path.join(ROOT, "bench", "lib")  # report, common


def phase(args) -> dict:
    """One process: build the engine, run the workload, report (the child side)."""
    sys.path[:0] = [ROOT, LIB]
    import jax
    import numpy as np

    from common import model_config, shape  # bench/lib/common.py: one definition of the shapes
    from inferscale_jax import Engine, EngineConfig, SamplingParams
    from models import init_params

    cfg = model_config(shape(args.quick))
    params = init_params(cfg, jax.random.PRNGKey(0), jnp_dtype(args.dtype))
    jax.block_until_ready(params)
    t_params = time.perf_counter() - T0
    config = EngineConfig(dtype=args.dtype, hbm_pages=args.hbm_pages, max_batch=args.requests,
                          compilation_cache_dir=args.cache)
    engine = Engine(params, cfg, None, config)
    t_engine = time.perf_counter() - T0
    warm_s = engine.warmup()["seconds"] if args.warmup else 0.0
    rng = np.random.default_rng(0)
    engine.register_segment("kb", token_ids=rng.integers(0, cfg.vocab_size, args.segment).tolist())
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [dict(prompt_token_ids=rng.integers(0, cfg.vocab_size, 16).tolist(), segments=["kb"], sampling=sp)
            for _ in range(args.requests)]
    outs = engine.generate_batch(reqs)
    engine.generate(**reqs[0])
    t_done = time.perf_counter() - T0
    s = engine.stats()
    store = engine.runner.exe_store
    return dict(params_s=round(t_params, 2), engine_s=round(t_engine, 2), warmup_s=round(warm_s, 2),
                ready_s=round(t_done, 2), stored=store.loads if store is not None else None,
                tokens=hashlib.sha256(repr([o.token_ids for o in outs]).encode()).hexdigest()[:12],
                buckets=s["compiles"], cache_hits=s["compile_cache_hits"], cache_misses=s["compile_cache_misses"],
                backend=jax.default_backend(), device=str(jax.devices()[0].device_kind))


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shape (CPU harness check)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --quick)")
    p.add_argument("--segment", type=int, default=None, help="segment tokens (default 4096; 256 with --quick)")
    p.add_argument("--requests", type=int, default=None, help="batch of requests (default 64; 8 with --quick)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hbm-pages", type=int, default=None, help="KV pages (default 4097; 513 with --quick)")
    p.add_argument("--warmup", action="store_true",
                   help="Engine.warmup() (every step bucket, as `serve` does) before the workload")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "compile_cache"))
    p.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)  # the child side
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.dtype = args.dtype or ("float32" if q else "bfloat16")
    args.segment = args.segment or (256 if q else 4096)
    args.requests = args.requests or (8 if q else 64)
    args.hbm_pages = args.hbm_pages or (513 if q else 4097)
    if args.phase:
        print("RESULT " + json.dumps(phase(args)), flush=True)
        return 0
    cache = tempfile.mkdtemp(prefix="inferscale-jit-cache-")
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", "--cache", cache, "--dtype", args.dtype,
           "--segment", str(args.segment), "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
           "--hbm-pages", str(args.hbm_pages)] + (["--quick"] if q else []) + (["--warmup"] if args.warmup else [])
    rows = []
    # cold: compiles, filling JAX's cache and the executable store; warm: loads from the store
    # (exe_store.py: no tracing); warm, JAX's cache only: traces every step to find its entry
    for name, store in (("cold", "1"), ("warm", "1"), ("warm, JAX's cache only", "0")):
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, INFERSCALE_EXE_STORE=store))
        if res.returncode:
            print(res.stderr[-4000:], file=sys.stderr)
            return 1
        r = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        rows.append((name, r))
        print(name, r, flush=True)
    (_, cold), (_, warm), _ = rows
    sys.path.insert(0, LIB)
    from report import code_version  # bench/lib/report.py
    lines = [f"# Persistent compilation cache: cold vs warm start ({datetime.date.today()})", "",
             f"`python bench/engine/cold_warm_start.py{' --quick' if q else ''}` on {cold['device']} ({cold['backend']}); "
             f"{'tiny' if q else 'Llama-3-8B'} shape, {args.dtype}, random weights; workload: a {args.segment}-token "
             f"segment, {args.requests} requests naming it (16 new tokens, {args.max_tokens} generated) as one "
             f"batch, then one alone{'; before it, Engine.warmup() of every step bucket' if args.warmup else ''}. "
             f"Seconds from process start. Code {code_version()}.", "",
             "| start | weights ready s | engine built s | warm-up s | workload done s | step buckets | cache hits | "
             "cache misses | from the executable store | tokens (sha256) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['params_s']} | {r['engine_s']} | {r['warmup_s']} | {r['ready_s']} | "
                     f"{r['buckets']} | {r['cache_hits']} | {r['cache_misses']} | {r['stored']} | {r['tokens']} |")
    same = len({r["tokens"] for _, r in rows}) == 1
    saved = cold["ready_s"] - warm["ready_s"]
    lines += ["", f"Warm start saves {saved:.1f} s of {cold['ready_s']:.1f} s "
              f"(workload done {warm['ready_s'] / cold['ready_s']:.0%} of cold); the three starts' tokens "
              f"{'are the same' if same else 'DIFFER'}."]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump(dict(runs=dict(rows), args=vars(args)), f, indent=1)
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
