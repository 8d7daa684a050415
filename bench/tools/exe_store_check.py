"""Does a second process find the steps the first one compiled?  Two fresh processes, one cache.

    python bench/tools/exe_store_check.py --model /tmp/llama8b --buckets small   # H200, ~2 minutes
    python bench/tools/exe_store_check.py                                        # the default model, CPU

Each process builds ``Engine.from_pretrained(MODEL)`` over the same compilation cache folder with
the executable store on (``INFERSCALE_EXE_STORE=1``, ``inferscale_jax/exe_store.py``), runs its
warm-up over ``--buckets``, and reports: the KV pool's page count (part of every step's shapes),
the device's memory limit and use when the pool was sized, the store folder, each fingerprint
part's digest, and where the warm-up's steps came from (compiled, JAX's persistent cache, the
store).  The second process should load every bucket from the store; when it does not, the table
names the fingerprint parts that differ (a different folder) or the pool sizes (other shapes).
Exits 1 when the second process loaded fewer steps from the store than the first stored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def child(model: str | None, cache: str, buckets: str) -> dict:
    """One start (runs in a fresh process): the report's row as a dict."""
    sys.path.insert(0, ROOT)
    import jax

    from inferscale_jax import EngineConfig
    from inferscale_jax.engine import Engine
    from inferscale_jax.exe_store import fingerprint_parts

    engine = Engine.from_pretrained(model, EngineConfig(compilation_cache_dir=cache))
    runner = engine.runner
    mem = jax.local_devices()[0].memory_stats() or {}
    devices = sorted(runner.cache.k[0].sharding.device_set, key=lambda d: d.id)
    parts = fingerprint_parts(runner.params, runner.cache, runner.cfg, devices)
    w = engine.warmup(buckets=buckets, progress_bar=False)
    store = runner.exe_store
    return dict(pages=runner.cache.num_pages, bytes_limit=mem.get("bytes_limit"), bytes_in_use=mem.get("bytes_in_use"),
                folder=store.folder if store else None, buckets=w["buckets"], seconds=round(w["seconds"], 1),
                store_loads=store.loads if store else 0, store_saves=store.saves if store else 0,
                store_failures=store.failures if store else 0,
                parts={k: hashlib.sha256(v.encode()).hexdigest()[:12] for k, v in parts.items()},
                warmup_times={k: round(v, 1) for k, v in runner.warmup_times.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--cache", default=None, help="compilation cache folder (default: a fresh temporary one)")
    ap.add_argument("--buckets", default="small", help="the warm-up set: small, all or auto (default: small)")
    ap.add_argument("--out", help="write the markdown report here too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cache = os.path.abspath(args.cache or tempfile.mkdtemp(prefix="inferscale-store-check-"))
    if args.child:
        print("RESULT " + json.dumps(child(args.model, cache, args.buckets)), flush=True)
        return
    env = dict(os.environ, INFERSCALE_EXE_STORE="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--cache", cache, "--buckets", args.buckets]
    runs = []
    for i in range(2):
        proc = subprocess.run(cmd + (["--model", args.model] if args.model else []), env=env, capture_output=True,
                              text=True)
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            sys.exit(f"start {i + 1} failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
        runs.append(json.loads(found[0]))
    a, b = runs
    lines = [f"`python bench/tools/exe_store_check.py --buckets {args.buckets}"
             + (f" --model {args.model}`" if args.model else "`") + f"; cache `{cache}`", "",
             "| start | KV pages | bytes_limit | bytes_in_use | buckets | store loads | store saves | store failures "
             "| warm-up s | its parts |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(runs):
        lines.append(f"| {i + 1} | {r['pages']} | {r['bytes_limit']} | {r['bytes_in_use']} | {r['buckets']} | "
                     f"{r['store_loads']} | {r['store_saves']} | {r['store_failures']} | {r['seconds']} | "
                     f"{r['warmup_times']} |")
    differ = [k for k in a["parts"] if a["parts"][k] != b["parts"].get(k)]
    lines += ["", f"- store folder: {'the same' if a['folder'] == b['folder'] else 'DIFFERENT'} ({b['folder']})",
              f"- fingerprint parts that differ: {', '.join(differ) or 'none'}"]
    ok = b["store_loads"] >= a["store_saves"] > 0
    lines.append(f"- the second start loaded {b['store_loads']} of the {a['store_saves']} stored steps: "
                 + ("ok" if ok else "MISSED"))
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
