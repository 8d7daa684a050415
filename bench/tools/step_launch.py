"""Where a decode step's time goes on the GPU: host time inside the jitted step call vs device
time, under XLA's command-buffer (CUDA graph) settings, with a profiler trace of the steps.

Llama-3-8B shape, random bf16 weights, one 4096-token segment named by ``B`` requests (16-token
questions); the steady decode steps (every row decoding) are measured with ``bench/engine/steps.py``'s
probe: wall interval between steps, time inside ``runner.dispatch`` (the jitted call's host
time) and time blocked reading back.  Each ``--variants`` entry runs in its own process (XLA
reads ``XLA_FLAGS`` once): ``default`` (jax's defaults), ``nocb`` (command buffers off),
``cb1`` (command buffers for fusions, cuBLAS, custom calls and cuDNN, graphs of any size),
``stable`` (jax's defaults with ``ModelRunner.stable_inputs``: the step's inputs refilled in place,
so the step's command buffer sees the same input addresses every step).
With ``--trace``, the first variant's 64-row steps run under ``jax.profiler.trace`` and the
trace is summarised: kernels per step, device busy time (union of kernel intervals) per step,
the host's time per step in the step call.

    python bench/tools/step_launch.py --out bench/results          # H200: step_launch.{json,md}
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

VARIANTS = {
    "default": "",
    "nocb": "--xla_gpu_enable_command_buffer=",
    "cb1": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
           "--xla_gpu_graph_min_graph_size=1",
    "stable": "",  # jax's defaults, the runner's inputs at stable addresses (ModelRunner.stable_inputs)
}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def summarise_trace(path: str, steps: int) -> dict:
    """Kernel count, device busy time and host call time per step from a profiler trace."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    pd = ProfileData.from_file(files[0])
    out = dict(planes=[])
    intervals, kernels, names = [], 0, {}
    host_calls = []
    for pl in pd.planes:
        lines = []
        for ln in pl.lines:
            evs = list(ln.events)
            lines.append((ln.name, len(evs)))
            if pl.name.startswith("/device:GPU"):
                for e in evs:
                    intervals.append((e.start_ns, e.start_ns + e.duration_ns))
                    names[e.name] = names.get(e.name, 0) + e.duration_ns
                kernels += len(evs)
            elif ln.name == "python":
                host_calls += [e.duration_ns for e in evs if "_model_step" in e.name]
        out["planes"].append(dict(name=pl.name, lines=lines[:12]))
    intervals.sort()
    busy, cur_s, cur_e = 0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0
    top = sorted(names.items(), key=lambda kv: -kv[1])[:15]
    kinds: dict[str, int] = {}  # kernel name without its numeric suffix -> launches per step
    for n in names:
        kinds[re.sub(r"[_.]?\d+$", "", n)] = kinds.get(re.sub(r"[_.]?\d+$", "", n), 0) + 1
    out.update(device_events_per_step=round(kernels / steps, 1), device_busy_ms_per_step=round(busy / steps / 1e6, 3),
               device_span_ms_per_step=round(span / steps / 1e6, 3),
               host_model_step_calls=len(host_calls),
               host_model_step_ms=round(sum(host_calls) / max(1, len(host_calls)) / 1e6, 3),
               top_kernels_ms_per_step=[(n[:90], round(d / steps / 1e6, 3)) for n, d in top],
               distinct_kernels=len(names),
               kernel_kinds=sorted(kinds.items(), key=lambda kv: -kv[1])[:40])
    return out


def summarise_dump(path: str) -> dict:
    """Counts from XLA's dump of the step module: fusions, custom calls and command buffers in the
    optimized HLO's entry, and the thunk sequence's command-buffer thunks."""
    out = {}
    files = sorted(glob.glob(os.path.join(path, "*_model_step*")), key=os.path.getsize)
    opt = [f for f in files if f.endswith("after_optimizations.txt")]
    if opt:
        text = open(opt[-1]).read()
        entry = text[text.rfind("ENTRY"):]
        out["entry_ops"] = {op: len(re.findall(rf"= [^ ]+ {op}\(", entry)) for op in
                            ("fusion", "custom-call", "call", "while", "copy", "async-start", "command-buffer")}
        out["entry_lines"] = entry.count("\n")
    thunks = [f for f in files if "thunk" in f]
    if thunks:
        text = open(thunks[-1]).read()
        out["thunk_file"] = os.path.basename(thunks[-1])
        out["thunk_lines"] = text.count("\n")
        out["command_buffer_mentions"] = text.lower().count("command")
        out["thunk_head"] = text[:3000]
    out["files"] = [os.path.basename(f) for f in files][-12:]
    return out


def child(variant: str, trace_dir: str | None, rows: list[int], quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from common import model_config, shape  # bench/lib/common.py
    from inferscale_jax import Engine, EngineConfig, SamplingParams
    from models import init_params
    sys.path.insert(0, os.path.join(ROOT, "bench", "engine"))
    from steps import Probe  # bench/engine/steps.py

    t0 = time.perf_counter()
    cfg = model_config(shape(quick))
    dtype = "float32" if quick else "bfloat16"
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.dtype(dtype))
    e = Engine(params, cfg, None, EngineConfig(dtype=dtype, max_model_len=2048 if quick else 8192,
                                               max_batch=max(rows), hbm_pages=2048 if quick else None))
    rng = np.random.default_rng(0)
    e.register_segment("kb", token_ids=rng.integers(0, cfg.vocab_size, 256 if quick else 4096).tolist())
    e.runner.stable_inputs = variant == "stable"
    probe = Probe(e)
    res = dict(variant=variant, xla_flags=os.environ.get("XLA_FLAGS", ""), setup_s=0.0, rows=[])
    for b in rows:
        for rep in range(2):  # the first run compiles this row bucket; the second is measured
            sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            for _ in range(b):
                e.submit(prompt_token_ids=rng.integers(0, cfg.vocab_size, 16).tolist(), segments=["kb"], sampling=sp)
            tracing = trace_dir and rep == 1 and b == rows[0]
            if tracing:  # trace only steady decode: step until every row decodes, then trace 10 steps
                while True:
                    e.step()
                    if probe.last_decode and probe.last_rows == b:
                        break
                jax.profiler.start_trace(trace_dir)
                for _ in range(10):
                    e.step()
                jax.block_until_ready(e.runner.cache.k[0])
                jax.profiler.stop_trace()
            steps = probe.run(e)
        dec = [s for s in steps if s[2] and s[3] == b][3:]
        med = lambda i: round(float(np.median([s[i] for s in dec])) * 1e3, 3)  # noqa: E731
        row = dict(rows=b, steps=len(dec), step_ms=med(0), host_ms=med(1), dispatch_ms=med(4),
                   blocked_ms=round(med(0) - med(1), 3), cascade=sum(s[5] for s in dec))
        res["rows"].append(row)
        log(variant, row)
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    if trace_dir:
        res["trace"] = summarise_trace(trace_dir, 10)
        log("trace", json.dumps(res["trace"])[:6000])
    dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if dump:
        res["dump"] = summarise_dump(dump.group(1))
        log("dump", json.dumps(res["dump"])[:6000])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--variants", default="default,nocb,cb1")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--dump", action="store_true", help="XLA dump of the first variant's step (op and thunk counts)")
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU: the harness only)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if args.child:
        res = child(args.child, args.trace_dir, rows, args.quick)
        print("RESULT " + json.dumps(res), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for i, v in enumerate(args.variants.split(",")):
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[v]).strip())
        cmd = [sys.executable, __file__, "--child", v, "--rows", args.rows] + (["--quick"] if args.quick else [])
        if args.trace and i == 0:
            cmd += ["--trace-dir", tempfile.mkdtemp(prefix="steptrace")]
        if args.dump and i == 0:
            env["XLA_FLAGS"] += f" --xla_dump_to={tempfile.mkdtemp(prefix='stepdump')} --xla_dump_hlo_as_text"
        log("variant", v, env["XLA_FLAGS"])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write(p.stderr[-3000:] if p.returncode else "")
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            else:
                print(line, flush=True)
        json.dump(results, open(os.path.join(args.out, "step_launch.json"), "w"), indent=1)
    lines = ["| variant | rows | step ms | in step call ms | blocked reading back ms |", "|---|---|---|---|---|"]
    for r in results:
        for x in r["rows"]:
            lines.append(f"| {r['variant']} | {x['rows']} | {x['step_ms']} | {x['dispatch_ms']} | {x['blocked_ms']} |")
    open(os.path.join(args.out, "step_launch.md"), "w").write(
        "# Decode step: host time in the step call vs device time\n\n" + "\n".join(lines) + "\n\n"
        + "`python bench/tools/step_launch.py " + " ".join(sys.argv[1:]) + "`\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
