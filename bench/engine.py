"""End-to-end engine benchmark: TTFT with injected segments, full prefill, decode, HF peer.

Usage (from the repository root)::

    python bench/engine.py --out bench/results              # H200, Llama-3-8B shape, ~5-7 min
    python bench/engine.py --quick --out /tmp/eq            # tiny model on CPU, ~1 min
    python bench/engine.py --sections ab                    # only some sections

Model: Llama-3-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads, d=128, vocab 128256),
random bf16 weights generated on the device (``models.init_params``).  One ``Engine`` with
page 16, ``prefill_chunk=2048`` and ``min_table_pages=2048`` (one page-table width for every
step), so the 32-layer step compiles once per chunk bucket: 1024 (registering the 1k
segment), 2048, 64 (questions) and 1 (decode) -- 4 compiles in all.

Sections (each guarded: a failure prints its traceback and the run goes on):

a. Device copy bandwidth: a donated jitted chain ``x = x + c`` over a 1 GiB bf16 random array,
   bytes = read + write = 2 * nbytes per step, median.  The decode floor uses it.
b. Our TTFT for L in {1k, 4k, 16k}: (1) segment of L tokens registered once, a 64-token
   question injected after it (``out.metrics.ttft_s`` and wall clock around ``generate``);
   (2) full prefill of L + 64 fresh random tokens (no prefix-cache hit possible); (3) the
   64-token question alone.  Every timed request draws new random question tokens.
c. HF transformers peer in the same run: ``LlamaForCausalLM``, same shape, bf16, sdpa, random
   init on the GPU.  Full prefill of L + 64 tokens, and prefix reuse (the L-token
   ``DynamicCache`` computed once, ``copy.deepcopy`` per request, then the 64-token question),
   both with ``use_cache=True, logits_to_keep=1`` (what ``generate`` does for its first token)
   and an argmax of the last logits, timed with ``torch.cuda.synchronize``.  Also one decode
   step over the 4k cache.  The model is freed before section d.  If torch cannot run in this
   process, the section retries in a child process (JAX holds only its memory fraction).
d. Decode at batch 1: ``generate(max_tokens=64)`` on a 64-token prompt and on a 4k injected
   segment + 64-token question (step = 1 / decode_tokens_per_s); ``runner.step`` called in a
   loop (one synchronous step: host packing + dispatch + device + read-back); and the device
   step alone (the same jitted step replayed back to back, cache donated, one sync at the end).
   Floor = weight bytes / copy bandwidth.

Targets (PERF.md): TTFT(4k injected) / TTFT(question alone) <= 1.5; HF full prefill / ours
injected >= 15x at 4k; HF prefix reuse / ours injected >= 5x at 4k; decode step / floor <= 1.3.
Writes ``engine.md`` and ``engine.png`` to ``--out`` and prints the summary table last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch (HF peer)

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

Q = 64  # question tokens
FAILURES: list[str] = []
MD: list[str] = []
R: dict = {"ours": {}, "hf": {}, "decode": {}, "registered": {}}
RNG = np.random.default_rng(1234)


# ---------------------------------------------------------------- helpers

def log(msg=""):
    print(msg, flush=True)


def ms(sec):
    return "n/a" if sec is None else f"{sec * 1e3:.2f}"


def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def median(xs):
    return statistics.median(xs) if xs else None


def table(title, headers, rows, md=True):
    """Print a table (and add it to the markdown report)."""
    log(f"\n## {title}")
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    log("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        log("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    if md:
        MD.extend([f"## {title}", "", "| " + " | ".join(map(str, headers)) + " |",
                   "|" + "---|" * len(headers)])
        MD.extend("| " + " | ".join(map(str, r)) + " |" for r in rows)
        MD.append("")


def section(fn):
    """Run one section; print its traceback instead of stopping the script."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        log(f"\n==== {fn.__name__} ====")
        t0 = time.time()
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - report and go on
            tb = traceback.format_exc()
            log(tb)
            FAILURES.append(f"{fn.__name__}: {tb.strip().splitlines()[-1]}")
            MD.extend([f"## {fn.__name__}: FAILED", "", "```", tb, "```", ""])
        log(f"({fn.__name__}: {time.time() - t0:.0f} s)")
    return run


def fresh(n, vocab):
    """New random token ids (never repeats a prefix: no prefix-cache hits)."""
    return RNG.integers(0, vocab, n).tolist()


# ---------------------------------------------------------------- setup

def shape(quick):
    if quick:
        return dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16,
                    theta=500000.0, max_pos=2048, eps=1e-5)
    return dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv=8, head_dim=128,
                theta=500000.0, max_pos=32768, eps=1e-5)


def settings(args):
    if args.quick:
        s = dict(Ls=[64, 256], dec_L=256, chunk=128, min_table=64, hbm_pages=1 + 1024,
                 reps=3, reps_full=2, dec_reps=2, step_reps=5, replay=5, hf_reps=2)
    else:
        s = dict(Ls=[1024, 4096, 16384], dec_L=4096, chunk=2048, min_table=2048,
                 hbm_pages=1 + 5120,  # 81920 tokens: 10.7 GB of bf16 KV
                 reps=10, reps_full=5, dec_reps=3, step_reps=30, replay=20, hf_reps=5)
    if args.reps:
        s.update(reps=args.reps, reps_full=max(1, args.reps // 2), hf_reps=max(1, args.reps // 2))
    return s


def model_config(sh):
    from models import ModelConfig, RopeConfig
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=sh["vocab"], hidden_size=sh["hidden"],
                       intermediate_size=sh["inter"], num_layers=sh["layers"], num_heads=sh["heads"],
                       num_kv_heads=sh["kv"], head_dim=sh["head_dim"], rms_norm_eps=sh["eps"],
                       rope=RopeConfig(theta=sh["theta"]), max_position_embeddings=sh["max_pos"])


class State:
    engine = None
    cfg = None
    weight_bytes = None
    embed_bytes = None
    segments: dict = {}  # L -> token ids
    copy_bw = None


ST = State()


def get_engine(args):
    if ST.engine is not None:
        return ST.engine
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.engine import Engine
    from models import init_params

    s = args.s
    cfg = model_config(shape(args.quick))
    t0 = time.time()
    params = init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    jax.block_until_ready(params)
    leaves = jax.tree_util.tree_leaves(params)
    ST.weight_bytes = sum(x.nbytes for x in leaves)
    ST.embed_bytes = params["embed"].nbytes
    log(f"params: {sum(x.size for x in leaves) / 1e9:.3f} B, {ST.weight_bytes / 1e9:.2f} GB, "
        f"init {time.time() - t0:.1f} s")
    kw = dict(dtype="bfloat16", page_size=16, hbm_pages=s["hbm_pages"], prefill_chunk=s["chunk"],
              max_batch=8)
    if "min_table_pages" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kw["min_table_pages"] = s["min_table"]
    else:
        log("EngineConfig has no min_table_pages: every page-table width bucket compiles anew")
    t0 = time.time()
    ST.engine = Engine(params, cfg, None, EngineConfig(**kw))
    ST.cfg = cfg
    log(f"engine: {kw}, attention {ST.engine.stats()['attention_impl']}, {time.time() - t0:.1f} s")
    return ST.engine


def ensure_segment(args, L):
    """Register seg{L} once (timed; the first use of a chunk bucket includes its compile)."""
    eng = get_engine(args)
    if L in ST.segments:
        return f"seg{L}"
    ids = fresh(L, ST.cfg.vocab_size)
    c0, t0 = eng.compiles, time.perf_counter()
    eng.register_segment(f"seg{L}", token_ids=ids)
    dt = time.perf_counter() - t0
    ST.segments[L] = ids
    R["registered"][L] = (dt, eng.compiles - c0)
    log(f"  registered seg{L}: {dt:.2f} s ({eng.compiles - c0} new compiles)")
    return f"seg{L}"


def timed_generate(eng, ids, segs, max_tokens=1):
    from inferscale_jax.sampling import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    out = eng.generate(prompt_token_ids=ids, segments=segs, sampling=sp)
    return out, time.perf_counter() - t0


def measure_ttft(eng, name, n_tokens, segs, warm, reps, expect_cached):
    """Median (ttft_s, wall) over reps requests of n_tokens fresh tokens, after warm-ups."""
    c0 = eng.compiles
    t0 = time.perf_counter()
    for _ in range(warm):
        timed_generate(eng, fresh(n_tokens, ST.cfg.vocab_size), segs)
    if eng.compiles > c0:
        log(f"  {name}: warm-up with {eng.compiles - c0} new compile(s): {time.perf_counter() - t0:.1f} s")
    ttft, wall, bad = [], [], 0
    for _ in range(reps):
        out, w = timed_generate(eng, fresh(n_tokens, ST.cfg.vocab_size), segs)
        ttft.append(out.metrics.ttft_s)
        wall.append(w)
        bad += out.metrics.cached_tokens != expect_cached
    if bad:
        FAILURES.append(f"{name}: cached_tokens != {expect_cached} in {bad}/{reps} runs")
        log(f"  WARNING {name}: cached_tokens != {expect_cached} in {bad}/{reps} runs")
    log(f"  {name}: ttft {ms(median(ttft))} ms (min {ms(min(ttft))}, max {ms(max(ttft))}), "
        f"wall {ms(median(wall))} ms")
    return median(ttft), median(wall)


# ---------------------------------------------------------------- (a) copy bandwidth

@section
def copy_bandwidth(args):
    """Ceiling: the faster of a donated ``x = x + c`` (XLA fusion) and a device memcpy, both
    counting bytes read + written (bench/kernels.py measures it the same way)."""
    n = (16 if args.quick else 1024) * 2**20 // 2
    x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.bfloat16)
    c = jnp.asarray(0.5, jnp.bfloat16)
    add = jax.jit(lambda a, b: a + b, donate_argnums=0)
    cp = jax.jit(lambda a: jax.lax.optimization_barrier(a).copy())
    box = [x]
    steps = {"x = x + c (donated)": lambda: box.__setitem__(0, add(box[0], c)),
             "copy": lambda: box.__setitem__(0, cp(box[0]))}
    rows, bws = [], []
    for name, step in steps.items():
        for _ in range(3):  # compile + warm up
            step()
        jax.block_until_ready(box[0])
        times, chain = [], 10  # steps per sample, one sync: the host round trip stays out
        for _ in range(5 if args.quick else 15):
            t0 = time.perf_counter()
            for _ in range(chain):
                step()
            jax.block_until_ready(box[0])
            times.append((time.perf_counter() - t0) / chain)
        t = median(times)
        nbytes = 2 * box[0].nbytes
        bws.append(nbytes / t)
        rows.append([name, f"{nbytes / 2**30:.2f} GiB", f"{t * 1e6:.0f}", f"{min(times) * 1e6:.0f}",
                     f"{bws[-1] / 1e9:.0f}"])
    ST.copy_bw = max(bws)
    del box
    table("a. Device copy bandwidth (read + write; the faster is the ceiling)",
          ["op", "bytes/step", "median us", "min us", "GB/s"], rows)


# ---------------------------------------------------------------- (b) our TTFT

@section
def ttft(args):
    s = args.s
    eng = get_engine(args)
    for L in s["Ls"]:  # buckets: chunk-sized (and 1024 for the 1k segment)
        ensure_segment(args, L)
    # the question alone first: compiles the T=64 bucket every later request shares
    R["question"] = measure_ttft(eng, "question alone", Q, [], 2, s["reps"], 0)
    for L in s["Ls"]:
        R["ours"].setdefault(L, {})["inj"] = measure_ttft(
            eng, f"injected seg{L} + {Q}", Q, [f"seg{L}"], 2, s["reps"], L)
    for L in s["Ls"]:
        reps = s["reps_full"] if L < 16384 else max(3, s["reps_full"] - 2)
        R["ours"][L]["full"] = measure_ttft(eng, f"full prefill {L}+{Q}", L + Q, [], 1, reps, 0)
    rows = [["question alone", Q, ms(R["question"][0]), ms(R["question"][1]), ""]]
    for L in s["Ls"]:
        d = R["ours"][L]
        rows.append([f"injected seg{L}", L + Q, ms(d["inj"][0]), ms(d["inj"][1]),
                     ratio(d["inj"][0], R["question"][0])])
        rows.append(["full prefill", L + Q, ms(d["full"][0]), ms(d["full"][1]),
                     ratio(d["full"][0], R["question"][0])])
    table("b. Our TTFT (max_tokens=1, greedy; medians)",
          ["request", "tokens", "ttft ms", "wall ms", "/ question alone"], rows)
    rows = [[L, f"{dt:.2f}", n] for L, (dt, n) in sorted(R["registered"].items())]
    table("b. Segment registration (one-shot, includes compiles of new buckets)",
          ["L", "seconds", "new compiles"], rows)


# ---------------------------------------------------------------- (c) HF peer

def run_hf(spec: dict) -> dict:
    """The HF transformers peer; returns {"full": {L: s}, "reuse": {L: s}, "decode": s, ...}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sh, quick = spec["shape"], spec["quick"]
    dev = torch.device("cpu" if quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    config = LlamaConfig(vocab_size=sh["vocab"], hidden_size=sh["hidden"], intermediate_size=sh["inter"],
                         num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
                         num_key_value_heads=sh["kv"], head_dim=sh["head_dim"], rms_norm_eps=sh["eps"],
                         rope_parameters={"rope_type": "default", "rope_theta": sh["theta"]},
                         max_position_embeddings=sh["max_pos"], tie_word_embeddings=False,
                         attn_implementation="sdpa")
    config.dtype = dtype
    t0 = time.time()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    p = next(model.parameters())
    res = {"device": str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
           "torch": torch.__version__, "dtype": str(p.dtype), "full": {}, "reuse": {}, "decode": None}
    import transformers
    res["transformers"] = transformers.__version__
    print(f"  HF model on {p.device} {p.dtype}, {sum(x.numel() for x in model.parameters()) / 1e9:.3f} B "
          f"params, built in {time.time() - t0:.1f} s", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(99)

    def ids(n):
        return torch.randint(0, sh["vocab"], (1, n), generator=gen).to(dev)

    def first_token(out):
        return out.logits[:, -1].argmax(-1)

    # transformers renamed past_key_values -> cache (5.2x); the GPU machine has 5.17
    import inspect
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def out_cache(out):
        c = getattr(out, "cache", None) if cache_kw == "cache" else None
        return c if c is not None else out.past_key_values

    def timeit(fn, make_inputs, warm, reps):
        for _ in range(warm):
            fn(*make_inputs())
        sync()
        times = []
        for _ in range(reps):
            inp = make_inputs()
            sync()
            t0 = time.perf_counter()
            fn(*inp)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    reps = spec["reps"]
    with torch.inference_mode():
        def full(x):
            first_token(model(x, use_cache=True, logits_to_keep=1)).item()

        for L in spec["Ls"]:
            res["full"][L] = timeit(full, lambda: (ids(L + Q),), 1, reps if L < 16384 else max(3, reps - 2))
            print(f"  HF full prefill {L}+{Q}: {res['full'][L] * 1e3:.2f} ms", flush=True)
        for L in spec["Ls"]:
            ctx = out_cache(model(ids(L), use_cache=True, logits_to_keep=1))

            def reuse(q, ctx=ctx):
                c = copy.deepcopy(ctx)
                first_token(model(q, **{cache_kw: c}, use_cache=True, logits_to_keep=1)).item()

            res["reuse"][L] = timeit(reuse, lambda: (ids(Q),), 2, 2 * reps)
            print(f"  HF prefix reuse {L} + {Q}: {res['reuse'][L] * 1e3:.2f} ms", flush=True)
            if L == spec["dec_L"]:
                # one decode step, batch 1, over the L + Q cache (the cache grows by one per step)
                c = copy.deepcopy(ctx)
                tok = first_token(model(ids(Q), **{cache_kw: c}, use_cache=True, logits_to_keep=1))
                times = []
                for i in range(4 + 2 * reps):
                    sync()
                    t0 = time.perf_counter()
                    tok = first_token(model(tok[:, None], **{cache_kw: c}, use_cache=True,
                                            logits_to_keep=1))
                    tok.item()
                    times.append(time.perf_counter() - t0)
                res["decode"] = statistics.median(times[4:])
                print(f"  HF decode step over {L}+{Q}: {res['decode'] * 1e3:.2f} ms", flush=True)
                del c
            del ctx
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def hf_spec(args):
    s = args.s
    return dict(shape=shape(args.quick), quick=args.quick, Ls=s["Ls"], dec_L=s["dec_L"], reps=s["hf_reps"])


@section
def hf_peer(args):
    spec = hf_spec(args)
    try:
        res = run_hf(spec)
        res["where"] = "same process"
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
        if args.quick or args.no_hf_child:
            raise
        log("  HF in this process failed: retrying in a child process")
        gc.collect()
        try:
            import torch
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
        cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker", json.dumps(spec)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        log(p.stdout[-4000:] + p.stderr[-4000:])
        line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith("HF_RESULT ")), None)
        if line is None:
            raise RuntimeError(f"HF child process failed (rc {p.returncode})")
        res = json.loads(line[len("HF_RESULT "):])
        res["full"] = {int(k): v for k, v in res["full"].items()}
        res["reuse"] = {int(k): v for k, v in res["reuse"].items()}
        res["where"] = "child process"
    R["hf"] = res
    rows = [[L, ms(res["full"].get(L)), ms(res["reuse"].get(L))] for L in spec["Ls"]]
    table(f"c. HF transformers {res.get('transformers')} / torch {res.get('torch')} "
          f"({res['dtype']}, sdpa, {res['where']}; logits_to_keep=1)",
          ["L", f"full prefill L+{Q} ms", f"prefix reuse (deepcopy + {Q}) ms"], rows)
    if res.get("decode"):
        log(f"  HF decode step over {spec['dec_L']}+{Q}: {ms(res['decode'])} ms")
        MD.extend([f"HF decode step, batch 1, over {spec['dec_L']}+{Q} tokens: {ms(res['decode'])} ms", ""])


# ---------------------------------------------------------------- (d) decode

def fill_pages(eng, n_tokens):
    """Own pages holding n_tokens of real KV (prefilled with chunk-sized and 64-token steps,
    buckets already compiled) plus room for one more token."""
    from inferscale_jax.runner import StepRow
    s, chunk = eng.config.page_size, eng.config.prefill_chunk
    pages = eng.pool.allocate(-(-(n_tokens + 1) // s))
    assert pages is not None, "KV pool too small for the decode benchmark"
    ids = fresh(n_tokens, ST.cfg.vocab_size)
    pos = 0
    while pos < n_tokens:
        m = chunk if n_tokens - pos >= chunk else min(Q, n_tokens - pos)
        eng.runner.step([StepRow(ids[pos:pos + m], pos, pages)])
        pos += m
    return pages


def step_times(eng, ctx, reps, replay):
    """(synchronous runner.step median, replayed device step) for one decode step at ctx."""
    import inferscale_jax.runner as runner_mod
    from inferscale_jax.kv_cache import PagedKVCache
    from inferscale_jax.runner import StepRow

    runner = eng.runner
    pages = fill_pages(eng, ctx)
    try:
        row = StepRow([int(RNG.integers(0, ST.cfg.vocab_size))], ctx, pages)
        c0 = eng.compiles
        for _ in range(3):
            runner.step([row])
        if eng.compiles > c0:
            log(f"  WARNING: runner.step at ctx {ctx} compiled {eng.compiles - c0} new bucket(s)")
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.step([row])
            times.append(time.perf_counter() - t0)
        sync_t = median(times)

        # device step alone: capture the jitted call runner.step makes, replay it back to back
        dev_t = None
        try:
            orig, box = runner_mod._model_step, {}

            def spy(*a, **k):
                box["a"], box["k"] = list(a), dict(k)
                return orig(*a, **k)

            runner_mod._model_step = spy
            try:
                runner.step([row])
            finally:
                runner_mod._model_step = orig
            a, k = box["a"], box["k"]
            ci = next((i for i, x in enumerate(a) if isinstance(x, PagedKVCache)), None)
            ck = next((n for n, x in k.items() if isinstance(x, PagedKVCache)), None)
            assert ci is not None or ck is not None, "no PagedKVCache argument found in _model_step"

            def run(m):
                cache, out = runner.cache, None
                runner.cache = None  # donated below; restored after
                try:
                    for _ in range(m):
                        if ci is not None:
                            a[ci] = cache
                        else:
                            k[ck] = cache
                        out, cache = orig(*a, **k)
                    jax.block_until_ready((out, cache))
                finally:
                    runner.cache = cache
                return out

            run(3)
            dts = []
            for _ in range(5):
                t0 = time.perf_counter()
                run(replay)
                dts.append((time.perf_counter() - t0) / replay)
            dev_t = median(dts)
        except Exception:  # noqa: BLE001
            log("  device-step replay failed (runner internals changed?):\n" + traceback.format_exc())
        return sync_t, dev_t
    finally:
        eng.pool.decref(reversed(pages))


@section
def decode(args):
    s = args.s
    eng = get_engine(args)
    dec_L = s["dec_L"]
    seg = ensure_segment(args, dec_L)
    cases = [("64-token prompt", []), (f"seg{dec_L} + {Q} injected", [seg])]
    for name, segs in cases:
        c0, t0 = eng.compiles, time.perf_counter()
        timed_generate(eng, fresh(Q, ST.cfg.vocab_size), segs, max_tokens=8)  # warm up (T=1 compile)
        if eng.compiles > c0:
            log(f"  decode warm-up with {eng.compiles - c0} new compile(s): {time.perf_counter() - t0:.1f} s")
        steps = []
        for _ in range(s["dec_reps"]):
            out, _ = timed_generate(eng, fresh(Q, ST.cfg.vocab_size), segs, max_tokens=64)
            assert out.metrics.generated_tokens == 64, out.metrics
            steps.append(1.0 / out.metrics.decode_tokens_per_s)
        R["decode"][name] = {"gen": median(steps)}
        log(f"  generate decode, {name}: {ms(median(steps))} ms/step")
    for name, ctx in (("64-token prompt", 2 * Q), (f"seg{dec_L} + {Q} injected", dec_L + Q)):
        sync_t, dev_t = step_times(eng, ctx, s["step_reps"], s["replay"])
        R["decode"][name].update(ctx=ctx, sync=sync_t, dev=dev_t)
        log(f"  ctx {ctx}: runner.step {ms(sync_t)} ms, device step {ms(dev_t)} ms")
    bw = ST.copy_bw
    floor = ST.weight_bytes / bw if bw else None
    R["floor"] = floor
    kv_tok = 2 * ST.cfg.num_layers * ST.cfg.num_kv_heads * ST.cfg.head_dim * 2  # bf16 K + V per token
    rows = []
    for name, d in R["decode"].items():
        tight = ((ST.weight_bytes - ST.embed_bytes + kv_tok * d["ctx"]) / bw) if bw else None
        rows.append([name, d["ctx"], ms(d["gen"]), ms(d["sync"]), ms(d["dev"]), ms(floor),
                     ratio(d["gen"], floor), ratio(d["dev"], floor), ms(tight)])
    table(f"d. Decode step, batch 1 (floor = {ST.weight_bytes / 1e9:.2f} GB weights / "
          f"{(bw or 0) / 1e9:.0f} GB/s)",
          ["case", "ctx", "generate ms", "runner.step ms", "device ms", "floor ms",
           "generate/floor", "device/floor", "floor w/o embed + KV ms"], rows)


# ---------------------------------------------------------------- report

def summary_rows(args):
    s = args.s
    hf = R.get("hf") or {}
    q = R.get("question", (None, None))[0]
    rows = []
    for L in s["Ls"]:
        d = R["ours"].get(L, {})
        inj = d.get("inj", (None, None))[0]
        full = d.get("full", (None, None))[0]
        hff, hfr = hf.get("full", {}).get(L), hf.get("reuse", {}).get(L)
        rows.append([L, ms(inj), ms(full), ms(q), ms(hff), ms(hfr), ratio(inj, q), ratio(hff, inj),
                     ratio(hfr, inj)])
    return rows


def targets(args):
    L = args.s["dec_L"]
    d = R["ours"].get(L, {})
    inj = d.get("inj", (None, None))[0]
    q = R.get("question", (None, None))[0]
    hf = R.get("hf") or {}
    dec = R["decode"].get(f"seg{L} + {Q} injected", {})
    floor = R.get("floor")

    def judge(val, goal, le):
        if val is None:
            return "n/a", "n/a"
        return f"{val:.2f}", ("PASS" if (val <= goal if le else val >= goal) else "MISS")

    out = []
    for name, val, goal, le in (
            (f"TTFT({L} injected) / TTFT(question alone)", inj / q if inj and q else None, 1.5, True),
            (f"HF full prefill / ours injected at {L}",
             hf.get("full", {}).get(L) / inj if inj and hf.get("full", {}).get(L) else None, 15, False),
            (f"HF prefix reuse / ours injected at {L}",
             hf.get("reuse", {}).get(L) / inj if inj and hf.get("reuse", {}).get(L) else None, 5, False),
            (f"decode step (generate, {L} injected) / floor",
             dec.get("gen") / floor if dec.get("gen") and floor else None, 1.3, True),
            (f"decode step (device, {L} injected) / floor",
             dec.get("dev") / floor if dec.get("dev") and floor else None, 1.3, True)):
        v, verdict = judge(val, goal, le)
        out.append([name, v, ("<= " if le else ">= ") + str(goal), verdict])
    return out


def write_report(args, total_s):
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    head = [f"# Engine benchmark ({'quick, tiny model' if args.quick else 'Llama-3-8B shape, random bf16'})",
            "", f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
            f"- command: `python {cmd}`",
            f"- engine compiles: {ST.engine.compiles if ST.engine else 'n/a'}"
            + (f" (buckets {sorted(ST.engine.runner.buckets)})" if ST.engine else ""),
            f"- total time: {total_s:.0f} s"]
    hf = R.get("hf") or {}
    if hf:
        head.append(f"- HF peer: transformers {hf.get('transformers')}, torch {hf.get('torch')}, "
                    f"{hf.get('device')}, {hf.get('dtype')}, {hf.get('where')}")
    head.append("")
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    summ = ["## Summary: TTFT medians (ms) and ratios", "",
            "| L | ours injected | ours full prefill | question alone | HF full | HF reuse | "
            "inj/question | HF full/inj | HF reuse/inj |", "|" + "---|" * 9]
    summ += ["| " + " | ".join(map(str, r)) + " |" for r in summary_rows(args)] + [""]
    summ += ["## Targets", "", "| ratio | value | target | verdict |", "|---|---|---|---|"]
    summ += ["| " + " | ".join(map(str, r)) + " |" for r in targets(args)] + [""]
    path = os.path.join(args.out, "engine.md")
    with open(path, "w") as f:
        f.write("\n".join(head + summ + MD) + "\n")
    log(f"\nwrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"no plot: matplotlib unavailable ({e!r})")
        return
    Ls = args.s["Ls"]
    hf = R.get("hf") or {}
    q = R.get("question", (None, None))[0]
    series = [("ours injected", [R["ours"].get(L, {}).get("inj", (None,))[0] for L in Ls]),
              ("ours full prefill", [R["ours"].get(L, {}).get("full", (None,))[0] for L in Ls]),
              ("ours question alone", [q for _ in Ls]),
              ("HF full prefill", [hf.get("full", {}).get(L) for L in Ls]),
              ("HF prefix reuse", [hf.get("reuse", {}).get(L) for L in Ls])]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    w = 0.16
    x = np.arange(len(Ls))
    for i, (name, vals) in enumerate(series):
        v = [np.nan if t is None else t * 1e3 for t in vals]
        bars = ax.bar(x + (i - 2) * w, v, w, label=name)
        for b, t in zip(bars, v):
            if np.isfinite(t):
                ax.annotate(f"{t:.0f}" if t >= 10 else f"{t:.1f}", (b.get_x() + b.get_width() / 2, t),
                            ha="center", va="bottom", fontsize=6)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{L} + {Q}" for L in Ls])
    ax.set_xlabel("context tokens + question tokens")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(f"TTFT, {dev.device_kind}, {'tiny model' if args.quick else 'Llama-3-8B shape bf16'}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(args.out, "engine.png")
    fig.savefig(png, dpi=120)
    log(f"wrote {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--quick", action="store_true", help="tiny model, runs on CPU")
    ap.add_argument("--sections", default="abcd", help="subset of a (copy), b (our TTFT), c (HF), d (decode)")
    ap.add_argument("--reps", type=int, default=None, help="override the TTFT repetitions")
    ap.add_argument("--no-hf-child", action="store_true", help="do not retry the HF peer in a child process")
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:  # child process: the HF peer only, result as the last line
        spec = json.loads(args.hf_worker)
        res = run_hf(spec)
        print("HF_RESULT " + json.dumps(res), flush=True)
        return
    args.s = settings(args)
    log(f"devices: {jax.devices()}  jax {jax.__version__}  sections {args.sections}  settings {args.s}")
    t0 = time.time()
    if "a" in args.sections or "d" in args.sections:
        copy_bandwidth(args)
    if "b" in args.sections:
        ttft(args)
    if "c" in args.sections:
        hf_peer(args)
    if "d" in args.sections:
        decode(args)
    total = time.time() - t0
    write_report(args, total)
    # the last thing printed: the summary the lead sees
    if ST.engine is not None:
        st = ST.engine.stats()
        log(f"\nengine.stats(): compiles={st['compiles']} buckets={sorted(ST.engine.runner.buckets)} "
            f"pages used/total={st['pages_used']}/{st['pages_total']} attention={st['attention_impl']}")
    if "d" in args.sections and R["decode"]:
        rows = [[n, d.get("ctx"), ms(d.get("gen")), ms(d.get("sync")), ms(d.get("dev")), ms(R.get("floor")),
                 ratio(d.get("gen"), R.get("floor")), ratio(d.get("dev"), R.get("floor"))]
                for n, d in R["decode"].items()]
        hf_dec = (R.get("hf") or {}).get("decode")
        if hf_dec:
            rows.append([f"HF transformers, seg{args.s['dec_L']} + {Q} reuse", args.s["dec_L"] + Q, ms(hf_dec),
                         "", "", ms(R.get("floor")), ratio(hf_dec, R.get("floor")), ""])
        table("Decode step, batch 1 (ms)", ["case", "ctx", "generate", "runner.step", "device", "floor",
                                            "gen/floor", "dev/floor"], rows, md=False)
    log(f"\ncopy bandwidth {ST.copy_bw / 1e9:.0f} GB/s" if ST.copy_bw else "\ncopy bandwidth n/a")
    compiles = ST.engine.compiles if ST.engine else "n/a"
    table(f"Summary: TTFT medians ms ({jax.devices()[0].device_kind}, total {total:.0f} s, "
          f"engine compiles {compiles})",
          ["L", "ours inj", "ours full", "question", "HF full", "HF reuse", "inj/q", "HFfull/inj",
           "HFreuse/inj"], summary_rows(args), md=False)
    table("Targets", ["ratio", "value", "target", "verdict"], targets(args), md=False)
    if FAILURES:
        log("\nFAILURES:\n  " + "\n  ".join(FAILURES))
        sys.exit(1)


if __name__ == "__main__":
    main()
