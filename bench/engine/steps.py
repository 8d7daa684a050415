"""Serving steps on one GPU: warm-up, decode step time vs the hardware floors, host time per
step, throughput at 256 concurrent requests, and compiles after warm-up under a mixed load.

Llama-3-8B shape (``bench/lib/common.py``), random bf16 weights, ``max_model_len`` 8192, the
engine's defaults otherwise (``max_batch`` and the page pool from memory, the token budget
``max(max_batch, 4 x prefill_chunk)``).  Sections (``--sections``, default all, in order):

- ``warmup``: ``Engine.warmup()``: buckets, seconds, JAX compilation-cache hits / misses (cold
  when the cache folder is empty, warm when a previous run filled it: run twice).
- ``decode``: one 4096-token segment (each B runs after the previous, so its pages are
  resident); B = 1, 64, 256 requests naming it (16-token questions,
  64 tokens each).  Per decode-only step: the wall interval between consecutive steps (median
  over the steady decode phase) and the host time (step wall time less the time blocked reading
  the previous step back).  With ``--decode-steps 1,4,8`` each B runs once per value
  (``Scheduler.decode_steps``: multi-step decode, inferscale_jax/decode_loop.py; a loop of N
  compiles in its first call, which the median leaves out): "step ms" is then the interval
  between consecutive loops divided by N (per decode step), "call ms" the loop's own.  Floors, measured in the same run: weight read = (non-embedding
  weights + LM head) bytes / read bandwidth (a device reduction over a 2 GiB array, measured
  before the engine takes the memory); compute =
  2 x (non-embedding params + LM head) x B / the bf16 matmul rate (an 8192-cube matmul chain, measured before the
  engine too; before session 45 a fixed 800 TFLOP/s over the non-embedding params, so the 256-row ratio read 2.35x
  where the README's floor at the measured rate gave 2.04x).  Ratios: step / max(floors).
- ``throughput``: 256 requests sharing the segment, submitted at once: output tokens / s, the median of
  three bursts after an untimed one (a burst that compiled is dropped).
- ``mixed``: ``--mixed-s`` seconds of random load (prompts 1..1500 tokens, 0-2 of four
  1000..3000-token segments, 1..128 output tokens, 20 % with logprobs, greedy or sampled; 32..160 in flight):
  completions and ``compiles_after_warmup`` (target 0).

    python bench/engine/steps.py --out bench/results              # H200
    python bench/engine/steps.py --quick --out /tmp/steps         # CPU: the harness only

Writes ``steps.json``, ``steps.md`` (table + command + device) and ``steps.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import matmul_ceiling, model_config, shape, timed_reps  # noqa: E402  (bench/lib/common.py)
from report import code_version  # noqa: E402  (bench/lib/report.py)
from common import read_bandwidth as common_read_bandwidth  # noqa: E402
from inferscale_jax import Engine, EngineConfig, SamplingParams  # noqa: E402
from models import init_params  # noqa: E402



def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def read_bandwidth(quick: bool) -> float:
    """The read-only ceiling (``common.read_bandwidth``), over 2 GiB (128 MiB with ``--quick``)."""
    return common_read_bandwidth((128 << 20) if quick else (2 << 30))


class Probe:
    """Wraps the runner: records each dispatch's kind and the time blocked in collect."""

    def __init__(self, engine):
        self.engine, self.events = engine, []
        r = engine.runner
        self._dispatch, self._collect = r.dispatch, r.collect
        r.dispatch, r.collect = self.dispatch, self.collect
        self.blocked = self.in_dispatch = 0.0
        self.cascade = False
        self.last_steps = 1

    def dispatch(self, plan, *a, **k):
        self.last_decode = all(len(x.tokens) == 1 for x in plan.rows)
        self.last_rows = len(plan.rows)
        self.cascade = plan.shared_pages > 0
        self.last_steps = plan.steps
        t = time.perf_counter()
        try:
            return self._dispatch(plan, *a, **k)
        finally:
            self.in_dispatch += time.perf_counter() - t

    def collect(self, pending):
        t = time.perf_counter()
        try:
            return self._collect(pending)
        finally:
            self.blocked += time.perf_counter() - t

    def run(self, e):
        """Step until idle; per step: (wall s, host s, decode-only, rows, s in dispatch, cascade,
        decode steps in the call)."""
        out = []
        while e.has_unfinished():
            self.blocked, self.in_dispatch, self.last_decode, self.last_rows = 0.0, 0.0, False, 0
            self.last_steps = 1
            t = time.perf_counter()
            e.step()
            wall = time.perf_counter() - t
            out.append((wall, wall - self.blocked, self.last_decode, self.last_rows, self.in_dispatch, self.cascade,
                        self.last_steps))
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="warmup,decode,throughput,mixed")
    ap.add_argument("--mixed-s", type=float, default=120.0)
    ap.add_argument("--tag", default="", help="suffix of the output files (e.g. warm)")
    ap.add_argument("--decode-steps", default="1", help="decode section: multi-step decode values, e.g. 1,4,8")
    args = ap.parse_args()
    sections = args.sections.split(",")
    os.makedirs(args.out, exist_ok=True)
    res = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
               jax=jax.__version__, command="python bench/engine/steps.py " + " ".join(sys.argv[1:]),
               code=code_version())
    t0 = time.perf_counter()
    bw = read_bandwidth(args.quick)  # before the page pool takes the device's memory
    flops = matmul_ceiling(256 if args.quick else 8192)  # the compute floor's rate, measured like the bandwidth
    cfg = model_config(shape(args.quick))
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16 if not args.quick else jnp.float32)
    jax.block_until_ready(params)
    res["weights_s"] = round(time.perf_counter() - t0, 2)
    conf = EngineConfig(dtype="bfloat16" if not args.quick else "float32", max_model_len=8192 if not args.quick else 2048,
                        hbm_pages=None if not args.quick else 2048)
    e = Engine(params, cfg, None, conf)
    res["engine_s"] = round(time.perf_counter() - t0, 2)
    st = e.stats()
    res.update(max_batch=st["max_batch"], budget=st["max_num_batched_tokens"], pages=st["pages_total"])
    log("engine", res)
    save = lambda: json.dump(res, open(os.path.join(args.out, f"steps{args.tag}.json"), "w"), indent=1)  # noqa: E731

    if "warmup" in sections:
        w = e.warmup(progress=lambda i, n: log(f"warm-up {i}/{n}") if i % 10 == 0 or i == n else None)
        st = e.stats()
        res["warmup"] = dict(w, ready_s=round(time.perf_counter() - t0, 2), cache_hits=st["compile_cache_hits"],
                             cache_misses=st["compile_cache_misses"])
        log("warmup", res["warmup"])
        save()

    nonembed = sum(x.size for x in jax.tree.leaves(params["layers"])) + params["final_norm"].size
    head = params["embed"].size if cfg.tie_word_embeddings else params["lm_head"].size
    itemsize = jnp.dtype(conf.dtype).itemsize
    weight_bytes = (nonembed + head) * itemsize
    res["floors"] = dict(read_GBps=round(bw / 1e9, 1), weight_bytes=int(weight_bytes),
                         weight_floor_ms=round(weight_bytes / bw * 1e3, 3), matmul_TFLOPs=round(flops / 1e12, 4))
    log("floors", res["floors"])
    rng = np.random.default_rng(0)
    seg_len = 4096 if not args.quick else 256
    e.register_segment("kb", token_ids=rng.integers(0, cfg.vocab_size, seg_len).tolist())
    probe = Probe(e)
    q = lambda n=16: rng.integers(0, cfg.vocab_size, n).tolist()  # noqa: E731

    if "decode" in sections:
        res["decode"] = []
        for n_steps, b in [(n, b) for n in map(int, args.decode_steps.split(",")) for b in (1, 64, 256)]:
            if b > e.max_batch:
                continue
            e.scheduler.decode_steps = n_steps
            sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            for _ in range(b):
                e.submit(prompt_token_ids=q(), segments=["kb"], sampling=sp)
            steps = probe.run(e)
            # steady decode steps with every row (a loop's first call compiles: left out too)
            dec = [s for s in steps if s[2] and s[3] == b and s[6] == n_steps][3 if n_steps == 1 else 1:]
            call = float(np.median([s[0] for s in dec])) if dec else float("nan")
            wall = call / n_steps
            host = float(np.median([s[1] for s in dec])) if dec else float("nan")
            disp = float(np.median([s[4] for s in dec])) if dec else float("nan")
            compute = 2 * (nonembed + head) * b / flops  # (every weight's multiply-add, the LM head's too)
            floor = max(weight_bytes / bw, compute)
            row = dict(rows=b, decode_steps=n_steps, steps=len(dec), step_ms=round(wall * 1e3, 3),
                       call_ms=round(call * 1e3, 3), host_ms=round(host * 1e3, 3),
                       dispatch_ms=round(disp * 1e3, 3), cascade_steps=sum(s[5] for s in dec),
                       weight_floor_ms=round(weight_bytes / bw * 1e3, 3), compute_floor_ms=round(compute * 1e3, 3),
                       ratio=round(wall / floor, 3), tokens_per_s=round(b / wall, 1))
            res["decode"].append(row)
            log("decode", row)
            save()
        e.scheduler.decode_steps = conf.decode_steps

    if "throughput" in sections:
        n = min(256, e.max_batch)
        sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        reqs = lambda: [dict(prompt_token_ids=q(), segments=["kb"], sampling=sp) for _ in range(n)]  # noqa: E731
        e.generate_batch(reqs())  # untimed: compiles what the warm-up section (if skipped) did not

        def burst():  # (seconds, output tokens, median TTFT) of one burst, its requests built beforehand
            batch = reqs()
            t = time.perf_counter()
            outs = e.generate_batch(batch)
            return (time.perf_counter() - t, sum(len(o.token_ids) for o in outs),
                    float(np.median([o.metrics.ttft_s for o in outs])))
        runs = timed_reps(e, burst, 1 if args.quick else 3, "throughput", log)  # compiling bursts dropped
        dt, toks, ttft = sorted(runs)[len(runs) // 2]  # the median burst
        res["throughput"] = dict(requests=n, output_tokens=toks, seconds=round(dt, 3), bursts=len(runs),
                                 tokens_per_s=round(toks / dt, 1), ttft_p50_ms=round(1e3 * ttft, 1),
                                 tokens_per_s_each=[round(k / d, 1) for d, k, _ in runs])
        log("throughput", res["throughput"])
        save()

    if "mixed" in sections:
        for i in range(4):
            e.register_segment(f"m{i}", token_ids=q(int(rng.integers(1000, 3000)) if not args.quick else 64))
        before = e.stats()["compiles_after_warmup"]
        done = submitted = 0
        t = time.perf_counter()
        target = int(rng.integers(32, 161))
        while time.perf_counter() - t < args.mixed_s or e.has_unfinished():
            if time.perf_counter() - t < args.mixed_s:
                inflight = submitted - done
                for _ in range(max(0, target - inflight)):
                    segs = [f"m{j}" for j in rng.choice(4, int(rng.integers(0, 3)), replace=False)]
                    sp = SamplingParams(max_tokens=int(rng.integers(1, 129)), ignore_eos=True,
                                        temperature=float(rng.choice([0.0, 0.7])), seed=int(rng.integers(0, 1 << 30)),
                                        logprobs=int(rng.integers(1, 6)) if rng.random() < 0.2 else None)
                    e.submit(prompt_token_ids=q(int(rng.integers(1, 1501 if not args.quick else 200))), segments=segs,
                             sampling=sp)
                    submitted += 1
                if rng.random() < 0.02:
                    target = int(rng.integers(32, 161))
            done += sum(o.finished for o in e.step())
        st = e.stats()
        res["mixed"] = dict(seconds=round(time.perf_counter() - t, 1), completions=done,
                            compiles_after_warmup=st["compiles_after_warmup"] - before,
                            padding_token_fraction=round(st["padding_token_fraction"], 3),
                            warm=st["warm"])
        log("mixed", res["mixed"])
        save()
    report(res, args)


def report(res, args):
    lines = [f"# Serving steps, {res['device']} (jax {res['jax']}), {res['date']}", "",
             f"`{res['command']}`; Llama-3-8B shape, bf16, random weights; max_batch {res['max_batch']}, "
             f"token budget {res['budget']}, {res['pages']} pages of 16 tokens; code {res['code']}.", ""]
    if "warmup" in res:
        w = res["warmup"]
        lines += ["## Warm-up", "", "| buckets | compiled or loaded | warm-up s | ready s (from start) | cache hits | "
                  "cache misses |", "|---|---|---|---|---|---|",
                  f"| {w['buckets']} | {w['compiled']} | {w['seconds']:.1f} | {w['ready_s']:.1f} | {w['cache_hits']} | "
                  f"{w['cache_misses']} |", ""]
    if "decode" in res:
        f = res["floors"]
        lines += ["## Decode step over a 4096-token segment", "",
                  f"Read bandwidth {f['read_GBps']} GB/s, bf16 matmul {f['matmul_TFLOPs']} TFLOP/s (both "
                  f"measured in this run: the floors' rates); weights read per step "
                  f"{f['weight_bytes'] / 1e9:.2f} GB. \"host ms\": step wall time less the time blocked reading "
                  "results back (it includes device time when the step call itself blocks).", "",
                  "| rows | decode steps per call | step ms | call ms | host ms per call | weight floor ms | "
                  "compute floor ms | step / floor | tokens/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r.get('decode_steps', 1)} | {r['step_ms']} | {r.get('call_ms', r['step_ms'])} "
                  f"| {r['host_ms']} | {r['weight_floor_ms']} | {r['compute_floor_ms']} "
                  f"| {r['ratio']} | {r['tokens_per_s']} |" for r in res["decode"]]
        lines.append("")
    if "throughput" in res:
        t = res["throughput"]
        lines += ["## 256 concurrent requests, one shared 4096-token segment", "",
                  f"{t['requests']} requests x 64 tokens: {t['output_tokens']} tokens in {t['seconds']} s = "
                  f"**{t['tokens_per_s']} output tokens/s** (TTFT p50 {t['ttft_p50_ms']} ms): the median of "
                  f"{t.get('bursts', 1)} bursts after an untimed one, none compiling "
                  f"(each: {t.get('tokens_per_s_each', [t['tokens_per_s']])} tok/s).", ""]
    if "mixed" in res:
        m = res["mixed"]
        lines += ["## Mixed random load after warm-up", "",
                  f"{m['seconds']} s, {m['completions']} completions, **{m['compiles_after_warmup']} compiles after "
                  f"warm-up**, padding {100 * m['padding_token_fraction']:.1f} % of step tokens.", ""]
    open(os.path.join(args.out, f"steps{args.tag}.md"), "w").write("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib: no plot")
        return
    if "decode" in res:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        rows = [f"{r['rows']}" + (f" x{r['decode_steps']}" if r.get("decode_steps", 1) > 1 else "")
                for r in res["decode"]]
        ax.bar(rows, [r["ratio"] for r in res["decode"]], color="tab:blue")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("decode rows")
        ax.set_ylabel("step time / max(weight, compute floor)")
        ax.set_title("Decode step vs floor (8B shape, 4k context)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"steps{args.tag}.png"), dpi=120)


if __name__ == "__main__":
    main()
