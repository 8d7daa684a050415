"""Tensor-parallel benchmark: a 70B-shaped model over the GPUs of one host, and the 8B shape at TP=1
vs TP=N (docs/architecture.md, "Tensor parallelism").

Usage (from the repository root)::

    python bench/engine/tp.py --out bench/results            # 2 H200s: 70B shape at TP=2, 8B at TP=1 and 2
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python bench/engine/tp.py --quick --out /tmp/tpq      # the harness on 2 host devices, tiny shapes

Random bf16 weights generated on the devices in the sharded layout (``sharding.init_params_sharded``:
no device ever holds the whole model).  Engines: page 16, ``prefill_chunk`` 2048, the pool from free
memory.  A timed repetition inside which the engine compiled is dropped.

a. Per-GPU ceilings: copy bandwidth and the read-only reduction of ``bench/lib/common.py`` (device 0).
b. The large shape (Llama-3-70B: 80 layers, hidden 8192, 64 q / 8 kv heads, MLP 28672, vocab 128256)
   at TP=N over every visible device: TTFT of a 64-token question alone and after a 4k injected
   segment (target: injected / alone <= 1.5); decode at batch 1 (``generate(max_tokens=64)``, step =
   1 / decode tok/s) against the per-GPU weight-read floor - the weight bytes a step reads / N / the
   bandwidth (target <= 1.4); the share of the decode step's device time in all-reduce kernels (a
   profiler trace of one ``generate``; kernel names containing "all-reduce", "allreduce" or "nccl").
c. The 8B shape at TP=1 and TP=N: decode step at batch 1 (target TP=1 / TP=N >= 1.3) and decode
   throughput at 64 rows (64 requests of 64 prompt tokens, 32 new tokens each, all submitted at once;
   tok/s over the window where every request decodes, ``batch_decode.run_batch``).

d. Loading: a 70B-shaped checkpoint with ``--load-layers`` of its 80 layers (default 8, ~18 GB: the
   whole model does not fit the disk) written by ``bench/tools/make_checkpoint.py`` in a child process, then
   ``Engine.from_pretrained`` at TP=N: seconds, the process's peak host memory before and after
   (``ru_maxrss``: each device reads only its slices, one at a time), and the load time scaled to 80
   layers.

Writes ``tp.md`` to ``--out``.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import (LLAMA3_8B, LLAMA3_70B, TINY, copy_bandwidth, greedy, median, model_config, ms,  # noqa: E402
                    ratio, read_bandwidth, step_read_bytes, timed_generate, timed_reps)
from report import finish, log, section, table  # noqa: E402  (bench/lib/report.py)
from sections import parser, run_sections  # noqa: E402  (bench/lib/sections.py)

Q = 64
R: dict = {}


def build(sh: dict, tp: int, quick: bool):
    """(engine, model config) of shape ``sh`` over the first ``tp`` devices, weights made sharded."""
    from inferscale_jax import Engine, EngineConfig, sharding

    cfg = model_config(sh)
    t0 = time.time()
    conf = EngineConfig(dtype="bfloat16", page_size=16, prefill_chunk=256 if quick else 2048,
                        hbm_pages=1 + 1024 if quick else None, max_batch=64, tensor_parallel=tp)
    if tp > 1:
        mesh = sharding.make_mesh(tp)
        lcfg, params = sharding.init_params_sharded(cfg, mesh, jax.random.PRNGKey(0), jnp.bfloat16)
        jax.block_until_ready(params)
        eng = Engine(params, cfg, None, conf, placed=(mesh, lcfg))
    else:
        from models import init_params
        params = init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
        eng = Engine(params, cfg, None, conf)
    log(f"  engine TP={tp}: {cfg.num_layers} layers, hidden {cfg.hidden_size}; weights + engine {time.time() - t0:.1f} s, "
        f"{eng.stats()['pages_total']} pages")
    return eng, cfg


def ttft(eng, cfg, segs, reps, n_tokens=Q):
    import numpy as np
    rng = np.random.default_rng(1)

    def one():
        out, _ = timed_generate(eng, rng.integers(0, cfg.vocab_size, n_tokens).tolist(), segs)
        return out.metrics.ttft_s
    one()
    one()
    return median(timed_reps(eng, one, reps, f"ttft {segs}"))


def decode_step(eng, cfg, segs, reps):
    import numpy as np
    rng = np.random.default_rng(2)

    def one():
        out, _ = timed_generate(eng, rng.integers(0, cfg.vocab_size, Q).tolist(), segs, max_tokens=64)
        return 1.0 / out.metrics.decode_tokens_per_s
    timed_generate(eng, rng.integers(0, cfg.vocab_size, Q).tolist(), segs, max_tokens=8)
    return median(timed_reps(eng, one, reps, f"decode {segs}"))


@section
def ceilings(args):
    n = (64 << 20) if args.quick else (2 << 30)
    R["read_bw"], R["copy_bw"] = read_bandwidth(n), copy_bandwidth(n)
    R["bw"] = max(R["read_bw"], R["copy_bw"])
    table("a. Per-device ceilings (device 0)", ["op", "GB/s"],
          [["read-only reduction", f"{R['read_bw'] / 1e9:.0f}"], ["copy (read + write)", f"{R['copy_bw'] / 1e9:.0f}"]])


def allreduce_share(eng, cfg):
    """(all-reduce device time, all device time) per decode step of one profiled generate."""
    import numpy as np
    from profile_ops import kernel_times

    rng = np.random.default_rng(3)
    steps = 16

    def run():
        timed_generate(eng, rng.integers(0, cfg.vocab_size, Q).tolist(), ["ctx"], max_tokens=steps)
    rows = kernel_times(run, steps, top=100000)
    if not rows:
        return None, None
    total = sum(r[2] for r in rows)
    ar = sum(r[2] for r in rows if any(k in r[1].lower() for k in ("all-reduce", "allreduce", "all_reduce", "nccl")))
    return ar, total


@section
def large(args):
    tp = jax.device_count()
    sh = dict(TINY, layers=4, heads=8, kv=4, head_dim=16, hidden=128, inter=256) if args.quick else LLAMA3_70B
    eng, cfg = build(sh, tp, args.quick)
    ctx = 256 if args.quick else 4096
    import numpy as np
    t0 = time.perf_counter()
    eng.register_segment("ctx", token_ids=np.random.default_rng(0).integers(0, cfg.vocab_size, ctx).tolist())
    log(f"  registered a {ctx}-token segment: {time.perf_counter() - t0:.1f} s")
    reps = 3 if args.quick else 10
    q = ttft(eng, cfg, [], reps)
    inj = ttft(eng, cfg, ["ctx"], reps)
    dec = decode_step(eng, cfg, ["ctx"], 2 if args.quick else 3)
    floor = step_read_bytes(sh) / tp / R["bw"] if R.get("bw") else None
    ar, total = allreduce_share(eng, cfg)
    R["large"] = dict(tp=tp, q=q, inj=inj, dec=dec, floor=floor, ar=ar, total=total)
    table(f"b. {'tiny' if args.quick else 'Llama-3-70B'} shape at TP={tp}, bf16",
          ["measure", "value", "against", "ratio", "target"],
          [["TTFT, 64-token question alone", f"{ms(q)} ms", "", "", ""],
           [f"TTFT, {ctx} injected + 64", f"{ms(inj)} ms", "question alone", ratio(inj, q), "<= 1.5"],
           ["decode step, batch 1", f"{ms(dec)} ms", f"per-GPU weight-read floor {ms(floor)} ms", ratio(dec, floor),
            "<= 1.4"],
           ["all-reduce share of the decode step's device time",
            "n/a" if ar is None else f"{ar / 1e3:.2f} of {total / 1e3:.2f} ms",
            "", "n/a" if not total else f"{ar / total:.1%}", ""]])
    eng = None  # noqa: F841 - its pool freed before the next section


@section
def loading(args):
    import resource
    import shutil
    import subprocess
    import tempfile

    from inferscale_jax import Engine, EngineConfig

    tp = jax.device_count()
    folder = tempfile.mkdtemp(prefix="tp-load-", dir=args.load_dir)
    try:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "tools", "make_checkpoint.py"), folder]
        cmd += ["--quick"] if args.quick else ["--shape", "70b", "--layers", str(args.load_layers)]
        t0 = time.time()
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        log(f"  checkpoint written in {time.time() - t0:.0f} s")
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.time()
        eng = Engine.from_pretrained(folder, EngineConfig(dtype="bfloat16", page_size=16, hbm_pages=1 + 64,
                                                          tensor_parallel=tp, compilation_cache=False))
        dt = time.time() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        layers = eng.cfg.num_layers
        eng = None  # noqa: F841 - its pool freed before the next engine
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    full = 80 if not args.quick else layers
    R["load"] = dict(s=dt, bytes=size, rss0=rss0, rss1=rss1, layers=layers)
    table(f"d. Engine.from_pretrained at TP={tp}, a {'tiny' if args.quick else '70B'}-shaped checkpoint of {layers} layers",
          ["checkpoint GB", "load s", "GB/s", "peak host RSS before GB", "after GB", f"load s scaled to {full} layers"],
          [[f"{size / 1e9:.1f}", f"{dt:.1f}", f"{size / dt / 1e9:.2f}", f"{rss0 / 1e9:.2f}", f"{rss1 / 1e9:.2f}",
            f"{dt * full / layers:.0f}"]])


@section
def small(args):
    tp = jax.device_count()
    sh = dict(TINY, heads=8, kv=4, head_dim=16, hidden=128, inter=256) if args.quick else LLAMA3_8B
    from batch_decode import run_batch
    import numpy as np
    res = {}
    for n in (1, tp):
        eng, cfg = build(sh, n, args.quick)
        rng = np.random.default_rng(5)
        dec = decode_step(eng, cfg, [], 2 if args.quick else 3)

        def reqs():
            return [dict(prompt_token_ids=rng.integers(0, cfg.vocab_size, Q).tolist(), sampling=greedy(32))
                    for _ in range(64)]
        run_batch(eng, reqs())  # compiles
        runs = timed_reps(eng, lambda: run_batch(eng, reqs()), 2 if args.quick else 3, f"64 rows TP={n}")
        res[n] = dict(dec=dec, tok_s=median([r["tok_s"] for r in runs if r["tok_s"]]))
        eng = None  # noqa: F841 - its pool freed before the next engine
    R["small"] = res
    table(f"c. {'tiny' if args.quick else 'Llama-3-8B'} shape, TP=1 vs TP={tp}",
          ["measure", "TP=1", f"TP={tp}", "TP=1 / TP=N (step) or TP=N / TP=1 (tok/s)", "target"],
          [["decode step, batch 1", f"{ms(res[1]['dec'])} ms", f"{ms(res[tp]['dec'])} ms",
            ratio(res[1]["dec"], res[tp]["dec"]), ">= 1.3"],
           ["decode tok/s, 64 rows", f"{res[1]['tok_s']:.0f}", f"{res[tp]['tok_s']:.0f}",
            ratio(res[tp]["tok_s"], res[1]["tok_s"]), ""]])


def main():
    ap = parser(__doc__, "tiny shapes (works on CPU host devices)")
    ap.add_argument("--sections", default="abcd")
    ap.add_argument("--load-layers", type=int, default=8, help="section d: layers of the 70B-shaped checkpoint")
    ap.add_argument("--load-dir", default=None, help="section d: where the checkpoint is written (default: tmp)")
    args = ap.parse_args()
    title = f"Tensor-parallel benchmark ({'quick, tiny shapes' if args.quick else '70B and 8B shapes, random bf16'})"
    plan = [("ab", ceilings), ("b", large), ("c", small), ("d", loading)]
    return run_sections(args, plan, lambda a, t0: finish(a.out, "tp.md", title, t0, ROOT))


if __name__ == "__main__":
    sys.exit(main())
