"""Bulk precompute throughput vs our batched prefill's peak on one long sequence (issue 8).

Usage (from the repository root)::

    python bench/engine/bulk_precompute.py --out bench/results          # H200, Llama-3-8B shape, ~3-4 min
    python bench/engine/bulk_precompute.py --quick --out /tmp/pq        # tiny model on CPU, ~1 min

Model: Llama-3-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads, d=128, vocab 128256), random
bf16 weights generated on the device (``models.init_params``), the embedded default model's
tokenizer (its 1024 ids are valid ids of the big vocabulary), so the whole pipeline runs: JSONL
-> grain (parse, hash, tokenize, length buckets) -> ``Engine.register_segments_batch``.  Engine:
page 16, ``prefill_chunk`` 2048, ``max_batch`` = ``--batch``, the page pool sized from free device
memory (``hbm_pages=None``), ``min_table_pages`` covering the longest document (one table width).

Corpus: ``--docs`` documents (default: as many as make ``--tokens`` tokens) of random words from
the default model's corpus, lengths uniform in [``--min-len``, ``--max-len``] tokens (approximately:
the measured token counts are reported).

0. **Compute ceiling**: the bf16 FLOP/s of a chain of 8192^3 matmuls (``common.matmul_ceiling``;
   256^3 with ``--quick``), measured once before the engine is built.  MFU below is a rate of useful
   FLOPs over the 989 TFLOP/s datasheet peak (``common.H200_BF16_PEAK``) and over that measured
   ceiling.
1. **Peak**: ``register_segment`` of one sequence of L random tokens (L in ``--peak-lens``),
   chunked prefill at ``prefill_chunk`` tokens per step; one warm-up registration of the same L
   first (compiles), then the median of ``--reps`` timed ones (each deleted again).  Peak = the best
   L's tokens / s.  Its FLOPs: ``common.forward_flops(shape, T=L, C=0, lm_head_tokens=ceil(L /
   prefill_chunk))`` - every layer's matmuls for the L tokens, causal attention's unmasked pairs,
   and the LM head for the one row of logits each chunk's step computes (the runner samples every
   row's last token, a registration included).
2. **Precompute**: the corpus under tenant ``warmup`` (compiles every step shape the corpus needs;
   timed and reported as "first run"), its segments deleted, then the same corpus under tenant
   ``bench`` (new prefix-cache roots: everything is computed again), timed end to end
   (pipeline + device steps + registration).  A spy on ``runner.step`` counts steps, rows and
   padded vs computed tokens (the runner pads rows and chunk lengths to powers of two).  Its
   FLOPs are the mean-length approximation: tokens/s x ``forward_flops(shape, T=M, C=0,
   lm_head_tokens=rows / documents) / M`` with M the mean document length (rows / documents: the
   logits rows, one per chunk of a document).  Attention grows with the square of a length, so
   with lengths spread around M this undercounts the attention FLOPs slightly (MFU errs low).
3. **Verdict**: precompute tokens/s / peak tokens/s, target >= 0.80, with both MFUs beside it (the
   two count FLOPs per token at their own lengths, so their ratio is not the tokens/s ratio).

Persistence: by default the engine has no ``snapshot_dir`` (the peak has none either): the
durable registry's fsync per document and the final snapshot are not in the figure; with
``--snapshot-dir DIR`` they are (the snapshot timed apart).  ``--quick`` always uses a temporary
snapshot dir, so the CPU run covers the whole path.  Writes ``precompute.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import H200_BF16_PEAK, forward_flops, matmul_ceiling, model_config, shape  # noqa: E402  (bench/lib/common.py)
from report import MD, log, table, write_md  # noqa: E402  (bench/lib/report.py)



def settings(args):
    if args.quick:
        s = dict(shape=shape(True, vocab=1024, max_pos=4096),
                 chunk=256, tokens=60_000, min_len=32, max_len=512, peak_lens=[1024, 2048], reps=2, batch=64,
                 hbm_pages=1 + 8192)
    else:
        s = dict(shape=shape(False),
                 chunk=2048, tokens=400_000, min_len=128, max_len=2048, peak_lens=[2048, 4096, 8192, 16384],
                 reps=3, batch=64, hbm_pages=None)
    for k in ("tokens", "min_len", "max_len", "batch", "reps", "chunk"):
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    if args.peak_lens:
        s["peak_lens"] = [int(x) for x in args.peak_lens.split(",")]
    return s


def make_corpus(path, tok, s, n_docs, seed=0):
    """JSONL of random-word documents, lengths ~uniform in [min_len, max_len] tokens."""
    from importlib import resources
    words = resources.files("inferscale_jax").joinpath("data/corpus.txt").read_text(encoding="utf-8").split()
    rng = np.random.default_rng(seed)
    sample = " ".join(rng.choice(words, 2000))
    per_word = len(tok.encode(sample, add_special_tokens=False)) / 2000  # tokens per word
    if n_docs is None:
        n_docs = max(1, int(s["tokens"] / ((s["min_len"] + s["max_len"]) / 2)))
    with open(path, "w") as f:
        for i in range(n_docs):
            n = int(rng.integers(s["min_len"], s["max_len"] + 1) / per_word)
            f.write(json.dumps({"id": f"doc-{i:06d}", "text": " ".join(rng.choice(words, max(1, n)))}) + "\n")
    return n_docs


class StepSpy:
    """Counts device steps, rows and tokens (computed vs as the runner pads them)."""

    def __init__(self, engine):
        from inferscale_jax.runner import next_pow2
        self.engine, self.orig = engine, engine.runner.step
        self.reset()

        def step(rows, *args):
            n, longest = len(rows), max(len(r.tokens) for r in rows)
            self.steps += 1
            self.rows += n
            self.tokens += sum(len(r.tokens) for r in rows)
            self.padded += min(next_pow2(n), engine.runner.max_batch) * (1 if longest == 1 else next_pow2(longest, 16))
            return self.orig(rows, *args)
        engine.runner.step = step

    def reset(self):
        self.steps = self.rows = self.tokens = self.padded = 0


def mfu_cells(tflops_s, mm_flops):
    """[TFLOP/s, fraction of the datasheet peak, fraction of the measured matmul ceiling]."""
    return [f"{tflops_s / 1e12:.3g}", f"{tflops_s / H200_BF16_PEAK:.1%}",
            f"{tflops_s / mm_flops:.1%}" if mm_flops else "n/a"]


def peak(eng, s, rng, mm_flops):
    """(best tokens/s, its FLOP/s) over the lengths of ``s["peak_lens"]``; adds table 1."""
    rows, best, best_flops = [], 0.0, 0.0
    vocab = eng.cfg.vocab_size
    for L in s["peak_lens"]:
        if L > eng.max_model_len:
            continue
        eng.register_segment(f"peak-warm-{L}", token_ids=rng.integers(0, vocab, L).tolist())
        eng.delete_segment(f"peak-warm-{L}")
        times = []
        for r in range(s["reps"]):
            ids = rng.integers(0, vocab, L).tolist()
            t0 = time.perf_counter()
            eng.register_segment(f"peak-{L}-{r}", token_ids=ids)
            times.append(time.perf_counter() - t0)
            eng.delete_segment(f"peak-{L}-{r}")
        t = statistics.median(times)
        flops = forward_flops(s["shape"], T=L, C=0, lm_head_tokens=-(-L // s["chunk"]))
        if L / t > best:
            best, best_flops = L / t, flops / t
        rows.append([L, f"{t * 1e3:.1f}", f"{L / t:,.0f}", f"{flops / L / 1e9:.4g}",
                     *mfu_cells(flops / t, mm_flops)])
    table("1. Peak: chunked prefill of one long sequence (register_segment, median; MFU of the "
          f"{H200_BF16_PEAK / 1e12:.0f} TFLOP/s datasheet peak and of the measured matmul ceiling)",
          ["L tokens", "ms", "tokens/s", "GFLOP/token", "TFLOP/s", "MFU (datasheet)", "of matmul ceiling"], rows)
    return best, best_flops


def run(args):
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.default_model import default_model_dir
    from inferscale_jax.engine import Engine
    from inferscale_jax.precompute import precompute
    from inferscale_jax.tokenizer import load_tokenizer
    from models import init_params

    s = args.s
    cfg = model_config(s["shape"])
    tok = load_tokenizer(default_model_dir())
    n = 256 if args.quick else 8192
    mm_flops = matmul_ceiling(n)  # before the engine takes the free memory for its pool
    log(f"bf16 matmul ceiling ({n}^3): {mm_flops / 1e12:.2f} TFLOP/s "
        f"({mm_flops / H200_BF16_PEAK:.1%} of the {H200_BF16_PEAK / 1e12:.0f} TFLOP/s datasheet peak)")
    t0 = time.time()
    params = init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    jax.block_until_ready(params)
    wbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    log(f"params {wbytes / 1e9:.2f} GB, init {time.time() - t0:.1f} s")
    tmp = tempfile.mkdtemp(prefix="bench-precompute-")
    snap = args.snapshot_dir or (os.path.join(tmp, "snap") if args.quick else None)
    page = 16
    config = EngineConfig(dtype="bfloat16", page_size=page, hbm_pages=s["hbm_pages"], prefill_chunk=s["chunk"],
                          max_batch=s["batch"], min_table_pages=-(-s["max_len"] // page), snapshot_dir=snap)
    eng = Engine(params, cfg, tok, config)
    pool_tokens = (eng.pool.num_pages - 1) * page
    log(f"engine: pool {eng.pool.num_pages - 1} pages ({pool_tokens:,} tokens), attention "
        f"{eng.stats()['attention_impl']}, snapshot_dir {snap}")
    corpus = os.path.join(tmp, "corpus.jsonl")
    n_docs = make_corpus(corpus, tok, s, args.docs)
    R = dict(n_docs=n_docs, wbytes=wbytes, pool_tokens=pool_tokens, mm_flops=mm_flops, mm_n=n)

    R["peak"], R["peak_flops"] = peak(eng, s, np.random.default_rng(7), mm_flops)

    spy = StepSpy(eng)
    c0, t0 = eng.compiles, time.perf_counter()
    warm = precompute(eng, corpus, tenant="warmup", batch=s["batch"], step_tokens=args.step_tokens, snapshot=False,
                      progress=not args.no_progress)
    R["first_s"], R["first_compiles"] = time.perf_counter() - t0, eng.compiles - c0
    for info in eng.list_segments("warmup"):
        eng.delete_segment(info.id, tenant="warmup")
    spy.reset()
    c0 = eng.compiles
    res = precompute(eng, corpus, tenant="bench", batch=s["batch"], step_tokens=args.step_tokens,
                     snapshot=snap is not None, progress=not args.no_progress)
    R.update(res=res, compiles=eng.compiles - c0, steps=spy.steps, rows=spy.rows, padded=spy.padded,
             computed=spy.tokens, tiers=eng.tiers.stats())
    assert res.computed == warm.computed == n_docs and not res.bad, (res.summary(), res.bad[:5])
    ratio = res.tokens_per_s / R["peak"] if R["peak"] else float("nan")
    R["ratio"] = ratio
    mean_len = res.tokens / max(1, res.computed)  # the mean-length approximation (docstring)
    fpt = forward_flops(s["shape"], T=mean_len, C=0, lm_head_tokens=spy.rows / max(1, res.computed)) / mean_len
    R["flops"] = res.tokens_per_s * fpt
    table("2. Precompute (timed run: pipeline + device steps + registration; FLOPs at the mean document length)",
          ["documents", "tokens", "seconds", "docs/s", "tokens/s", "device steps", "rows/step", "tokens/step",
           "computed/padded", "compiles in run", "first run s (compiles)", "mean length", "GFLOP/token",
           "TFLOP/s", "MFU (datasheet)", "of matmul ceiling"],
          [[res.computed, f"{res.tokens:,}", f"{res.seconds:.2f}", f"{res.docs_per_s:,.1f}", f"{res.tokens_per_s:,.0f}",
            spy.steps, f"{spy.rows / max(1, spy.steps):.1f}", f"{spy.tokens / max(1, spy.steps):,.0f}",
            f"{spy.tokens / max(1, spy.padded):.2f}", R["compiles"], f"{R['first_s']:.1f} ({R['first_compiles']})",
            f"{mean_len:,.0f}", f"{fpt / 1e9:.4g}", *mfu_cells(R["flops"], mm_flops)]])
    if res.snapshot is not None:
        log(f"snapshot: {res.snapshot} in {res.snapshot_s:.2f} s")
    ev = R["tiers"]["hbm"]["evictions"]
    if ev:
        log(f"WARNING: {ev} segments were demoted to the host tier during the run (pool too small for the corpus)")
    verdict = "met" if ratio >= 0.8 else "NOT met"
    table("3. Target: precompute tokens/s >= 80% of the peak (MFU: of the datasheet peak / of the measured "
          "matmul ceiling)",
          ["precompute tok/s", "peak tok/s", "ratio", "verdict", "precompute MFU (datasheet)", "precompute of matmul",
           "peak MFU (datasheet)", "peak of matmul"],
          [[f"{res.tokens_per_s:,.0f}", f"{R['peak']:,.0f}", f"{ratio:.2f}", verdict,
            *mfu_cells(R["flops"], mm_flops)[1:], *mfu_cells(R["peak_flops"], mm_flops)[1:]]])
    eng.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return R


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--quick", action="store_true", help="tiny model, runs on CPU")
    ap.add_argument("--docs", type=int, default=None, help="documents (default: --tokens worth)")
    ap.add_argument("--tokens", type=int, default=None, help="approximate corpus tokens")
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="documents per batch and max rows per step")
    ap.add_argument("--chunk", type=int, default=None, help="prefill_chunk")
    ap.add_argument("--step-tokens", type=int, default=None, help="padded tokens per step (engine default: 16384)")
    ap.add_argument("--peak-lens", default=None, help="comma separated lengths for the peak")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--snapshot-dir", default=None, help="include the registry and the final snapshot")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    args.s = settings(args)
    log(f"devices: {jax.devices()}  jax {jax.__version__}  settings {args.s}")
    t0 = time.time()
    failure = None
    try:
        R = run(args)
    except Exception:  # noqa: BLE001 - report it in the markdown too
        failure = traceback.format_exc()
        log(failure)
        R = {}
    total = time.time() - t0
    dev = jax.devices()[0]
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    head = [f"# Precompute benchmark ({'quick, tiny model' if args.quick else 'Llama-3-8B shape, random bf16'})", "",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
            f"- command: `python {cmd}`",
            f"- settings: {args.s}",
            f"- corpus: {R.get('n_docs')} documents; KV pool {R.get('pool_tokens', 0):,} tokens",
            f"- bf16 matmul ceiling ({R.get('mm_n')}^3, measured): {R.get('mm_flops', 0) / 1e12:.2f} TFLOP/s; "
            f"datasheet peak {H200_BF16_PEAK / 1e12:.0f} TFLOP/s",
            f"- total time: {total:.0f} s", ""]
    if failure:
        head += ["**FAILED:**", "", "```", failure, "```", ""]
    write_md(args.out, "precompute.md", head + MD)
    if failure:
        sys.exit(1)


if __name__ == "__main__":
    main()
