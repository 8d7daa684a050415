"""Kernel-by-kernel time of the engine's production steps in graph mode (XLA command buffers on).

Drives ``Engine.step`` with C clients in a closed loop over S shared segments, as
``bench/tools/profile_host.py`` does (fresh 64-token questions, ``max_tokens`` greedy tokens, a finished
request replaced at once), with the engine's production settings (``ModelRunner.stable_inputs``,
command buffers on, overlap on).  After ``--warm-steps`` it holds on to steps the loop dispatches:
the first decode step with every row decoding (``--concurrency`` rows) and the first
``--mixed-captures`` mixed steps (prefill chunks beside decode rows), and replays each one's
compiled executable on its own device inputs (``ModelRunner.replay_last``'s method: the cache
chained through, the same K/V written to the same slots).  Two ways to see the kernels:

- ``--mode trace`` (default): ``jax.profiler`` with ``XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true``
  (without it XLA runs a command buffer's thunks one by one while a profiler is on, i.e. not graph
  mode).  CUPTI reports each kernel node of the CUDA graph with its start and duration, so the
  trace gives per-kernel time, the device's busy time (union of kernels) and the gaps inside a
  step.  A tiny Pallas kernel (``profgraph_step``) launched between replays splits the trace into
  steps.  Then ``--loop-steps`` steps of the production loop are traced too (a marker after each
  dispatch): the device's time per step including the idle time waiting for the host.
  Graph mode shows in the trace: the GPU events carry ``cuda_graph_id`` / ``cuda_graph_node_id``
  (H200, jax 0.11.2: bench/results/profile_graph_h200.md).
- ``--mode ncu``: the same captures replayed inside ``cuProfilerStart/Stop`` for Nsight Compute
  (``ncu --graph-profiling node --profile-from-start off --metrics gpu__time_duration.sum``);
  ncu serializes kernels, so its sum is the device's busy time without overlap or gaps.  (Not yet
  run on a GPU: checked on the CPU only.)

Kernels are grouped by name: the Pallas kernels by their ``name=`` (cascade shared part,
decode / private part, ragged, KV write), XLA's fusions through the step's optimized HLO
(``Compiled.as_text()``): a fusion holding a dot is a matmul named by its weight's shape (qkv, o,
gate-up, down, lm_head; a cuBLAS kernel, which has no HLO name, by the step's cuBLAS calls in
schedule order), other fusions by the source lines of the ops fused in them (the HLO's stack
frames) or, failing those, by op names, operand names and shapes (norms, RoPE, MLP activation,
sampler, attention glue, split-K epilogues...).  Raw data (meta.json, HLO texts, the
trace) go to ``--raw``; ``--analyze RAW [--ncu-csv F]`` turns them (here or elsewhere) into the
markdown report, with each part's floor (bytes / read bandwidth or FLOPs / matmul rate, the larger; both
measured on the device at capture time, an H200's 4.3 TB/s and 790 TFLOP/s for raw data without them).

    python bench/tools/profile_graph.py --quick --concurrency 16 --warm-steps 30          # CPU: the harness
    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \\
      python bench/tools/profile_graph.py --model /tmp/llama8b --raw /tmp/pg_raw --out report.md   # H200
    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true ncu --clock-control none --cache-control none \\
      --graph-profiling node --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \\
      --log-file ncu.csv python bench/tools/profile_graph.py --mode ncu --model /tmp/llama8b --raw /tmp/pg_ncu
    python bench/tools/profile_graph.py --analyze /tmp/pg_raw --ncu-csv ncu.csv --ncu-raw /tmp/pg_ncu --out report.md
"""

from __future__ import annotations

import collections
import csv
import glob
import gzip
import json
import os
import random
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

BANDWIDTH = 4.3e12  # bytes/s: an H200's measured read, when a capture did not measure its device's (raw from before)
COMPUTE = 790e12  # bf16 FLOP/s: an H200's 8192^3 matmul, likewise (a GPU capture measures both: ``ceilings``)
MARK_STEP = "profgraph_step"
MARK_BEGIN = "profgraph_begin"


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ----------------------------------------------------------------------------------- the workload

def _marker(name: str):
    """A jitted tiny Pallas kernel named ``name`` (a boundary in traces and ncu's kernel list)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from pallas_kernels.common import compiler_params, default_interpret

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32), name=name,
                          compiler_params=compiler_params(1, 1), interpret=default_interpret())
    def marker(x):
        return call(x)

    marker.__name__ = marker.__qualname__ = f"{name}_marker"  # its XLA module: jit_<name>_marker
    fn = jax.jit(marker)
    x = jnp.zeros((128,), jnp.float32)
    jax.block_until_ready(fn(x))
    return lambda: fn(x)


def _plan_info(plan, page_size: int, cfg) -> dict:
    """What a step computes, from its StepPlan: rows, tokens, chunks, cascade groups and the
    attention's reads (tokens of K/V and query-key pairs; shared-prefix part and private part)."""
    rows = plan.rows
    groups = list(plan.groups)
    chunk_rows = [r for r in rows if len(r.tokens) > 1]
    shared_pairs = private_tokens = private_pairs = 0
    for r in rows:
        m = len(r.tokens)
        own = groups[r.group] * page_size if r.group >= 0 else 0
        end = r.start + m
        private_tokens += end - own
        # causal inside the chunk: token j of the chunk sees (start - own) + j + 1 private keys
        private_pairs += m * (r.start - own) + m * (m + 1) // 2
        shared_pairs += own * m
    return dict(kind="decode" if not chunk_rows else "mixed", rows=len(rows),
                tokens=sum(len(r.tokens) for r in rows), chunk_rows=len(chunk_rows),
                chunk_tokens=sum(len(r.tokens) for r in chunk_rows),
                decode_rows=len(rows) - len(chunk_rows), groups=len(groups),
                group_rows=sum(r.group >= 0 for r in rows),
                shared_tokens=sum(g * page_size for g in groups), shared_pairs=shared_pairs,
                private_tokens=private_tokens, private_pairs=private_pairs,
                mean_context=sum(r.start + len(r.tokens) for r in rows) / max(1, len(rows)))


class Workload:
    """The engine and profile_host's closed loop; every dispatched step's plan is recorded."""

    def __init__(self, args) -> None:
        from inferscale_jax import Engine, EngineConfig, SamplingParams

        config = EngineConfig(max_batch=args.concurrency)
        self.engine = engine = Engine.from_pretrained(args.model, config)
        self.runner = runner = engine.runner
        self.cfg = engine.cfg
        self.page_size = runner.page_size
        vocab = engine.cfg.vocab_size
        self.rng = rng = random.Random(0)
        for i in range(args.segments):
            engine.register_segment(f"seg{i}", token_ids=[rng.randrange(10, vocab) for _ in range(args.segment_tokens)])
        self.sp = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.args, self.SamplingParams = args, SamplingParams
        for _ in range(args.concurrency):
            self.submit()
        self.plans: list[dict] = []  # one per dispatch
        self.after_dispatch = None  # called after each dispatch (loop trace markers)
        dispatch = runner.dispatch

        def recorded(plan, prev=None):
            pending = dispatch(plan, prev)
            info = _plan_info(plan, self.page_size, self.cfg)
            self.plans.append(info)
            if self.after_dispatch is not None:
                self.after_dispatch()
            return pending

        runner.dispatch = recorded

    def submit(self) -> None:
        a, vocab = self.args, self.engine.cfg.vocab_size
        spread = min(a.max_tokens_spread, a.max_tokens - 1)
        sp = dict(self.sp, max_tokens=a.max_tokens + (self.rng.randint(-spread, spread) if spread else 0))
        self.engine.submit(prompt_token_ids=[self.rng.randrange(10, vocab) for _ in range(a.question_tokens)],
                           segments=[f"seg{self.rng.randrange(a.segments)}"], sampling=self.SamplingParams(**sp))

    def step(self) -> None:
        for o in self.engine.step():
            if o.finished:
                self.submit()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def last(self):
        """(executable, device args, plan info, bucket key) of the step dispatched last."""
        exe, dev_args = self.runner._last
        key = next((k for k, v in self.runner.executables.items() if v is exe), None)
        return exe, dev_args, self.plans[-1], key

    def replay(self, exe, dev_args, times: int, marker=None) -> tuple[float, float]:
        """Run a held step ``times`` times back to back (ModelRunner.replay_last's way); returns
        (seconds per step, host seconds per call)."""
        import jax
        r = self.runner
        jax.block_until_ready(r.cache)
        t0 = time.perf_counter()
        host = 0.0
        out = mark = None
        for _ in range(times):
            t = time.perf_counter()
            out, _, r.cache = exe(r.params, r.cache, *dev_args)
            host += time.perf_counter() - t
            mark = marker() if marker is not None else None
        jax.block_until_ready((out, r.cache, mark))  # (the last marker too: a trace must see it)
        return (time.perf_counter() - t0) / times, host / times


def _hold_steps(w: Workload, want_mixed: int, max_steps: int) -> None:
    """Step the loop until it has dispatched a full decode step and ``want_mixed`` mixed steps;
    each is handed to ``w.on_capture`` right after its dispatch (its inputs are live until the next
    dispatch of its shape)."""
    got_decode, got_mixed, steps = False, 0, 0
    full = w.args.concurrency
    while (not got_decode or got_mixed < want_mixed) and steps < max_steps:
        w.step()
        steps += 1
        exe, dev_args, info, key = w.last()
        if info["kind"] == "decode" and info["rows"] == full and not got_decode:
            got_decode = True
            w.on_capture(exe, dev_args, info, key)
        elif info["kind"] == "mixed" and got_mixed < want_mixed:
            got_mixed += 1
            w.on_capture(exe, dev_args, info, key)
    log(f"held steps after {steps} loop steps: decode {got_decode}, mixed {got_mixed}")


def _xplane(d: str, raw: str) -> str | None:
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    log("trace files:", [(p, os.path.getsize(p)) for p in paths])
    return os.path.relpath(paths[0], raw) if paths else None


def run_workload(args) -> None:
    import jax

    os.makedirs(args.raw, exist_ok=True)
    t0 = time.perf_counter()
    w = Workload(args)
    log(f"engine ready in {time.perf_counter() - t0:.1f} s; pool {w.engine.pool.num_pages} pages; warming {args.warm_steps} steps")
    t = time.perf_counter()
    w.run(args.warm_steps)
    log(f"warm-up {time.perf_counter() - t:.1f} s; compiles {w.runner.compiles}")
    mark_step, mark_begin = _marker(MARK_STEP), _marker(MARK_BEGIN)
    meta = dict(mode=args.mode, argv=sys.argv, jax=jax.__version__, device=str(jax.devices()[0]),
                xla_flags=os.environ.get("XLA_FLAGS", ""), ceilings=ceilings(),
                cfg=dict(hidden=w.cfg.hidden_size, inter=w.cfg.intermediate_size, layers=w.cfg.num_layers,
                         heads=w.cfg.num_heads, kv=w.cfg.num_kv_heads, head_dim=w.cfg.head_dim,
                         vocab=w.cfg.vocab_size, page_size=w.page_size),
                args=vars(args), captures=[])
    hlo_files: dict = {}
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0

    def save():
        with open(os.path.join(args.raw, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)

    def on_capture(exe, dev_args, info, key):
        try:
            capture(exe, dev_args, info, key)
        except Exception:  # noqa: BLE001 - one capture's failure must not lose the others
            import traceback
            traceback.print_exc()
            try:
                jax.profiler.stop_trace()
            except Exception:  # noqa: BLE001 - (no trace was running)
                pass
        save()

    def capture(exe, dev_args, info, key):
        cid = len(meta["captures"])
        if key is not None and str(key) not in hlo_files:
            name = f"hlo_{len(hlo_files)}.txt.gz"
            with gzip.open(os.path.join(args.raw, name), "wt") as f:  # (Triton IR payloads cut short)
                f.write(re.sub(r'"([^"\\\s]{300})[^"\\\s]*"', r'"\1..."', exe.as_text()))
            hlo_files[str(key)] = name
        reps = args.decode_reps if info["kind"] == "decode" else args.mixed_reps
        cap = dict(info, id=cid, key=str(key), hlo=hlo_files.get(str(key)), reps=reps)
        # graph-mode device time with no tool on, and the host's time per call (small in graph mode)
        cap["replay_ms"], cap["call_ms"] = (1e3 * x for x in w.replay(exe, dev_args, args.time_reps))
        if args.mode == "ncu":
            mark_begin()
            jax.block_until_ready(w.runner.cache)
            _cuda_profiler(True)
            w.replay(exe, dev_args, reps, mark_step)
            jax.block_until_ready(w.runner.cache)
            _cuda_profiler(False)
        else:
            d = os.path.join(args.raw, f"trace_{cid}")
            jax.profiler.start_trace(d, profiler_options=opts)
            w.replay(exe, dev_args, 2)  # (the profiler's first sight of this graph: not counted)
            mark_begin()
            cap["traced_ms"], cap["traced_call_ms"] = (1e3 * x for x in w.replay(exe, dev_args, reps, mark_step))
            jax.profiler.stop_trace()
            cap["xplane"] = _xplane(d, args.raw)
        meta["captures"].append(cap)
        log(f"capture {cid}: {json.dumps(cap)}")

    w.on_capture = on_capture
    _hold_steps(w, args.mixed_captures, args.max_search_steps)
    if args.loop_steps:
        t = time.perf_counter()
        n0 = len(w.plans)
        w.run(args.loop_steps)  # the loop's own cadence, no tool: wall per step
        jax.block_until_ready(w.runner.cache)
        meta["loop_untraced_ms"] = 1e3 * (time.perf_counter() - t) / max(1, len(w.plans) - n0)
        meta["loop_untraced_kinds"] = collections.Counter(p["kind"] for p in w.plans[n0:])
    if args.mode == "trace" and args.loop_steps:
        d = os.path.join(args.raw, "trace_loop")
        jax.profiler.start_trace(d, profiler_options=opts)
        mark_begin()
        last_mark = [None]
        w.after_dispatch = lambda: last_mark.__setitem__(0, mark_step())
        first = len(w.plans)
        t = time.perf_counter()
        w.run(args.loop_steps)
        jax.block_until_ready((w.runner.cache, last_mark[0]))
        meta["loop_traced_ms"] = 1e3 * (time.perf_counter() - t) / max(1, len(w.plans) - first)
        w.after_dispatch = None
        jax.profiler.stop_trace()
        # window k (between the markers after dispatch k - 1 and dispatch k) holds step k's kernels
        # and the overlap helpers launched with it
        meta["loop"] = [dict(p) for p in w.plans[first:]]
        meta["loop_xplane"] = _xplane(d, args.raw)
    save()
    log("wrote", args.raw)
    w.engine.close()


def _cuda_profiler(on: bool) -> None:
    """cuProfilerStart / Stop on the device's primary context (the one XLA uses): ncu's
    ``--profile-from-start off`` range.  No-op without a CUDA driver."""
    import ctypes
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    dev, ctx, old = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    rcs = [cuda.cuDeviceGet(ctypes.byref(dev), 0), cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
           cuda.cuCtxPushCurrent(ctx)]
    rcs.append(cuda.cuProfilerStart() if on else cuda.cuProfilerStop())
    rcs += [cuda.cuCtxPopCurrent(ctypes.byref(old)), cuda.cuDevicePrimaryCtxRelease(dev)]
    log(f"cuProfiler{'Start' if on else 'Stop'}: return codes {rcs}")


# ----------------------------------------------------------------------------------- HLO: names -> parts

INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<type>.+?)\s(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
SHAPE = re.compile(r"\b(?:bf16|f16|f32|f64|s8|s16|s32|s64|u8|u16|u32|u64|pred|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
TABLE = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", name)


def parse_hlo(text: str) -> dict:
    """An optimized HLO module's text: {comps: {name: [instr]}, entry, frames: {id: [(file, function,
    line), ...] innermost first}}.  instr = dict(name, op, type, operands, calls, target, kernel,
    stack, src)."""
    comps: dict[str, list] = {}
    tables: dict[str, dict] = {t: {} for t in TABLE}
    entry, cur, table = None, None, None
    for line in text.splitlines():
        if line.strip() in TABLE:
            table = line.strip()
            continue
        if table is not None:
            m = re.match(r"^(\d+) (.*)$", line)
            if m:
                tables[table][int(m.group(1))] = m.group(2)
                continue
            table = None
        if line.startswith("}") or not line.strip():
            cur = None
            continue
        if not line.startswith(" "):  # a computation's header (its parameter list may be cut short)
            m = re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)", line)
            cur = m.group(1) if m else f"?{len(comps)}"
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
            continue
        if cur is None:
            cur = f"?{len(comps)}"
            comps[cur] = []
        m = INSTR.match(line)
        if not m:
            continue
        rest = m.group("rest")
        calls = re.search(r"(?:calls|to_apply)=%?([^\s,}]+)", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        src = re.search(r'source_file="([^"]+)" source_line=(\d+)', rest)
        op_name = re.search(r'op_name="([^"]*)"', rest) or re.search(r'"(jit\([^"]*)"', rest)
        pname = re.search(r'"name":\s*"([^"]+)"', rest) if target else None
        dedup = re.search(r'deduplicated_name="([^"]+)"', rest)
        comps[cur].append(dict(name=m.group("name"), op=m.group("op"), type=m.group("type"), comp=cur,
                               dedup=dedup.group(1) if dedup else None,
                               operands=rest.split(")")[0][:3000], calls=calls.group(1) if calls else None,
                               target=target.group(1) if target else None,
                               kernel=pname.group(1) if pname else None,
                               op_name=op_name.group(1) if op_name else "",
                               frame=int(frame.group(1)) if frame else None,
                               src=(os.path.basename(src.group(1)), int(src.group(2))) if src else None))
    files = {k: os.path.basename(v.strip('"')) for k, v in tables["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locs = {}
    for k, v in tables["FileLocations"].items():
        f, fn, ln = (re.search(rf"{x}=(\d+)", v) for x in ("file_name_id", "function_name_id", "line"))
        locs[k] = (files.get(int(f.group(1)), "?") if f else "?", funcs.get(int(fn.group(1)), "?") if fn else "?",
                   int(ln.group(1)) if ln else 0)
    raw_frames = {}
    for k, v in tables["StackFrames"].items():
        loc, parent = re.search(r"file_location_id=(\d+)", v), re.search(r"parent_frame_id=(\d+)", v)
        raw_frames[k] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)

    # the printed parent_frame_id is the caller's id + 1 in the XLA seen here (roots print their own
    # id); a printer without that offset shows no frame that is its own parent
    offset = 1 if any(k == p for k, (_, p) in raw_frames.items()) else 0

    def stack(fid):
        out, seen = [], set()
        while fid in raw_frames and fid not in seen:
            seen.add(fid)
            loc, parent = raw_frames[fid]
            if loc in locs:
                out.append(locs[loc])
            fid = parent - offset
        return out

    for instrs in comps.values():
        for ins in instrs:
            ins["stack"] = stack(ins["frame"]) if ins["frame"] is not None else (
                [(ins["src"][0], "?", ins["src"][1])] if ins["src"] else [])
    return dict(comps=comps, entry=entry)


def _dims(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in m.split(",") if x) for m in SHAPE.findall(text)]


def gemm_specs(cfg: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of each weight."""
    h, d = cfg["hidden"], cfg["head_dim"]
    return dict(qkv=(h, (cfg["heads"] + 2 * cfg["kv"]) * d), o=(cfg["heads"] * d, h), gate_up=(h, 2 * cfg["inter"]),
                down=(cfg["inter"], h), lm_head=(h, cfg["vocab"]))


_LINES: dict = {}


def _line_text(base: str, line: int) -> str:
    """A source line of this repository (files found by basename)."""
    if base not in _LINES:
        hits = sorted(p for p in glob.glob(os.path.join(ROOT, "**", base), recursive=True)
                      if "/tests/" not in p and "/.venv" not in p)
        _LINES[base] = open(hits[0]).read().splitlines() if hits else []
    lines = _LINES[base]
    return lines[line - 1] if 0 < line <= len(lines) else ""


BOUNDARY = ("_layer_nested", "_forward", "_model_step")  # a step's outer frames: tags come from inside them
WEIGHTS = {"wqkv": "qkv", "wo": "o", "w_gate_up": "gate_up", "w_down": "down"}
ATTN_FUNCS = ("cascade", "merge", "paged_decode", "ragged", "_attend", "_as_ragged", "prefill", "dequantize")


def _tags_of_stack(stack: list[tuple[str, str, int]], op_name: str) -> set[str]:
    """What an HLO op does, from its Python stack (innermost first) and op_name."""
    tags = set()
    cut = next((i for i, (_, f, _) in enumerate(stack) if f in BOUNDARY), len(stack) - 1)
    if stack and stack[cut][1] == "_model_step":
        tags.add("step_io")
    stack = stack[:cut + 1]  # the frames inside the step (not the engine's callers)
    funcs = [f for _, f, _ in stack]
    files = [b for b, _, _ in stack]
    if "sampling.py" in files or "sample_tokens" in op_name:
        tags.add("sampler")
    if any(f in ("apply_rope", "rope_cos_sin") for f in funcs) or "rope.py" in files:
        tags.add("rope")
    if "rms_norm" in funcs or "add_rms_norm" in funcs:  # (the residual adds run inside add_rms_norm)
        tags.add("norm")
    if any(f.startswith("write_kv") for f in funcs) or "write_kv" in op_name:
        tags.add("kv_write")
    if any(any(a in f for a in ATTN_FUNCS) for f in funcs) or any(
            b in ("cascade_attention.py", "decode_attention.py", "ragged_attention.py", "common.py") for b in files):
        tags.add("attn_glue")
    if "_linear" in funcs or "einsum" in op_name or "dot_general" in op_name:
        tags.add("gemm_glue")
    for base, func, line in stack:
        text = _line_text(base, line)
        if func == "_layer" and "silu" in text:
            tags.add("mlp_act")
        if func == "add_rms_norm" and "x + delta" in text:
            tags.add("residual")
        if func == "_forward" and "embed" in text and "[tokens]" in text:
            tags.add("embed")
        if func == "_forward" and "take_along_axis" in text:
            tags.add("last_token")
        if func == "project_qkv" and "rms_norm" not in text and "_linear" not in text and "rope" not in text:
            tags.add("layout")
    return tags


def _tags_of_op(ins: dict) -> set[str]:
    """Tags from an op's opcode and op_name alone (an HLO whose stack tables are missing)."""
    on, op = ins["op_name"], ins["op"]
    tags = set()
    if "sample_tokens" in on:
        tags.add("sampler")
    if any(a in on for a in ("_cascade", "cascade", "merge", "paged_decode", "ragged", "_attend", "row_layout")):
        tags.add("attn_glue")
    if "write_kv" in on:
        tags.add("kv_write")
    if "jit(silu)" in on or op == "logistic":
        tags.add("mlp_act")
    if op == "rsqrt" or on.endswith("/rsqrt"):
        tags.add("norm")
    if "take_along_axis" in on:
        tags.add("last_token")
    if op in ("sine", "cosine"):
        tags.add("rope")
    if "dot_general" in on:
        tags.add("gemm_glue")
    return tags


def _is_rope(ins: dict, inner: list[dict], cfg: dict) -> bool:
    """RoPE on q or k: a rotate-half (negate + concatenate) over [.., heads, head_dim]."""
    ops = {i["op"] for i in inner}
    dims = _dims(ins["type"])
    return ("negate" in ops and "concatenate" in ops and bool(dims)
            and dims[0][-2:] in ((cfg["heads"], cfg["head_dim"]), (cfg["kv"], cfg["head_dim"])))


def _gemm_of_stack(stack: list[tuple[str, str, int]]) -> str | None:
    """Which weight a dot multiplies, from the caller's line of ``_linear`` (or the LM head's einsum)."""
    for base, func, line in stack:
        text = _line_text(base, line)
        if func in ("_layer", "project_qkv"):
            for w, name in WEIGHTS.items():
                if f'"{w}"' in text:
                    return name
        if func == "_forward" and "einsum" in text:
            return "lm_head"
    return None


TAG_ORDER = ["sampler", "rope", "norm", "mlp_act", "embed", "kv_write", "attn_glue", "last_token",
             "residual", "gemm_glue", "step_io", "layout"]
TAG_PART = {"sampler": "sampler", "rope": "rope", "norm": "norms (+residual)", "mlp_act": "mlp act (silu*up)",
            "embed": "embedding", "kv_write": "kv write", "attn_glue": "attention glue (merge, tables)",
            "last_token": "lm_head glue", "residual": "residual add", "gemm_glue": "gemm glue",
            "step_io": "step inputs/outputs", "layout": "copies/layout"}


class Classifier:
    """Kernel name (or HLO op name) -> part of the step, through one executable's optimized HLO."""

    def __init__(self, hlo_text: str | None, cfg: dict):
        self.cfg = cfg
        self.by_name: dict[str, dict] = {}
        self.cublas: list[str] = []  # the cuBLAS calls' parts in schedule order
        self.comps: dict = {}
        self._type_cache: dict = {}
        if not hlo_text:
            return
        h = parse_hlo(hlo_text)
        self.comps = h["comps"]
        for instrs in self.comps.values():
            for ins in instrs:
                self.by_name.setdefault(sanitize(ins["name"]), ins)
                if ins["dedup"]:
                    self.by_name.setdefault(sanitize(ins["dedup"]), ins)
                if ins["kernel"]:
                    self.by_name.setdefault(sanitize(ins["kernel"]), ins)

        def walk(comp, depth=0):  # schedule order through called computations (command buffers)
            for ins in self.comps.get(comp, []):
                if ins["target"] and "cublas" in ins["target"].lower():
                    self.cublas.append(self._part_of(ins)[0])
                elif ins["op"] == "call" and ins["calls"] and depth < 4:
                    walk(ins["calls"], depth + 1)

        walk(h["entry"])

    def _inner(self, ins: dict, depth: int = 0) -> list[dict]:
        if not ins.get("calls") or depth > 3:
            return []
        out = []
        for sub in self.comps.get(ins["calls"], []):
            out.append(sub)
            out += self._inner(sub, depth + 1)
        return out

    def _types(self, comp: str) -> dict[str, str]:
        if comp not in self._type_cache:
            self._type_cache[comp] = {i["name"]: i["type"] for i in self.comps.get(comp, [])}
        return self._type_cache[comp]

    def _operands(self, ins: dict) -> list[str]:
        return re.findall(r"%([\w.\-]+)", ins["operands"])

    def _gemm_of_operands(self, ins: dict) -> str | None:
        """Which weight a gemm multiplies: an operand named after it (``params__layers___0___wo__``),
        else an operand whose shape holds K * N elements with N among its dims (a split-K bitcast of
        the weight is [2, K / 2, N])."""
        names = self._operands(ins)
        for n in names:
            for w, g in WEIGHTS.items():
                if f"___{w}__" in n:
                    return g
            if "lm_head" in n or "params__embed" in n:
                return "lm_head"
        types = self._types(ins["comp"])
        specs = gemm_specs(self.cfg)
        for n in names:
            for dims in _dims(types.get(n, "")):
                size = 1
                for x in dims:
                    size *= x
                for g, (k, nn) in specs.items():
                    if size == k * nn and nn in dims and len(dims) >= 2:
                        return g
        return None

    def _roots(self, ins: dict) -> list[str]:
        """Operand names, through bitcasts / get-tuple-elements one or two levels up."""
        out = []
        for n in self._operands(ins):
            out.append(n)
            src = self.by_name.get(sanitize(n))
            for _ in range(2):
                if src is None or src["op"] not in ("bitcast", "get-tuple-element", "copy"):
                    break
                ops = self._operands(src)
                out += ops
                src = self.by_name.get(sanitize(ops[0])) if ops else None
        return out

    def _gemm_producer(self, ins: dict, depth: int = 0) -> str | None:
        """The gemm whose output ``ins`` reads (through get-tuple-element / bitcast), if any."""
        types = None
        for n in self._operands(ins):
            src = self.by_name.get(sanitize(n))
            if src is None or src["comp"] != ins["comp"]:
                continue
            if src["target"] and "cublas" in src["target"].lower() or (src["op"] == "fusion" and "gemm_fusion" in src["name"]):
                return self._gemm_of_operands(src) or self._gemm_of_stack_any(src)
            if src["op"] in ("get-tuple-element", "bitcast", "copy") and depth < 3:
                g = self._gemm_producer(src, depth + 1)
                if g:
                    return g
        del types
        return None

    def _gemm_of_stack_any(self, ins: dict) -> str | None:
        for d in [i for i in self._inner(ins) if i["op"] in ("dot", "convolution")] + [ins]:
            g = _gemm_of_stack(d["stack"])
            if g:
                return g
        return None

    def _part_of(self, ins: dict) -> tuple[str, str]:
        """(part, note) of one HLO instruction (a fusion, a custom call)."""
        inner = self._inner(ins)
        ops = {i["op"] for i in inner} | {ins["op"]}
        if ins["target"] and "cublas" in ins["target"].lower() or "dot" in ops or "convolution" in ops:
            kind = "cuBLAS" if ins["target"] else ("Triton gemm" if "gemm_fusion" in ins["name"] else "fusion")
            g = self._gemm_of_stack_any(ins) or self._gemm_of_operands(ins)
            if not g:
                for d in [i for i in inner if i["op"] in ("dot", "convolution")]:
                    g = self._gemm_of_operands(d)
                    if g:
                        break
            if g:
                split = ins["type"].lstrip("(").startswith("f32[2,")
                return f"gemm {g}", kind + (", split-K 2" if split else "")
            tags = set().union(*(_tags_of_stack(d["stack"], d["op_name"]) | _tags_of_op(d) for d in inner + [ins]))
            if "attn_glue" in tags:
                return "attention glue (merge, tables)", "dot"
            if "sampler" in tags:
                return "sampler", "dot"
            return "gemm other", ins["op_name"][-60:]
        if ins["target"] and "triton" in ins["target"] or ins["kernel"]:
            part, note = self.part_by_name(ins["kernel"] or ins["name"])
            if part:
                return part, note
        tags = set()
        for i in [ins] + inner:
            if i["op"] not in ("constant", "parameter", "iota"):
                tags |= _tags_of_stack(i["stack"], i["op_name"]) | _tags_of_op(i)
        if _is_rope(ins, inner, self.cfg):
            tags.add("rope")
        roots = self._roots(ins)
        if any("_norm__" in r for r in roots):
            tags.add("norm")
        if any(r.startswith("pallas_call") for r in roots) and not tags & {"sampler", "rope", "norm"}:
            tags.add("attn_glue")  # reads an attention kernel's output (merges, scatters)
        shape = ins["type"].split("{")[0][:40]
        note = "+".join(t for t in TAG_ORDER if t in tags)
        g = self._gemm_producer(ins)
        if g == "lm_head":  # what reads the logits is the sampler
            return "sampler", note + " " + shape
        if g and not tags & {"sampler", "attn_glue", "kv_write", "rope", "mlp_act"}:
            return f"gemm {g} epilogue (split-K sum, residual, norm)", note + " " + shape
        if "reduce" in ops and tags == {"gemm_glue"}:
            return "gemm split-K reduce", note
        for t in TAG_ORDER:
            if t in tags:
                return TAG_PART[t], note + " " + shape
        if ops & {"copy", "transpose"}:
            return "copies/layout", shape
        return "other", shape + " " + ",".join(sorted(ops - {"parameter", "constant", "bitcast", "tuple",
                                                              "get-tuple-element", "fusion"}))[:50]

    @staticmethod
    def part_by_name(name: str) -> tuple[str, str]:
        n = (name or "").lower()
        if "cascade_shared" in n or "shared_prefix" in n:
            return "attn cascade shared-prefix", ""
        if "paged_decode" in n:
            return "attn decode (private part)", ""
        if "ragged_paged" in n:
            return "attn ragged (mixed step)", ""
        if "prefill_attention" in n:
            return "attn prefill", ""
        if "write_kv" in n:
            return "kv write", ""
        if "qkv_rope" in n:
            return "rope", ""
        if "rms_norm" in n:
            return "norms (+residual)", ""
        if "splice" in n:
            return "splice (copy-on-write)", ""
        if "memcpy" in n or "memset" in n:
            return "memcpy/memset", ""
        if re.search(r"gemm|nvjet|xmma|cutlass|cublas|sm90_", n) and "fusion" not in n:
            return "gemm (cuBLAS)", ""
        return "", ""

    def classify(self, name: str, hlo_op: str | None = None) -> tuple[str, str]:
        part, note = self.part_by_name(name)
        if part:
            return part, note
        for key in (hlo_op, name):
            if key and sanitize(key) in self.by_name:
                return self._part_of(self.by_name[sanitize(key)])
        if "fusion" in name or "copy" in name or "transpose" in name:
            return "xla kernel (unmapped)", name[:40]
        return "other", name[:40]


# ----------------------------------------------------------------------------------- trace reading

def read_xplane(path: str) -> tuple[list[dict], dict]:
    """GPU kernel events (name, start, end ns, hlo_op) sorted by start, and what planes/lines held."""
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(path)
    seen = {}
    events = []
    gpu = [pl for pl in pd.planes if pl.name.startswith("/device:GPU")]
    for pl in pd.planes:
        seen[pl.name] = [(ln.name, sum(1 for _ in ln.events)) for ln in pl.lines][:20]
    if gpu:
        for pl in gpu:
            lines = list(pl.lines)
            streams = [ln for ln in lines if ln.name.lower().startswith("stream")]
            for ln in streams or [ln for ln in lines if ln.name not in ("XLA Ops", "XLA Modules", "Launch Stats",
                                                                          "TensorFlow Ops", "Source code")]:
                for e in ln.events:
                    st = dict(e.stats)
                    events.append(dict(name=e.name, start=e.start_ns, end=e.start_ns + e.duration_ns,
                                       hlo_op=st.get("hlo_op"), line=ln.name,
                                       stats={k: str(v)[:300 if k == "kernel_details" else 80] for k, v in st.items()
                                              if not k.startswith("_")}))
    else:  # the CPU (--quick): XLA's thunks on the host with their HLO op names
        for pl in pd.planes:
            for ln in pl.lines:
                for e in ln.events:
                    st = dict(e.stats)
                    if "hlo_op" not in st:
                        continue
                    name = st["hlo_op"]
                    if MARK_STEP in str(st.get("hlo_module", "")) or MARK_BEGIN in str(st.get("hlo_module", "")):
                        name = MARK_STEP if MARK_STEP in str(st["hlo_module"]) else MARK_BEGIN
                    events.append(dict(name=name, start=e.start_ns, end=e.start_ns + e.duration_ns,
                                       hlo_op=st["hlo_op"], line=ln.name, stats={}))
    events.sort(key=lambda e: e["start"])
    return events, seen


def split_windows(events: list[dict], sequence: list[dict]) -> list[list[list[dict]]]:
    """Per sequence entry, its windows (lists of kernel events): each entry starts at a begin
    marker and holds ``windows`` windows, each ended by a step marker."""
    out, i, n = [], 0, len(events)

    def is_mark(e, which):
        return which in e["name"]

    for entry in sequence:
        while i < n and not is_mark(events[i], MARK_BEGIN):
            i += 1
        while i < n and is_mark(events[i], MARK_BEGIN):  # (a CPU marker is several thunks)
            i += 1
        wins = []
        for _ in range(entry["windows"]):
            cur = []
            while i < n and not is_mark(events[i], MARK_STEP):
                if not is_mark(events[i], MARK_BEGIN):
                    cur.append(events[i])
                i += 1
            while i < n and is_mark(events[i], MARK_STEP):
                i += 1
            wins.append(cur)
        out.append(wins)
    return out


def read_ncu(path: str) -> list[dict]:
    """ncu --csv (--print-units base) rows of gpu__time_duration.sum, in launch order."""
    rows = []
    with open(path, errors="replace") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        scale = {"ns": 1, "nsecond": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit, 1)
        rows.append(dict(id=int(r["ID"]), name=r["Kernel Name"], dur=v * scale))
    rows.sort(key=lambda r: r["id"])
    return rows


# ----------------------------------------------------------------------------------- analysis

def busy_ns(events: list[dict]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for e in sorted(events, key=lambda e: e["start"]):
        if cur_e is None or e["start"] > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = e["start"], e["end"]
        else:
            cur_e = max(cur_e, e["end"])
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def assign_cublas(parts: list[tuple[str, str]], cls: Classifier) -> list[tuple[str, str]]:
    """cuBLAS kernels (no HLO name) -> the cuBLAS calls of the HLO in schedule order, when counts match."""
    idx = [i for i, (p, _) in enumerate(parts) if p == "gemm (cuBLAS)"]
    if idx and len(idx) == len(cls.cublas):
        parts = list(parts)
        for i, p in zip(idx, cls.cublas):
            parts[i] = (p, "cuBLAS")
    return parts


def ceilings() -> dict | None:
    """This GPU's read bandwidth (bytes/s) and bf16 matmul rate (FLOP/s), measured now
    (``bench/lib/common.py``); None off a GPU.  (Before session 33 the floors used an H200's figures
    on every device, which put an H100's floors ~1.4x too low.)"""
    import jax

    if jax.default_backend() != "gpu":
        return None
    from common import matmul_ceiling, read_bandwidth

    try:  # (after the engine's warm-up: its page pool holds most of the memory; 2 GiB read, 8192^2 matmuls)
        out = dict(bandwidth=read_bandwidth(), compute=matmul_ceiling())
    except Exception as e:  # e.g. out of memory: the report falls back to the H200's figures and says so
        log(f"ceilings not measured ({type(e).__name__}: {str(e)[:200]}); the floors use an H200's")
        return None
    log(f"ceilings: read {out['bandwidth'] / 1e12:.2f} TB/s, matmul {out['compute'] / 1e12:.0f} TFLOP/s")
    return out


def floors(cap: dict, cfg: dict, ceil: dict | None = None) -> dict[str, float]:
    """Seconds: each part's floor for one step (max of bytes / bandwidth and FLOPs / compute, by
    ``ceil``: the ceilings measured once in the capturing run, else BANDWIDTH and COMPUTE)."""
    bandwidth = (ceil or {}).get("bandwidth") or BANDWIDTH
    compute = (ceil or {}).get("compute") or COMPUTE
    L, T, R = cfg["layers"], cap["tokens"], cap["rows"]
    kvb = 2 * cfg["kv"] * cfg["head_dim"] * 2  # K and V bytes per token per layer (bf16)
    out = {}
    for name, (k, n) in gemm_specs(cfg).items():
        m, layers = (R, 1) if name == "lm_head" else (T, L)
        out_bytes = 4 if name == "lm_head" else 2
        by = (k * n * 2 + m * k * 2 + m * n * out_bytes) * layers
        fl = 2 * m * k * n * layers
        out[f"gemm {name}"] = max(by / bandwidth, fl / compute)
    qk = 4 * cfg["heads"] * cfg["head_dim"] * L  # FLOPs per query-key pair, all layers
    out["attn cascade shared-prefix"] = max(cap["shared_tokens"] * kvb * L / bandwidth, cap["shared_pairs"] * qk / compute)
    priv = max(cap["private_tokens"] * kvb * L / bandwidth, cap["private_pairs"] * qk / compute)
    out["attn ragged (mixed step)" if cap["kind"] == "mixed" else "attn decode (private part)"] = priv
    out["kv write"] = T * kvb * L * 2 / bandwidth  # read + write of the new tokens' K/V
    out["sampler"] = R * cfg["vocab"] * 4 / bandwidth  # one read of the f32 logits
    out["norms (+residual)"] = 2 * L * T * cfg["hidden"] * 2 * 3 / bandwidth  # read x, residual, write h
    return out


def launch_desc(stats: dict) -> str:
    """A GPU kernel event's launch, from the trace's stats: theoretical occupancy and the kernel details (registers,
    shared memory, grid and block, as CUPTI reports them); "" when the trace has neither."""
    occ, det = stats.get("theoretical_occupancy_pct"), stats.get("kernel_details")
    parts = ([f"occupancy {float(occ):.0f}%"] if occ not in (None, "") else []) + ([str(det)] if det else [])
    return "; ".join(parts).replace("|", "/").replace("\n", " ")


def top_kernels(res: dict, n: int = 15) -> list[str]:
    """The report's table of the step's ``n`` costliest kernels, with each one's launch (``launch_desc``)."""
    launch = res.get("launch", {})
    out = ["Top 15 kernels:" if n == 15 else f"Top {n} kernels:", "",
           "| kernel | part | ms per step | launches per step | launch (occupancy; registers, shared memory, grid) |",
           "| --- | --- | --- | --- | --- |"]
    return out + [f"| `{k}` | {p} | {d:.3f} | {cnt:g} | {launch.get(k, '')} |" for p, k, d, cnt, _ in res["top"][:n]]


def summarize(windows: list[list[dict]], cls: Classifier, durations_only: bool = False) -> dict:
    """Per-window categories (ms per step, medians over windows) and per-kernel totals."""
    per_part = collections.defaultdict(list)
    kern = collections.defaultdict(float)
    kern_n = collections.Counter()
    notes = {}
    launch = {}  # kernel name -> its launch as the trace reports it (occupancy, registers, shared memory, grid)
    spans, busys, sums, counts = [], [], [], []
    for win in windows:
        if not win:
            continue
        parts = assign_cublas([cls.classify(e["name"], e.get("hlo_op")) for e in win], cls)
        acc = collections.defaultdict(float)
        for e, (p, note) in zip(win, parts):
            d = e["end"] - e["start"] if "end" in e else e["dur"]
            acc[p] += d
            kern[(p, e["name"][:70])] += d
            kern_n[(p, e["name"][:70])] += 1
            if note:
                notes[(p, e["name"][:70])] = note
            if e["name"][:70] not in launch and e.get("stats"):
                launch[e["name"][:70]] = launch_desc(e["stats"])
        for p in set(per_part) | set(acc):
            per_part[p].append(acc.get(p, 0.0))
        s = sum(acc.values())
        sums.append(s)
        counts.append(len(win))
        if not durations_only:
            spans.append(max(e["end"] for e in win) - win[0]["start"])
            busys.append(busy_ns(win))
    nw = max(1, len([w for w in windows if w]))
    res = dict(windows=nw, kernels=statistics.median(counts) if counts else 0,
               sum_ms=statistics.median(sums) / 1e6 if sums else 0.0,
               parts={p: statistics.mean(v + [0.0] * (nw - len(v))) / 1e6 for p, v in per_part.items()},
               top=sorted(((p, n, d / nw / 1e6, kern_n[(p, n)] / nw, notes.get((p, n), "")) for (p, n), d in kern.items()),
                          key=lambda r: -r[2]), launch=launch)
    if spans:
        res.update(span_ms=statistics.median(spans) / 1e6, busy_ms=statistics.median(busys) / 1e6)
    return res


PART_ORDER = ["attn cascade shared-prefix", "attn decode (private part)", "attn ragged (mixed step)", "attn prefill",
              "attention glue (merge, tables)", "kv write", "gemm qkv", "gemm o", "gemm gate_up", "gemm down",
              "gemm lm_head", "gemm other", "gemm split-K reduce", "gemm (cuBLAS)", "gemm glue", "norms (+residual)",
              "residual add", "rope", "mlp act (silu*up)", "sampler", "lm_head glue", "embedding",
              "step inputs/outputs", "copies/layout", "memcpy/memset", "splice (copy-on-write)",
              "xla kernel (unmapped)", "other"]


def _step_desc(c: dict) -> str:
    return (f"{c['kind']} step: {c['rows']} rows, {c['tokens']} tokens ({c['chunk_rows']} prefill chunks, "
            f"{c['chunk_tokens']} chunk tokens; {c['decode_rows']} decode rows), {c['groups']} cascade groups "
            f"({c['group_rows']} rows, {c['shared_tokens']} shared tokens), private K/V {c['private_tokens']} tokens; "
            f"bucket `{c['key']}`")


def table(res: dict, flo: dict | None, ncu: dict | None, ref_ms: float, top: int) -> list[str]:
    parts = dict(res["parts"])
    names = [p for p in PART_ORDER if p in parts or (ncu and p in ncu["parts"])]
    names += [p for p in sorted(set(parts) | set(ncu["parts"] if ncu else ())) if p not in names]
    head = "| part | ms per step (trace) | share of step | ncu ms | floor ms | x floor | top kernels (ms per step, count) |"
    lines = [head, "|" + " --- |" * 7]
    tops = collections.defaultdict(list)
    for p, n, d, cnt, note in res["top"]:
        tops[p].append(f"`{n}` {d:.3f} ({cnt:g}{', ' + note if note else ''})")
    for p in names:
        v = parts.get(p, 0.0)
        fl = (flo or {}).get(p)
        nv = ncu["parts"].get(p) if ncu else None
        lines.append(f"| {p} | {v:.3f} | {v / ref_ms:.1%} | {'' if nv is None else f'{nv:.3f}'} | "
                     f"{'' if fl is None else f'{1e3 * fl:.3f}'} | {'' if not fl else f'{v / (1e3 * fl):.1f}'} | "
                     f"{'; '.join(tops[p][:3])} |")
    if "span_ms" in res:
        gap = res["span_ms"] - res["busy_ms"]
        total_floor = 1e3 * sum(flo.values()) if flo else None
        ncu_sum = f"**{ncu['sum_ms']:.3f}** (sum)" if ncu else ""
        fl_txt = f"{total_floor:.3f}" if total_floor else ""
        x_txt = f"{res['span_ms'] / total_floor:.1f}" if total_floor else ""
        lines.append(f"| gaps inside the step (span - busy) | {gap:.3f} | {gap / ref_ms:.1%} | | | | |")
        lines.append(f"| **step span (first kernel start to last end)** | **{res['span_ms']:.3f}** | "
                     f"{res['span_ms'] / ref_ms:.0%} | {ncu_sum} | {fl_txt} | {x_txt} | "
                     f"{res['kernels']:g} kernels; kernels' sum {res['sum_ms']:.3f}, busy {res['busy_ms']:.3f} |")
    return lines


def _windows_from(evs: list[dict], reps: int) -> list[list[dict]]:
    """The ``reps`` windows after the begin marker, each ended by a step marker."""
    return split_windows(evs, [dict(windows=reps)])[0]


def analyze(raw: str, ncu_csv: str | None, ncu_raw: str | None = None, top: int = 3) -> str:
    meta = json.load(open(os.path.join(raw, "meta.json")))
    cfg = meta["cfg"]
    classifiers = {}

    def cls_for(cap):
        h = cap.get("hlo_path") or (os.path.join(raw, cap["hlo"]) if cap.get("hlo") else None)
        if h not in classifiers:
            text = gzip.open(h, "rt").read() if h and os.path.exists(h) else None
            classifiers[h] = Classifier(text, cfg)
        return classifiers[h]

    caps = meta["captures"]
    out = [f"# Graph-mode kernel profile of the engine's steps ({meta['device']}, jax {meta['jax']})", "",
           f"`{' '.join(meta['argv'])}`; XLA_FLAGS=`{meta['xla_flags']}`", ""]
    ceil = meta.get("ceilings")
    out += [f"Floors at this device's measured ceilings: read {ceil['bandwidth'] / 1e12:.2f} TB/s, matmul "
            f"{ceil['compute'] / 1e12:.0f} TFLOP/s" if ceil else
            f"Floors at an H200's ceilings (none measured here): read {BANDWIDTH / 1e12:.1f} TB/s, matmul "
            f"{COMPUTE / 1e12:.0f} TFLOP/s", ""]
    trace_res, ncu_res, seen_all = {}, {}, None
    for c in caps:
        if c.get("xplane") and os.path.exists(os.path.join(raw, c["xplane"])):
            events, seen = read_xplane(os.path.join(raw, c["xplane"]))
            seen_all = seen_all or (seen, collections.Counter(k for e in events[:3000] for k in e["stats"]))
            trace_res[c["id"]] = summarize(_windows_from(events, c["reps"]), cls_for(c))
    if seen_all:
        out += ["Trace planes: lines (events): " + "; ".join(f"{k}: {v[:6]}" for k, v in seen_all[0].items() if v)[:1200],
                "", f"GPU event stats seen: {dict(seen_all[1])}", ""]
    if ncu_csv and os.path.exists(ncu_csv):
        rows = read_ncu(ncu_csv)
        evs = [dict(name=r["name"], dur=r["dur"]) for r in rows]
        ncu_meta = json.load(open(os.path.join(ncu_raw, "meta.json"))) if ncu_raw else meta
        ncu_caps = ncu_meta["captures"]
        wins = split_windows(evs, [dict(windows=c["reps"]) for c in ncu_caps])
        for c, w in zip(ncu_caps, wins):
            # the trace's capture of the same step (kind and bucket), else the ncu capture on its own
            twin = next((t for t in caps if t["kind"] == c["kind"] and t["key"] == c["key"] and t["id"] not in ncu_res), None)
            if twin is None:
                twin = dict(c, id=f"ncu-{c['id']}", hlo=None)
                caps.append(twin)
            if ncu_raw and c.get("hlo") and not twin.get("hlo_path"):
                twin["hlo_path"] = os.path.join(ncu_raw, c["hlo"])
            ncu_res[twin["id"]] = summarize(w, cls_for(twin), durations_only=True)
        out += [f"ncu: {len(rows)} kernels profiled (`{os.path.basename(ncu_csv)}`)", ""]
    for c in caps:
        res, nres = trace_res.get(c["id"]), ncu_res.get(c["id"])
        if res is None and nres is None:
            continue
        ref = res["span_ms"] if res and "span_ms" in res else (nres or res)["sum_ms"]
        flo = floors(c, cfg, meta.get("ceilings"))
        out += [f"## Capture {c['id']}: {c['kind']} step", "", _step_desc(c), ""]
        if str(c["id"]).startswith("ncu-"):
            out += ["- (a step only the ncu run held: no trace of it)"]
        out += [f"- replayed with no tool on (graph mode, {meta['args']['time_reps']} back to back"
                f"{', under ncu outside its range' if str(c['id']).startswith('ncu-') else ''}): "
                f"**{c['replay_ms']:.2f} ms per step**, host {c['call_ms']:.3f} ms per call"]
        if "traced_ms" in c:
            out += [f"- replayed under the trace: {c['traced_ms']:.2f} ms per step, host {c['traced_call_ms']:.3f} ms "
                    "per call (graph mode when the host's call is a small part of the step)"]
        if res:
            out += [f"- trace: {res['windows']} replays, {res['kernels']:g} kernels per step, span {res.get('span_ms', 0):.3f} ms, "
                    f"busy {res.get('busy_ms', 0):.3f} ms, kernels' sum {res['sum_ms']:.3f} ms"]
        if nres:
            out += [f"- ncu: {nres['windows']} replays, {nres['kernels']:g} kernels per step, kernels' sum "
                    f"{nres['sum_ms']:.3f} ms (serialized, clocks not locked)"]
        out += [f"- floor of the whole step (sum of the parts' floors below): {1e3 * sum(flo.values()):.3f} ms", ""]
        out += table(res or nres, flo, nres if res else None, ref, top) + [""]
        out += top_kernels(res or nres) + [""]
    loop = meta.get("loop")
    if loop and meta.get("loop_xplane") and os.path.exists(os.path.join(raw, meta["loop_xplane"])):
        events, _ = read_xplane(os.path.join(raw, meta["loop_xplane"]))
        wins = _windows_from(events, len(loop))
        by_kind = collections.defaultdict(list)
        for plan, w, nxt in zip(loop, wins, wins[1:] + [None]):
            if not w:
                continue
            # device time per step: from this window's first kernel to the next window's first
            end = nxt[0]["start"] if nxt else max(e["end"] for e in w)
            by_kind[plan["kind"]].append((end - w[0]["start"], busy_ns(w), len(w), plan["tokens"]))
        out += ["## The production loop under the trace (overlap on; a marker after each dispatch)", "",
                "| steps | kind | device time per step p50 / mean ms | busy p50 ms | idle (waiting for the host) mean ms | "
                "kernels | tokens mean |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for kind, v in sorted(by_kind.items()):
            per, busy = [x[0] / 1e6 for x in v], [x[1] / 1e6 for x in v]
            out.append(f"| {len(v)} | {kind} | {statistics.median(per):.2f} / {statistics.mean(per):.2f} | "
                       f"{statistics.median(busy):.2f} | {statistics.mean(p - b for p, b in zip(per, busy)):.2f} | "
                       f"{statistics.median(x[2] for x in v):g} | {statistics.mean(x[3] for x in v):.0f} |")
        out += ["", f"Wall per step: {meta.get('loop_traced_ms', 0):.2f} ms under the trace, "
                f"{meta.get('loop_untraced_ms', 0):.2f} ms without ({meta.get('loop_untraced_kinds')})", ""]
    return "\n".join(out)


def main() -> None:
    from sections import closed_loop_parser  # bench/lib/sections.py

    ap = closed_loop_parser(__doc__, warm_steps=150)
    ap.add_argument("--mode", choices=["trace", "ncu"], default="trace")
    ap.add_argument("--mixed-captures", type=int, default=3, help="mixed steps held and replayed")
    ap.add_argument("--decode-reps", type=int, default=8, help="replays of the decode step under the tool")
    ap.add_argument("--mixed-reps", type=int, default=5, help="replays of each mixed step under the tool")
    ap.add_argument("--time-reps", type=int, default=20, help="replays timed without a tool")
    ap.add_argument("--loop-steps", type=int, default=24, help="production loop steps traced (trace mode)")
    ap.add_argument("--max-search-steps", type=int, default=400)
    ap.add_argument("--raw", default="/tmp/profile_graph_raw", help="raw outputs (meta.json, HLO, trace)")
    ap.add_argument("--analyze", metavar="RAW", help="only analyse a raw folder")
    ap.add_argument("--ncu-csv", help="ncu's --csv log to fold in (--analyze, or after a trace run)")
    ap.add_argument("--ncu-raw", help="the ncu run's raw folder (its meta.json: which steps it held)")
    ap.add_argument("--out", help="write the markdown report here")
    args = ap.parse_args()
    if args.quick:
        args.segment_tokens = min(args.segment_tokens, 512)
    if not args.analyze:
        run_workload(args)
        if args.mode == "ncu":
            return
    report = analyze(args.analyze or args.raw, args.ncu_csv, args.ncu_raw)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
