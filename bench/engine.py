"""End-to-end engine benchmark: TTFT with injected segments, full prefill, decode, HF peer.

Usage (from the repository root)::

    python bench/engine.py --out bench/results              # H200, Llama-3-8B shape, ~5-6 min
    python bench/engine.py --quick --out /tmp/eq            # tiny model on CPU, ~1 min
    python bench/engine.py --sections ab                    # only some sections
    python bench/engine.py --sections efg --rates 10,50     # continuous batching sections only

Model: Llama-3-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads, d=128, vocab 128256),
random bf16 weights generated on the device (``models.init_params``).  One ``Engine`` with
page 16, ``prefill_chunk=2048`` and ``min_table_pages=2048`` (one page-table width for every
step), so the 32-layer step compiles once per (batch, chunk) bucket: sections a-d use batch 1 with chunks 1024
(registering the 1k segment), 2048, 64 (questions) and 1 (decode) -- 4 compiles; e adds
(B, 16) and (B, 1) for B in 8/32/64/128; f precompiles (2/4/8, 64) and (2/4/16, 1) -- about 15
more compiles of ~3-4 s each.  ``max_batch=128``; with section e the page pool takes the
device memory left after the weights less 8 GiB (about 20k pages = 43 GB at 0.45 of an H200).

Sections (each guarded: a failure prints its traceback and the run goes on):

a. Device copy bandwidth: a donated jitted chain ``x = x + c`` over a 1 GiB bf16 random array,
   bytes = read + write = 2 * nbytes per step, median.  The decode floor uses it.
b. Our TTFT for L in {1k, 4k, 16k}: (1) segment of L tokens registered once, a 64-token
   question injected after it (``out.metrics.ttft_s`` and wall clock around ``generate``);
   (2) full prefill of L + 64 fresh random tokens (no prefix-cache hit possible); (3) the
   64-token question alone.  Every timed request draws new random question tokens.
c. HF transformers peer in the same run: ``LlamaForCausalLM``, same shape, bf16, sdpa, random
   init on the GPU.  Full prefill of L + 64 tokens, and prefix reuse two ways: eager (the L-token
   ``DynamicCache`` computed once; per request the 64-token question appended, then
   ``cache.crop(L)``: no copy of the prefix) and HF's fastest documented path (a ``StaticCache``
   holding the prefix, the question compiled with ``torch.compile(mode="reduce-overhead")``, i.e.
   CUDA graphs, written over the previous question's slots), all with ``use_cache=True, logits_to_keep=1`` (what ``generate`` does for its first token)
   and an argmax of the last logits, timed with ``torch.cuda.synchronize``.  Also one decode
   step over the 4k cache.  The model is freed before section d.  If torch cannot run in this
   process, the section retries in a child process (JAX holds only its memory fraction).
d. Decode at batch 1: ``generate(max_tokens=64)`` on a 64-token prompt and on a 4k injected
   segment + 64-token question (step = 1 / decode_tokens_per_s); ``runner.step`` called in a
   loop (one synchronous step: host packing + dispatch + device + read-back); and the device
   step alone (the same jitted step replayed back to back, cache donated, one sync at the end).
   Floor = weight bytes / copy bandwidth.
e. Shared-context decode throughput at B in 1/8/32/64/128: every request names ONE shared 4k
   segment + its own 16-token question (max_tokens=32, greedy, ignore_eos), all submitted at
   once and driven by ``engine.step()``; vs the same with a private 4k context per request
   (registered segments of different random tokens; only B whose contexts fit the pool); vs the
   weight-read floor B / (weight bytes / copy bw) and floors that add the KV bytes a step must
   read (shared context once, or every private context).  tok/s = tokens generated after every
   request holds its first token / wall time of that decode window (host clock around
   ``step()``, which reads back every step).  One warm-up run per B, median of 3 timed runs.
f. TTFT p50/p90/p99 under seeded Poisson arrivals (default 10 and 50 req/s, 1000 requests each):
   each request names one of 4 shared 2k segments + a 64-token question, max_tokens=16;
   submitted when the host clock passes its arrival time, ``step()`` in between.  TTFT = end
   of the ``step()`` returning the first token - scheduled arrival (``metrics.ttft_s``, from
   ``submit()``, also shown).  Step buckets precompiled and a warm-up run made first.
g. compose / blend TTFT vs exact for 3 segments of 2k + a 64-token question: exact on a cold
   chain (nodes [a,b], [a,b,c] computed in the request; 3 fresh triples), exact on the warm
   chain, compose and blend (first call with its compiles shown apart); plus exact over one
   segment and a full prefill of 6144+64 as references.

Targets: TTFT(4k injected) / TTFT(question alone) <= 1.5; HF full prefill / ours
injected >= 15x at 4k; HF prefix reuse / ours injected >= 5x at 4k; decode step / floor <= 1.3.
Writes ``engine.md``, ``engine.png`` (TTFT) and ``engine_batch.png`` (section e) to ``--out`` and
prints the summary table last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch (HF peer)

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
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
from common import model_config, read_bandwidth, shape  # noqa: E402  (bench/common.py)
from report import FAILURES, MD, log, pyplot, section, table, write_md  # noqa: E402  (bench/report.py)

Q = 64  # question tokens
R: dict = {"ours": {}, "hf": {}, "decode": {}, "registered": {}}
RNG = np.random.default_rng(1234)


# ---------------------------------------------------------------- helpers

def ms(sec):
    return "n/a" if sec is None else f"{sec * 1e3:.2f}"


def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def median(xs):
    return statistics.median(xs) if xs else None


def fresh(n, vocab):
    """New random token ids (never repeats a prefix: no prefix-cache hits)."""
    return RNG.integers(0, vocab, n).tolist()


# ---------------------------------------------------------------- setup

def settings(args):
    if args.quick:
        s = dict(Ls=[64, 256], dec_L=256, chunk=128, min_table=64, hbm_pages=1 + 1024,
                 reps=3, reps_full=2, dec_reps=2, step_reps=5, replay=5, hf_reps=2,
                 max_batch=8,
                 # e: shared vs private context decode
                 e_Bs=[1, 2, 4, 8], e_ctx=256, e_q=16, e_max_tokens=8, e_reps=2,
                 # f: arrivals
                 f_segs=4, f_ctx=128, f_q=Q, f_max_tokens=8, f_n=24, f_rates=[50.0, 200.0],
                 f_prefill_b=8, f_decode_b=8,
                 # g: compose / blend vs exact
                 g_ctx=128, g_cold=2, g_reps=3)
    else:
        s = dict(Ls=[1024, 4096, 16384], dec_L=4096, chunk=2048, min_table=2048,
                 hbm_pages=1 + 5120,  # 81920 tokens: 10.7 GB of bf16 KV (sized from free memory with e)
                 reps=10, reps_full=5, dec_reps=3, step_reps=30, replay=20, hf_reps=5,
                 max_batch=128,
                 e_Bs=[1, 8, 32, 64, 128], e_ctx=4096, e_q=16, e_max_tokens=32, e_reps=3,
                 f_segs=4, f_ctx=2048, f_q=Q, f_max_tokens=16, f_n=1000, f_rates=[10.0, 50.0],
                 f_prefill_b=8, f_decode_b=32,
                 g_ctx=2048, g_cold=3, g_reps=10)
    if args.e_batches:
        s["e_Bs"] = [int(x) for x in args.e_batches.split(",")]
    if args.rates:
        s["f_rates"] = [float(x) for x in args.rates.split(",")]
    if args.reps:
        s.update(reps=args.reps, reps_full=max(1, args.reps // 2), hf_reps=max(1, args.reps // 2))
    return s


class State:
    engine = None
    cfg = None
    weight_bytes = None
    embed_bytes = None
    read_bw = None  # read-only bandwidth, section a (bench/common.py)
    segments: dict = {}  # L -> token ids
    copy_bw = None


ST = State()


def kv_token_bytes(cfg):
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K + V, every layer


def pool_pages(args, cfg):
    """hbm_pages: the fixed default, or (section e on a device that reports its memory) as
    many pages as fit in this process's device memory less the weights and 8 GiB of headroom
    for step activations, capped at what e's private case at the largest batch could use."""
    s = args.s
    if "e" not in args.sections:
        return s["hbm_pages"]
    per_page = kv_token_bytes(cfg) * 16
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return s["hbm_pages"]
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - (8 << 30)
    # a private context's pages + the request's own pages past the context
    per_req = -(-s["e_ctx"] // 16) + -(-(s["e_ctx"] + s["e_q"] + s["e_max_tokens"]) // 16) - s["e_ctx"] // 16
    want = max(s["e_Bs"]) * per_req + 4096  # + other sections' segments
    pages = 1 + max(s["hbm_pages"] - 1, min(want, free // per_page))
    log(f"pool: {pages - 1} pages ({(pages - 1) * per_page / 1e9:.1f} GB of KV; device limit "
        f"{stats['bytes_limit'] / 1e9:.1f} GB, in use {stats.get('bytes_in_use', 0) / 1e9:.1f} GB)")
    return pages


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
    kw = dict(dtype="bfloat16", page_size=16, hbm_pages=pool_pages(args, cfg), prefill_chunk=s["chunk"],
              max_batch=s["max_batch"], overlap_decode=not args.no_overlap)
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

def ceiling():
    """Bytes/s the decode floors use: the fastest this device moved in section a (None before it)."""
    bws = [b for b in (ST.copy_bw, ST.read_bw) if b]
    return max(bws) if bws else None


def step_read_bytes():
    """Bytes a decode step must read: every weight but the embedding table (a step gathers only its
    tokens' rows; the LM head is its own matrix here, not tied)."""
    return ST.weight_bytes - ST.embed_bytes


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
    # read-only traffic (bench/common.py): decode reads and writes almost nothing, so its ceiling is
    # the fastest bytes/s this device was seen to move - the larger of the read-only and copy figures
    ST.read_bw = read_bandwidth((64 << 20) if args.quick else (2 << 30))
    rows.append(["sum (read only, float32 accumulate)", f"{(64 if args.quick else 2048) / 1024:.2f} GiB", "", "",
                 f"{ST.read_bw / 1e9:.0f}"])
    table("a. Device bandwidth (copies: read + write bytes; the sum: read bytes)",
          ["op", "bytes/step", "median us", "min us", "GB/s"], rows)
    MD.extend([f"Decode floors use the larger of the read-only and copy figures, {ceiling() / 1e9:.0f} GB/s "
               "(the hardest floor this run supports).", ""])


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
                # the question's K/V are appended to the prefix cache, then cropped off again: nothing
                # of the prefix is copied (a deepcopy of the whole cache, as before, costs ~0.5 GB at 4k)
                first_token(model(q, **{cache_kw: ctx}, use_cache=True, logits_to_keep=1)).item()
                ctx.crop(-q.shape[1])  # (negative: remove that many tokens; every transformers 5.x)

            res["reuse"][L] = timeit(reuse, lambda: (ids(Q),), 2, 2 * reps)
            print(f"  HF prefix reuse {L} + {Q} (eager, crop): {res['reuse'][L] * 1e3:.2f} ms", flush=True)
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
        res["attn_implementation"] = model.config._attn_implementation
        try:
            res["reuse_static"] = hf_static_reuse(model, dev, ids, first_token, timeit, cache_kw, spec)
        except Exception as e:  # noqa: BLE001 - reported, the eager rows stand
            print(f"  HF StaticCache + torch.compile path failed: {type(e).__name__}: {e}", flush=True)
            res["reuse_static_error"] = f"{type(e).__name__}: {e}"[:300]
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def rewind_static_cache(cache, n: int) -> None:
    """Make a ``StaticCache`` write its next tokens at position ``n``: transformers 5.2x layers count
    their own length (``cumulative_length``, a tensor updated in place, so CUDA graphs keep it);
    older ones take the write positions from ``cache_position`` alone (nothing to do)."""
    import torch

    for layer in getattr(cache, "layers", []):
        if torch.is_tensor(getattr(layer, "cumulative_length", None)):
            layer.cumulative_length.fill_(n)


def hf_static_reuse(model, dev, ids, first_token, timeit, cache_kw, spec) -> dict:
    """HF's fastest documented path for a reused prefix: a ``StaticCache`` holding the prefix's K/V
    and the Q-token question compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs on
    a GPU).  Reuse writes the question at positions L..L+Q-1 of the same static cache, overwriting
    the previous question there (the prefix slots are never touched, slots past the question are
    masked by ``cache_position``): no copy at all.  {L: seconds}."""
    import torch
    from transformers import StaticCache

    forward = torch.compile(model.forward, mode="reduce-overhead")
    out = {}
    for L in spec["Ls"]:
        cache = StaticCache(config=model.config, max_cache_len=L + Q)
        model(ids(L), **{cache_kw: cache}, cache_position=torch.arange(L, device=dev), use_cache=True,
              logits_to_keep=1)
        pos = torch.arange(L, L + Q, device=dev)

        def reuse(q, cache=cache, pos=pos, L=L):
            rewind_static_cache(cache, L)
            first_token(forward(q, **{cache_kw: cache}, cache_position=pos, use_cache=True,
                                logits_to_keep=1)).item()

        out[L] = timeit(reuse, lambda: (ids(Q),), 3, 2 * spec["reps"])
        print(f"  HF prefix reuse {L} + {Q} (StaticCache + torch.compile reduce-overhead): "
              f"{out[L] * 1e3:.2f} ms", flush=True)
        del cache
    return out


def hf_reuse(hf: dict, L: int):
    """HF's best prefix reuse at L: the faster of eager and StaticCache + torch.compile."""
    static = hf.get("reuse_static") or {}
    got = [x for x in (hf.get("reuse", {}).get(L), static.get(L), static.get(str(L))) if x]
    return min(got) if got else None


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
    static = res.get("reuse_static") or {}
    rows = [[L, ms(res["full"].get(L)), ms(res["reuse"].get(L)), ms(static.get(L) or static.get(str(L)))]
            for L in spec["Ls"]]
    table(f"c. HF transformers {res.get('transformers')} / torch {res.get('torch')} "
          f"({res['dtype']}, attention {res.get('attn_implementation', 'sdpa')}, {res['where']}; logits_to_keep=1)",
          ["L", f"full prefill L+{Q} ms", f"prefix reuse, eager (+{Q}, crop) ms",
           f"prefix reuse, StaticCache + torch.compile (+{Q}) ms"], rows)
    if res.get("reuse_static_error"):
        MD.extend([f"StaticCache + torch.compile path failed: {res['reuse_static_error']}", ""])
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

        # device step alone: the runner replays its last step back to back (ModelRunner.replay_last)
        dev_t = None
        try:
            runner.step([row])
            runner.replay_last(3)
            dev_t = median([runner.replay_last(replay) for _ in range(5)])
        except Exception:  # noqa: BLE001
            log("  device-step replay failed:\n" + traceback.format_exc())
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
    bw = ceiling()
    floor = step_read_bytes() / bw if bw else None
    R["floor"] = floor
    kv_tok = 2 * ST.cfg.num_layers * ST.cfg.num_kv_heads * ST.cfg.head_dim * 2  # bf16 K + V per token
    rows = []
    for name, d in R["decode"].items():
        tight = ((step_read_bytes() + kv_tok * d["ctx"]) / bw) if bw else None
        rows.append([name, d["ctx"], ms(d["gen"]), ms(d["sync"]), ms(d["dev"]), ms(floor),
                     ratio(d["gen"], floor), ratio(d["dev"], floor), ms(tight)])
    table(f"d. Decode step, batch 1 (floor = {step_read_bytes() / 1e9:.2f} GB of weights a step reads, the "
          f"embedding table left out / {(bw or 0) / 1e9:.0f} GB/s)",
          ["case", "ctx", "generate ms", "runner.step ms", "device ms", "floor ms",
           "generate/floor", "device/floor", "floor + KV ms"], rows)


# ---------------------------------------------------------------- (e) shared-context decode

def drop_segments(eng, names):
    for name in names:
        try:
            eng.delete_segment(name)
        except Exception as e:  # noqa: BLE001
            log(f"  could not delete {name}: {e!r}")


def greedy(max_tokens):
    from inferscale_jax.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def abort_all(eng, ids):
    """Free the pages of requests left unfinished by an error (the next section starts clean)."""
    for rid in ids:
        try:
            eng.abort(rid)
        except Exception:  # noqa: BLE001
            pass


def run_batch(eng, reqs):
    """Submit every request at once, then ``step()`` until all finish.

    Decode window: from the end of the first ``step()`` after which every request holds its
    first token, to the end of the last ``step()``.  tok/s = tokens produced in the window /
    its wall time (so prefill and TTFT stay out; every step in the window is a decode step
    over the requests still running).  Also returns the sum of per-request
    ``metrics.decode_tokens_per_s`` as a cross-check (equal for requests in lockstep)."""
    assert not eng.has_unfinished(), "engine has unfinished requests from an earlier run"
    st0, c0 = eng.stats(), eng.compiles
    t0 = time.perf_counter()
    ids = []
    first, outs = {}, {}
    t_all = None
    n_win = steps_win = 0
    steps = 0
    try:
        ids = [eng.submit(**r) for r in reqs]
        while eng.has_unfinished():
            res = eng.step()
            now = time.perf_counter()
            steps += 1
            for o in res:
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    if t_all is not None:
                        n_win += len(o.new_token_ids)
                if o.finished:
                    outs[o.request_id] = o.output
            if t_all is not None:
                steps_win += 1
            elif len(first) == len(ids):
                t_all = now
    except BaseException:
        abort_all(eng, ids)
        raise
    t_end = time.perf_counter()
    st1 = eng.stats()
    missing = [r for r in ids if r not in outs]
    assert not missing, f"{len(missing)} requests never finished"
    win = t_end - t_all if t_all is not None else 0.0
    return dict(
        tok_s=n_win / win if win > 0 and n_win else None,
        step=win / steps_win if steps_win else None,
        steps_win=steps_win, tokens_win=n_win,
        sum_dec=sum(outs[r].metrics.decode_tokens_per_s for r in ids),
        all_first=(t_all - t0) if t_all is not None else None,
        ttft=median([outs[r].metrics.ttft_s for r in ids]),
        generated=sum(outs[r].metrics.generated_tokens for r in ids),
        cached=[outs[r].metrics.cached_tokens for r in ids],
        wall=t_end - t0, steps=steps, compiles=eng.compiles - c0,
        preemptions=st1.get("preemptions", 0) - st0.get("preemptions", 0),
        outs=[outs[r] for r in ids])


def best_of(eng, make_reqs, reps, label):
    """One warm-up run (compiles its buckets), then ``reps`` timed runs; median tok/s.  A
    timed run that compiled is reported and not used."""
    w = run_batch(eng, make_reqs())
    if w["compiles"]:
        log(f"  {label}: warm-up compiled {w['compiles']} bucket(s) in {w['wall']:.1f} s")
    runs = []
    for _ in range(reps):
        r = run_batch(eng, make_reqs())
        if r["compiles"]:
            log(f"  WARNING {label}: a timed run compiled {r['compiles']} bucket(s); not used")
            continue
        runs.append(r)
    if not runs:
        raise RuntimeError(f"{label}: every timed run compiled")
    runs.sort(key=lambda r: r["tok_s"] or 0.0)
    m = runs[len(runs) // 2]
    m["tok_s_all"] = [r["tok_s"] for r in runs]
    m["preemptions"] = sum(r["preemptions"] for r in runs)
    return m


@section
def shared_decode(args):
    """e. Decode tokens/s at batch B: every request names one shared segment, vs each request
    its own private copy (different random tokens, same length), vs the weight-read floor."""
    s = args.s
    eng = get_engine(args)
    cfg, ps = ST.cfg, eng.config.page_size
    ctx, q, mt, Bs = s["e_ctx"], s["e_q"], s["e_max_tokens"], s["e_Bs"]
    # the earlier sections' segments are done with: give their pages to the private contexts
    drop_segments(eng, [f"seg{L}" for L in ST.segments])
    ST.segments.clear()
    shared_ids = fresh(ctx, cfg.vocab_size)
    t0 = time.perf_counter()
    eng.register_segment("shared_ctx", token_ids=shared_ids)
    log(f"  registered shared_ctx ({ctx} tokens): {time.perf_counter() - t0:.2f} s")
    private: list[str] = []
    res = {"shared": {}, "cascade": {}, "private": {}}
    R["batch"] = res
    cascade0 = ST.cascade0 = eng.config.cascade_decode
    try:
        def reqs(B, segs):
            return [dict(prompt_token_ids=fresh(q, cfg.vocab_size), segments=[segs[i % len(segs)]],
                         sampling=greedy(mt)) for i in range(B)]

        for B in Bs:
            for mode in [m for m in ("plain", "cascade") if m in args.e_modes]:
                key = "shared" if mode == "plain" else "cascade"
                # the scheduler reads config.cascade_decode every step: toggle it between runs
                set_cascade(eng, mode == "cascade")
                try:
                    r = best_of(eng, lambda: reqs(B, ["shared_ctx"]), s["e_reps"], f"{key} B={B}")
                except Exception:  # noqa: BLE001 - report, go on with the other batch sizes
                    tb = traceback.format_exc()
                    log(tb)
                    FAILURES.append(f"shared_decode ({key}, B={B}): {tb.strip().splitlines()[-1]}")
                    continue
                finally:
                    set_cascade(eng, cascade0)
                bad = sum(c != ctx for c in r["cached"])
                if bad:
                    FAILURES.append(f"e {key} B={B}: cached_tokens != {ctx} in {bad}/{B} requests")
                if r["generated"] != B * mt:
                    FAILURES.append(f"e {key} B={B}: generated {r['generated']} != {B * mt}")
                res[key][B] = r
                log(f"  {key:7s} B={B:4d}: {r['tok_s']:.0f} tok/s ({ms(r['step'])} ms/step over "
                    f"{r['steps_win']} steps; runs {[round(x) for x in r['tok_s_all']]}), all first tokens "
                    f"{ms(r['all_first'])} ms, preemptions {r['preemptions']}")

        if args.profile_step and "cascade" in args.e_modes and max(Bs) in res["cascade"]:
            profile_decode(eng, lambda: reqs(max(Bs), ["shared_ctx"]), max(Bs))

        # private: as many B as the pool holds (segment pages + each request's own pages)
        per_req = -(-ctx // ps) + -(-(ctx + q + mt) // ps) - ctx // ps
        free = eng.pool.num_free
        cap = int((free * 0.98) // per_req)
        res["cap"], res["per_req_pages"], res["pool_pages"] = cap, per_req, eng.pool.num_pages - 1
        pBs = [B for B in Bs if B <= cap] if "private" in args.e_modes else []
        log(f"  private: {per_req} pages per request, {free} free pages of {eng.pool.num_pages - 1}: "
            f"up to B={cap}; running B in {pBs}")
        try:
            private_runs(eng, s, res, pBs, private, reqs, ctx)
        except Exception:  # noqa: BLE001 - keep the shared numbers; report the private failure
            tb = traceback.format_exc()
            log(tb)
            FAILURES.append(f"shared_decode (private case): {tb.strip().splitlines()[-1]}")
    finally:
        drop_segments(eng, private + ["shared_ctx"])
    shared_decode_table(s, res, cfg, ps)


def set_cascade(eng, on: bool) -> None:
    """Section e compares cascade decode on and off on one engine (two 8B engines would not fit
    beside their pools); the scheduler holds the config it reads every step, so both change."""
    eng.config = eng.scheduler.config = dataclasses.replace(eng.config, cascade_decode=on)


def profile_decode(eng, make_reqs, B):
    """Device time per decode step by kernel (profiler trace) for one run of B shared-context
    requests with cascade decode: where the step time goes besides attention."""
    from profile_ops import kernel_times
    set_cascade(eng, True)
    box = {}

    def run():
        box["r"] = run_batch(eng, make_reqs())
    try:
        rows = kernel_times(run, 1, top=25)
    finally:
        set_cascade(eng, ST.cascade0)
    steps = box["r"]["steps"]
    tot = sum(t for _, _, t, _ in rows)
    table(f"e'. Device time by kernel, one run of B={B} shared-context requests with cascade decode "
          f"({steps} steps incl. prefill; per step = total / steps; top 25 kernel names, {tot / 1e3:.1f} ms "
          f"of device time in all, {box['r']['wall'] * 1e3:.1f} ms wall)",
          ["kernel", "us per step", "launches per step"],
          [[k, f"{t / steps:.1f}", f"{c / steps:.1f}"] for _, k, t, c in rows])


def private_runs(eng, s, res, pBs, private, reqs, ctx):
    """e, private case: register max(pBs) private contexts (names appended to ``private`` so the
    caller deletes them whatever happens), then run each B in pBs."""
    cfg = ST.cfg
    if not pBs:
        return
    t0 = time.perf_counter()
    ev0 = json.dumps(eng.stats().get("tiers"), default=str)
    for i in range(max(pBs)):
        name = f"private_ctx{i}"
        eng.register_segment(name, token_ids=fresh(ctx, cfg.vocab_size))
        private.append(name)
    res["private_register_s"] = time.perf_counter() - t0
    log(f"  registered {len(private)} private contexts of {ctx} tokens: {res['private_register_s']:.1f} s")
    for B in pBs:
        r = best_of(eng, lambda: reqs(B, private[:B]), s["e_reps"], f"private B={B}")
        bad = sum(c != ctx for c in r["cached"])
        if bad:
            FAILURES.append(f"e private B={B}: cached_tokens != {ctx} in {bad}/{B} requests "
                            "(a private context left HBM?)")
        res["private"][B] = r
        log(f"  private B={B:4d}: {r['tok_s']:.0f} tok/s ({ms(r['step'])} ms/step), preemptions "
            f"{r['preemptions']}")
    ev1 = json.dumps(eng.stats().get("tiers"), default=str)
    if ev0 != ev1:
        log(f"  note: tier stats changed during the private runs: {ev0} -> {ev1}")


def shared_decode_table(s, res, cfg, ps):
    ctx, q, mt, Bs = s["e_ctx"], s["e_q"], s["e_max_tokens"], s["e_Bs"]
    bw, W = ceiling(), step_read_bytes()
    kvt = kv_token_bytes(cfg)
    kv_ctx = kvt * (ctx + q + mt // 2)  # one sequence's KV at the middle of decode
    rows = []
    for B in Bs:
        sh, pr, ca = res["shared"].get(B, {}), res["private"].get(B, {}), res["cascade"].get(B, {})
        floor = B / (W / bw) if bw else None
        floor_sh = B / ((W + kvt * ctx + B * kvt * (q + mt // 2)) / bw) if bw else None
        floor_pr = B / ((W + B * kv_ctx) / bw) if bw else None
        res.setdefault("floor", {})[B] = (floor, floor_sh, floor_pr)
        f0 = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
        capped = res.get("cap") is not None and B > res["cap"]
        rows.append([B, f0(sh.get("tok_s")), ms(sh.get("step")), f0(ca.get("tok_s")), ms(ca.get("step")),
                     ratio(ca.get("tok_s"), sh.get("tok_s")),
                     f0(pr.get("tok_s")) if pr else (f"(B > {res['cap']})" if capped else "n/a"), ms(pr.get("step")),
                     ratio(sh.get("tok_s"), pr.get("tok_s")), ratio(ca.get("tok_s"), pr.get("tok_s")),
                     f0(floor), ratio(max(sh.get("tok_s") or 0, ca.get("tok_s") or 0) or None, floor),
                     f0(floor_sh), f0(floor_pr), ms(sh.get("all_first")), f0(sh.get("sum_dec"))])
    table(f"e. Decode tokens/s at batch B, context {ctx} + {q}-token question, {mt} tokens each "
          f"(greedy, ignore_eos; median of {s['e_reps']} runs)",
          ["B", "shared tok/s", "shared ms/step", "shared+cascade tok/s", "cascade ms/step", "cascade/shared",
           "private tok/s", "private ms/step", "shared/private", "cascade/private",
           "weight floor tok/s", "best/floor", "floor+KV shared", "floor+KV private",
           "shared: all first tokens ms", "shared: sum of per-request tok/s"], rows)
    MD.extend([
        f"tok/s = tokens generated after every request of the batch holds its first token / wall time "
        f"from then to the last token (host clock around `engine.step()`, which reads back every step); "
        f"'shared' = plain paged decode (each row reads the shared pages itself), 'shared+cascade' = "
        f"`EngineConfig.cascade_decode=True` (the shared pages read once per row block of the batch); "
        f"ms/step = that window / its steps.  Weight floor = B / (weight bytes a step reads {W / 1e9:.2f} GB / "
        f"{(bw or 0) / 1e9:.0f} GB/s, section a's ceiling).  floor+KV adds the KV bytes one decode step must read at "
        f"least: shared = the shared context once plus each request's own tokens; private = every "
        f"request's whole context ({kvt / 1024:g} KB/token).  'shared: sum of per-request tok/s' sums "
        f"`metrics.decode_tokens_per_s` (a cross-check).",
        f"Private contexts: each request holds its own {ctx}-token context ({res.get('per_req_pages')} "
        f"pages with its own tokens); the pool ({res.get('pool_pages')} pages of {ps} tokens) holds at most "
        f"B = {res.get('cap')} of them, so larger B are not run privately.", ""])


# ---------------------------------------------------------------- (f) TTFT under arrivals

def precompile(eng, pairs=None, cascade_pages=0):
    """Compile every step bucket now (``Engine.warmup``: decode, cascade and mixed buckets), so a
    timed run does not compile; ``pairs`` / ``cascade_pages`` (the shapes a section runs) are all
    in that set.  Returns the number of new compiles."""
    c0, t0 = eng.compiles, time.perf_counter()
    if not eng.runner.warm:
        eng.warmup()
    log(f"  precompiled {eng.compiles - c0} bucket(s): {time.perf_counter() - t0:.1f} s")
    return eng.compiles - c0


def pct(xs, p):
    return float(np.percentile(xs, p)) if len(xs) else None


def arrival_run(eng, segs, rate, n, q, mt, seed):
    """Poisson arrivals (seeded) at ``rate`` req/s: each request is submitted when the host
    clock passes its arrival time (between ``step()`` calls), then ``step()`` runs while
    anything is unfinished (the host sleeps only when the engine is idle).  TTFT = host time
    at the end of the ``step()`` that returned the request's first token - its scheduled
    arrival time (so it includes the wait for an in-flight step and the rest of the step that
    sampled it).  ``metrics.ttft_s`` counts from ``submit()`` to the sample inside that step."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    which = rng.integers(0, len(segs), n)
    prompts = [rng.integers(0, ST.cfg.vocab_size, q).tolist() for _ in range(n)]
    assert not eng.has_unfinished()
    st0, c0 = eng.stats(), eng.compiles
    arr, sub, first, outs = {}, {}, {}, {}
    running, steps = [], 0
    i = 0
    t0 = time.perf_counter()
    try:
        while i < n or eng.has_unfinished():
            now = time.perf_counter() - t0
            while i < n and arrivals[i] <= now:
                rid = eng.submit(prompt_token_ids=prompts[i], segments=[segs[which[i]]], sampling=greedy(mt))
                arr[rid], sub[rid] = arrivals[i], time.perf_counter() - t0
                i += 1
            if eng.has_unfinished():
                running.append(len(eng.scheduler.running) + len(eng.scheduler.waiting))
                res = eng.step()
                steps += 1
                t = time.perf_counter() - t0
                for o in res:
                    if o.new_token_ids:
                        first.setdefault(o.request_id, t)
                    if o.finished:
                        outs[o.request_id] = o.output
            elif i < n:
                time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
    except BaseException:
        abort_all(eng, list(arr))
        raise
    span = time.perf_counter() - t0
    st1 = eng.stats()
    ttft = [first[r] - arr[r] for r in arr]
    m_ttft = [outs[r].metrics.ttft_s for r in arr]
    lag = [sub[r] - arr[r] for r in arr]
    return dict(rate=rate, n=n, span=span, achieved=n / arrivals[-1], steps=steps,
                p50=pct(ttft, 50), p90=pct(ttft, 90), p99=pct(ttft, 99), max=max(ttft), mean=float(np.mean(ttft)),
                m_p50=pct(m_ttft, 50), m_p99=pct(m_ttft, 99), lag_p99=pct(lag, 99),
                e2e_p50=pct([outs[r].metrics.e2e_s for r in arr], 50),
                in_flight=float(np.mean(running)) if running else 0.0,  # running + waiting, per step
                compiles=eng.compiles - c0,
                preemptions=st1.get("preemptions", 0) - st0.get("preemptions", 0),
                generated=sum(outs[r].metrics.generated_tokens for r in arr))


@section
def arrival_ttft(args):
    """f. TTFT p50/p99 under Poisson arrivals: each request names one of 4 shared segments and
    adds a 64-token question."""
    s = args.s
    eng = get_engine(args)
    cfg = ST.cfg
    segs = [f"arr_ctx{i}" for i in range(s["f_segs"])]
    t0 = time.perf_counter()
    for name in segs:
        eng.register_segment(name, token_ids=fresh(s["f_ctx"], cfg.vocab_size))
    log(f"  registered {len(segs)} segments of {s['f_ctx']} tokens: {time.perf_counter() - t0:.2f} s")
    R["arrival"] = {}
    try:
        mb = eng.config.max_batch
        pb = [1 << k for k in range(8) if (1 << k) <= min(s["f_prefill_b"], mb)]
        db = [1 << k for k in range(8) if (1 << k) <= min(s["f_decode_b"], mb)]
        # decode groups of one segment use the cascade bucket of its full pages (bos + segment)
        casc = (1 + s["f_ctx"]) // eng.config.page_size if eng.config.cascade_decode else 0
        precompile(eng, [(b, s["f_q"]) for b in pb] + [(b, 1) for b in db], cascade_pages=casc)
        # warm-up: a short run at the highest rate (host paths, any bucket not precompiled)
        w = arrival_run(eng, segs, max(s["f_rates"]), max(8, s["f_n"] // 4), s["f_q"], s["f_max_tokens"], 999)
        log(f"  warm-up: {w['n']} requests, {w['compiles']} compile(s), p50 {ms(w['p50'])} ms")
        for k, rate in enumerate(s["f_rates"]):
            r = arrival_run(eng, segs, rate, s["f_n"], s["f_q"], s["f_max_tokens"], 100 + k)
            R["arrival"][rate] = r
            if r["compiles"]:
                FAILURES.append(f"f rate {rate}: {r['compiles']} compile(s) inside the timed run")
            if r["generated"] != r["n"] * s["f_max_tokens"]:
                FAILURES.append(f"f rate {rate}: generated {r['generated']} != {r['n'] * s['f_max_tokens']}")
            log(f"  rate {rate:g}/s: ttft p50 {ms(r['p50'])} p99 {ms(r['p99'])} ms, mean in flight "
                f"{r['in_flight']:.1f}, {r['steps']} steps in {r['span']:.1f} s, compiles {r['compiles']}")
    finally:
        drop_segments(eng, segs)
    rows = [[f"{rate:g}", f"{r['achieved']:.1f}", r["n"], ms(r["p50"]), ms(r["p90"]), ms(r["p99"]), ms(r["max"]),
             ms(r["m_p50"]), ms(r["m_p99"]), ms(r["lag_p99"]), ms(r["e2e_p50"]), f"{r['in_flight']:.1f}",
             r["preemptions"], r["compiles"]]
            for rate, r in R["arrival"].items()]
    table(f"f. TTFT under Poisson arrivals: one of {s['f_segs']} shared {s['f_ctx']}-token segments + "
          f"{s['f_q']}-token question, max_tokens={s['f_max_tokens']} (greedy)",
          ["rate req/s", "achieved", "requests", "ttft p50 ms", "p90", "p99", "max", "metrics ttft p50",
           "metrics p99", "submit lag p99", "e2e p50 ms", "mean in flight", "preemptions", "compiles"], rows)
    MD.extend([
        "ttft = host clock at the end of the `step()` that returned the first token - the scheduled "
        "(Poisson, seeded) arrival time: it includes waiting for the step in flight at arrival and the "
        "decode step that follows the prefill inside the same `step()`.  `metrics.ttft_s` counts from "
        "`submit()` (made at the first loop turn after the arrival time: 'submit lag') to the sample "
        "in the prefill step.  'mean in flight' = running + waiting requests, averaged over steps.  "
        + (f"With {s['f_n']} requests per rate p99 is close to the max: read p90.  " if s["f_n"] < 1000 else
           f"{s['f_n']} requests per rate.  ")
        + "Step buckets "
        "were precompiled and a warm-up run made first; 'compiles' counts compiles inside the timed run.", ""])


# ---------------------------------------------------------------- (g) compose / blend vs exact

@section
def modes(args):
    """g. TTFT of a request over 3 segments (+ a 64-token question) in each injection mode."""
    s = args.s
    eng = get_engine(args)
    cfg, n = ST.cfg, s["g_ctx"]
    # triples: 0 for compose, 1 for blend (chains never computed), 2.. for exact cold / warm
    sets = [[f"mode{k}_{c}" for c in "abc"] for k in range(s["g_cold"] + 2)]
    t0 = time.perf_counter()
    for names in sets:
        for name in names:
            eng.register_segment(name, token_ids=fresh(n, cfg.vocab_size))
    log(f"  registered {3 * len(sets)} segments of {n} tokens: {time.perf_counter() - t0:.2f} s")
    res = {}
    R["modes"] = res

    def one(segs, mode, prompt_n=Q):
        from inferscale_jax.sampling import SamplingParams
        c0, n0 = eng.compiles, len(eng.store.nodes())
        t = time.perf_counter()
        out = eng.generate(prompt_token_ids=fresh(prompt_n, cfg.vocab_size), segments=segs, mode=mode,
                           sampling=SamplingParams(max_tokens=1, temperature=0.0))
        return (out.metrics.ttft_s, time.perf_counter() - t, out.metrics.cached_tokens, eng.compiles - c0,
                len(eng.store.nodes()) - n0)

    def record(name, runs, note=""):
        res[name] = dict(ttft=median([r[0] for r in runs]), wall=median([r[1] for r in runs]),
                         cached=runs[-1][2], n=len(runs), compiles=sum(r[3] for r in runs),
                         nodes=sum(r[4] for r in runs), note=note)
        log(f"  {name}: ttft {ms(res[name]['ttft'])} ms (wall {ms(res[name]['wall'])}, cached "
            f"{res[name]['cached']}, n={len(runs)}, compiles {res[name]['compiles']}, new chain nodes "
            f"{res[name]['nodes']}) {note}")

    try:
        one(sets[0][:1], "exact")  # every bucket used below exists after this (chunk + question)
        # exact, cold chain: nodes [a, b] and [a, b, c] are computed inside the request
        record("exact, cold chain", [one(names, "exact") for names in sets[2:]],
               f"first use of each of {len(sets) - 2} segment triples")
        record("exact, warm chain", [one(sets[2], "exact") for _ in range(s["g_reps"])])
        record("exact, one segment (a) + question", [one(sets[2][:1], "exact") for _ in range(s["g_reps"])])
        record(f"full prefill {3 * n}+{Q} (no segments)",
               [one([], "exact", 3 * n + Q) for _ in range(max(2, s["g_reps"] // 4))])
        for mode, names in (("compose", sets[0]), ("blend", sets[1])):
            try:
                # a triple whose chain exact never computed: a mode that fell back to exact would
                # show new chain nodes (and cached = {n} on its first call)
                record(f"{mode}, first call", [one(names, mode)], "includes its compiles")
                record(mode, [one(names, mode) for _ in range(s["g_reps"])])
                if res[f"{mode}, first call"]["nodes"] or res[mode]["nodes"]:
                    res[mode]["note"] = "added chain nodes: ran as exact?"
                    log(f"  WARNING {mode}: added chain nodes, so it behaved like exact (not implemented yet?)")
            except NotImplementedError as e:
                log(f"  {mode}: not implemented ({e})")
                res[mode] = dict(ttft=None, wall=None, cached=None, n=0, compiles=0, nodes=0,
                                 note=f"not implemented: {e}")
    finally:
        drop_segments(eng, [x for names in sets for x in names])
    base = res.get("exact, warm chain", {}).get("ttft")
    rows = [[name, ms(d["ttft"]), ms(d["wall"]), d["cached"], ratio(d["ttft"], base), d["n"], d["compiles"],
             d["nodes"], d["note"]] for name, d in res.items()]
    table(f"g. TTFT by injection mode: 3 segments of {n} tokens + {Q}-token question (max_tokens=1, greedy; "
          "medians)", ["request", "ttft ms", "wall ms", "cached tokens", "/ exact warm", "runs", "compiles",
                       "new chain nodes", "note"], rows)
    MD.extend([
        "ttft = `metrics.ttft_s` (from `submit()`, inside `generate`, to the first sample; includes "
        "computing missing chain nodes at admission); wall = host clock around `generate`.  compose / "
        "blend keep no chain cache: every call splices (and blend recomputes) anew, so they run on a "
        "triple whose chain exact never computed and must add no chain nodes ('new chain nodes' > 0 "
        "means the mode ran as exact); their first call (compiles) is listed separately.", ""])


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
        hff, hfr = hf.get("full", {}).get(L), hf_reuse(hf, L)
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
             hf_reuse(hf, L) / inj if inj and hf_reuse(hf, L) else None, 5, False),
            (f"decode step (generate, {L} injected) / floor",
             dec.get("gen") / floor if dec.get("gen") and floor else None, 1.3, True),
            (f"decode step (device, {L} injected) / floor",
             dec.get("dev") / floor if dec.get("dev") and floor else None, 1.3, True)):
        v, verdict = judge(val, goal, le)
        out.append([name, v, ("<= " if le else ">= ") + str(goal), verdict])
    return out


def new_summaries(args):
    """Compact e / f / g tables for the end of the console output."""
    out = []
    b = R.get("batch") or {}
    if b.get("shared"):
        f0 = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
        rows = []
        for B in args.s["e_Bs"]:
            sh, pr = b["shared"].get(B, {}), b["private"].get(B, {})
            ca = (b.get("cascade") or {}).get(B, {})
            fl = (b.get("floor") or {}).get(B, (None, None, None))
            rows.append([B, f0(sh.get("tok_s")), f0(ca.get("tok_s")), ratio(ca.get("tok_s"), sh.get("tok_s")),
                         f0(pr.get("tok_s")) if pr else "-",
                         ratio(sh.get("tok_s"), pr.get("tok_s")), f0(fl[0]), ratio(sh.get("tok_s"), fl[0]),
                         ms(sh.get("step")), ms(ca.get("step")), ms(pr.get("step"))])
        out.append((f"Decode tok/s vs batch (ctx {args.s['e_ctx']}; private up to B={b.get('cap')})",
                    ["B", "shared", "cascade", "ca/sh", "private", "sh/pr", "weight floor", "sh/floor",
                     "sh ms/step", "ca ms/step", "pr ms/step"], rows))
    if R.get("arrival"):
        out.append(("TTFT under Poisson arrivals (ms)", ["rate/s", "p50", "p99", "max", "mean in flight", "compiles"],
                    [[f"{k:g}", ms(r["p50"]), ms(r["p99"]), ms(r["max"]), f"{r['in_flight']:.1f}", r["compiles"]]
                     for k, r in R["arrival"].items()]))
    if R.get("modes"):
        base = R["modes"].get("exact, warm chain", {}).get("ttft")
        out.append(("TTFT by injection mode, 3 segments (ms)", ["request", "ttft", "/ exact warm"],
                    [[k, ms(d["ttft"]), ratio(d["ttft"], base)] for k, d in R["modes"].items()]))
    return out


def plot_batch(args, plt, dev):
    b = R.get("batch") or {}
    if not b.get("shared"):
        return
    Bs = args.s["e_Bs"]
    fig, ax = plt.subplots(figsize=(7, 4.8))

    def line(d, key, **kw):
        xs = [B for B in Bs if d.get(B) is not None and (d[B] if key is None else d[B].get(key)) is not None]
        ys = [d[B] if key is None else d[B][key] for B in xs]
        if xs:
            ax.plot(xs, ys, **kw)

    line(b["shared"], "tok_s", marker="o", label=f"shared {args.s['e_ctx']}-token context, plain decode")
    line(b.get("cascade") or {}, "tok_s", marker="^", label="shared context, cascade decode")
    line(b["private"], "tok_s", marker="s", label=f"private contexts (pool holds B <= {b.get('cap')})")
    fl = b.get("floor") or {}
    line({B: v[0] for B, v in fl.items()}, None, ls="--", color="k", label="weight-read floor")
    line({B: v[1] for B, v in fl.items()}, None, ls=":", color="C0", label="floor: weights + shared KV once")
    line({B: v[2] for B, v in fl.items()}, None, ls=":", color="C1", label="floor: weights + private KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(Bs, [str(B) for B in Bs])
    ax.set_xlabel("batch (requests decoding together)")
    ax.set_ylabel("decode tokens/s (log scale)")
    ax.set_title(f"Decode throughput, {dev.device_kind}, {'tiny model' if args.quick else 'Llama-3-8B shape bf16'}")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out, "engine_batch.png")
    fig.savefig(png, dpi=120)
    log(f"wrote {png}")


def write_report(args, total_s):
    dev = jax.devices()[0]
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    head = [f"# Engine benchmark ({'quick, tiny model' if args.quick else 'Llama-3-8B shape, random bf16'})",
            "", f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
            f"- command: `python {cmd}`",
            f"- engine compiles: {ST.engine.compiles if ST.engine else 'n/a'}"
            + (f" ({len(ST.engine.runner.executables)} step executables)" if ST.engine else ""),
            f"- total time: {total_s:.0f} s"]
    hf = R.get("hf") or {}
    if hf:
        head.append(f"- HF peer: transformers {hf.get('transformers')}, torch {hf.get('torch')}, "
                    f"{hf.get('device')}, {hf.get('dtype')}, {hf.get('where')}")
    head.append("")
    if FAILURES:
        head += ["**FAILURES:**", ""] + [f"- {f}" for f in FAILURES] + [""]
    summ = ["## Summary: TTFT medians (ms) and ratios", "",
            "| L | ours injected | ours full prefill | question alone | HF full | HF reuse (best of eager, StaticCache + compile) | "
            "inj/question | HF full/inj | HF reuse/inj |", "|" + "---|" * 9]
    summ += ["| " + " | ".join(map(str, r)) + " |" for r in summary_rows(args)] + [""]
    summ += ["## Targets", "", "| ratio | value | target | verdict |", "|---|---|---|---|"]
    summ += ["| " + " | ".join(map(str, r)) + " |" for r in targets(args)] + [""]
    b = R.get("batch") or {}
    casc = [B for B in args.s["e_Bs"] if B in b.get("shared", {}) and B in b.get("cascade", {})]
    if casc:
        summ += ["Cascade decode (section e): shared-context decode throughput cascade / plain = " + ", ".join(
            f"{ratio(b['cascade'][B]['tok_s'], b['shared'][B]['tok_s'])} at B={B}" for B in casc) + ".", ""]
    both = [B for B in args.s["e_Bs"] if B in b.get("shared", {}) and B in b.get("private", {})]
    if both:
        summ += ["Shared vs private context (section e): decode throughput shared / private = " + ", ".join(
            f"{ratio(b['shared'][B]['tok_s'], b['private'][B]['tok_s'])} at B={B}" for B in both)
            + f"; private runs stop at B={b.get('cap')} (pool).", ""]
    write_md(args.out, "engine.md", head + summ + MD)
    plt = pyplot()
    if plt is None:
        return
    try:
        plot_batch(args, plt, dev)
    except Exception:  # noqa: BLE001
        log("engine_batch.png failed:\n" + traceback.format_exc())
    Ls = args.s["Ls"]
    hf = R.get("hf") or {}
    q = R.get("question", (None, None))[0]
    series = [("ours injected", [R["ours"].get(L, {}).get("inj", (None,))[0] for L in Ls]),
              ("ours full prefill", [R["ours"].get(L, {}).get("full", (None,))[0] for L in Ls]),
              ("ours question alone", [q for _ in Ls]),
              ("HF full prefill", [hf.get("full", {}).get(L) for L in Ls]),
              ("HF prefix reuse", [hf_reuse(hf, L) for L in Ls])]
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
    ap.add_argument("--sections", default="abcdefg",
                    help="subset of a (copy), b (our TTFT), c (HF), d (decode), e (shared vs private context "
                         "decode at batch B), f (TTFT under Poisson arrivals), g (compose/blend vs exact)")
    ap.add_argument("--e-modes", default="plain,cascade,private",
                    help="section e cases: plain (shared context, paged decode), cascade (shared context, "
                         "cascade decode), private (a private context per request)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="EngineConfig(overlap_decode=False): read each decode step before the next")
    ap.add_argument("--profile-step", action="store_true",
                    help="section e: device time by kernel of one cascade run at the largest B")
    ap.add_argument("--e-batches", default=None, help="section e batch sizes, comma separated")
    ap.add_argument("--rates", default=None, help="section f arrival rates, req/s, comma separated")
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
    if any(c in args.sections for c in "ade"):
        copy_bandwidth(args)
    if "b" in args.sections:
        ttft(args)
    if "c" in args.sections:
        hf_peer(args)
    if "d" in args.sections:
        decode(args)
    if "e" in args.sections:
        shared_decode(args)
    if "f" in args.sections:
        arrival_ttft(args)
    if "g" in args.sections:
        modes(args)
    total = time.time() - t0
    write_report(args, total)
    # the last thing printed: the summary the lead sees
    if ST.engine is not None:
        st = ST.engine.stats()
        log(f"\nengine.stats(): compiles={st['compiles']} executables={len(ST.engine.runner.executables)} "
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
    for title, headers, rows in new_summaries(args):
        table(title, headers, rows, md=False)
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
