"""Structured outputs' cost: output tokens / s with a JSON schema against the same requests
unconstrained, and the time to first token with a new (uncompiled) schema and a cached one.

Sections (``--sections``, default both):

- ``throughput``: B = 1 and 64 requests (64-token prompts, 128 output tokens each, greedy),
  submitted at once and stepped to the end; output tok/s over the steps in which every request
  decodes (the prefill steps are the same in both variants and left out), constrained / free.
  The schema (``LONG_SCHEMA``) asks for at least 256 array items, so every constrained row runs
  to ``max_tokens`` like the free ones and the batch keeps its size.
  Each variant runs once untimed first (its executables compile).
- ``ttft`` (run first: its first constrained request compiles the masked sampler of its bucket,
  reported apart): one request, ``max_tokens`` 1: its time from submit to its token, unconstrained, with
  a schema never seen before (a fresh enum value each time: the compile is on the path) and with
  the same schema again (cached).  Median of ``--reps``.

    python bench/engine/grammar_speed.py --model /tmp/llama8b --out bench/results    # H200
    python bench/engine/grammar_speed.py --quick --out /tmp/grammar                   # CPU: the harness

Writes ``grammar_speed.md`` (tables, command, device) and ``grammar_speed.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import report  # noqa: E402  (bench/lib/report.py)
from common import median  # noqa: E402
from inferscale_jax import Engine, EngineConfig, SamplingParams, StructuredOutputs  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "summary": {"type": "string", "maxLength": 40},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 64},
}, "required": ["summary", "notes"]}
# throughput's schema: at least 256 array items (>= 1 token each), so every constrained row runs to
# max_tokens like the free ones and the batch keeps its size to the end (a random model closes
# SCHEMA's object after a few dozen tokens)
LONG_SCHEMA = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": 256},
}, "required": ["notes"]}
RESULTS: dict = {}


def prompts(eng: Engine, b: int, n: int, base: int) -> list[list[int]]:
    vocab = min(eng.cfg.vocab_size, 1000)
    return [[(base + 7 * i + 13 * j) % (vocab - 10) + 5 for j in range(n)] for i in range(b)]


def run_batch(eng: Engine, ids: list[list[int]], max_tokens: int, spec) -> dict:
    """Submit all, step to the end: (decode-phase tok/s, tokens, steps)."""
    rids = [eng.submit(prompt_token_ids=p, sampling=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=spec)) for p in ids]
    started, done, tokens, t_decode, n_decode = set(), set(), 0, None, 0
    while len(done) < len(rids):
        outs = eng.step()
        now = time.perf_counter()
        new = 0
        for o in outs:
            if o.error is not None:
                raise o.error
            new += len(o.new_token_ids)
            started.add(o.request_id)
            if o.finished:
                done.add(o.request_id)
        if t_decode is not None:
            tokens += new
            n_decode += 1
        if t_decode is None and len(started) == len(rids):
            t_decode = now  # every request decodes from here on
    wall = time.perf_counter() - t_decode
    return dict(tok_s=tokens / wall if wall > 0 else 0.0, tokens=tokens, steps=n_decode, wall=wall)


@report.section
def throughput(eng: Engine, args) -> None:
    rows = []
    for b in (1, 64) if not args.quick else (1, 8):
        got = {}
        for name, spec in (("free", None), ("json schema", StructuredOutputs(json=LONG_SCHEMA))):
            run_batch(eng, prompts(eng, b, 64, 1), args.max_tokens, spec)  # compiles, untimed
            got[name] = run_batch(eng, prompts(eng, b, 64, 2), args.max_tokens, spec)
            report.log(f"B={b} {name}: {got[name]}")
        f, c = got["free"], got["json schema"]
        RESULTS[f"B{b}"] = (f["tok_s"], c["tok_s"])
        rows.append([b, f"{f['tok_s']:.0f}", f"{c['tok_s']:.0f}", f"{c['tok_s'] / f['tok_s']:.2f}",
                     f"{1e3 * f['wall'] / max(1, f['steps']):.2f}", f"{1e3 * c['wall'] / max(1, c['steps']):.2f}",
                     c["tokens"]])
    report.table("Output tokens / s in the decode phase, free vs JSON schema (target: ratio >= 0.90)",
                 ["B", "free tok/s", "schema tok/s", "schema / free", "free ms/step", "schema ms/step",
                  "schema tokens"], rows)


def one(eng: Engine, spec) -> float:
    t0 = time.perf_counter()
    eng.generate(prompt_token_ids=prompts(eng, 1, 64, 3)[0], sampling=SamplingParams(
        max_tokens=1, temperature=0.0, structured_outputs=spec))
    return time.perf_counter() - t0


@report.section
def ttft(eng: Engine, args) -> None:
    one(eng, None)
    first = one(eng, StructuredOutputs(json=SCHEMA))  # compiles the masked sampler
    free = [one(eng, None) for _ in range(args.reps)]
    fresh = []
    for i in range(args.reps):
        schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], tag={"enum": [f"v{i}-{time.time_ns()}"]}))
        fresh.append(one(eng, StructuredOutputs(json=schema)))
    cached = [one(eng, StructuredOutputs(json=SCHEMA)) for _ in range(args.reps)]
    RESULTS["ttft"] = (median(free), median(fresh), median(cached))
    report.table("Time to first token, one request (median; the first constrained request of the process also "
                 "compiles the masked sampler for its bucket)",
                 ["unconstrained", "new schema", "cached schema", "first constrained request"],
                 [[f"{1e3 * median(free):.1f} ms", f"{1e3 * median(fresh):.1f} ms", f"{1e3 * median(cached):.1f} ms",
                   f"{1e3 * first:.0f} ms"]])


def plot(out: str) -> None:
    plt = report.pyplot()
    if plt is None or not any(k.startswith("B") for k in RESULTS):
        return
    keys = [k for k in RESULTS if k.startswith("B")]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [RESULTS[k][0] for k in keys], 0.4, label="free")
    ax.bar([i + 0.2 for i in x], [RESULTS[k][1] for k in keys], 0.4, label="JSON schema")
    ax.set_xticks(list(x), keys)
    ax.set_ylabel("output tok/s (decode phase)")
    ax.set_title("Structured outputs: throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "grammar_speed.png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sections", default="ttft,throughput")  # ttft first: its first constrained
    # request is the process's first (the masked sampler compiles on its path)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CPU: small batches")
    args = ap.parse_args()
    t0 = time.time()
    eng = Engine.from_pretrained(args.model, EngineConfig(hbm_pages=1024) if args.quick else None)
    for name in args.sections.split(","):
        {"throughput": throughput, "ttft": ttft}[name](eng, args)
    plot(args.out)
    report.finish(args.out, "grammar_speed.md", "Structured outputs: throughput and time to first token", t0,
                  ROOT)


if __name__ == "__main__":
    main()
