"""Where the engine loop's host time goes under issue 30's serving workload, in process.

C clients in a closed loop (each a fresh question naming one of S shared segments, ``max_tokens``
greedy tokens with ``ignore_eos``; a finished request is replaced at once) drive ``Engine.step``
directly - no HTTP, no asyncio.  After ``--warm-steps`` (every bucket compiled), ``--steps`` steps
are timed twice: once plain (wall time per step, and the host's share: wall minus the time
blocked in ``ModelRunner.collect`` waiting for the device; rows per step) and once under ``cProfile`` (the
functions, by own and cumulative time).  On the CPU the device work is small with ``--quick``'s
tiny model, so the profile is mostly host time; on the GPU, time blocked reading the previous
step (``ModelRunner.collect``) is the device's share.

    python bench/profile_host.py --quick --concurrency 256                  # CPU, the tiny model
    python bench/profile_host.py --model /tmp/llama8b --concurrency 256     # GPU (make_checkpoint.py)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from inferscale_jax import Engine, EngineConfig, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    ap.add_argument("--quick", action="store_true", help="the embedded default model, small segments (CPU)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--segment-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warm-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=30, help="functions listed (default: %(default)s)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="EngineConfig(overlap_decode=False): the device runs only while the host waits (on "
                         "the CPU, where the 'device' shares the cores, the host time is then its own)")
    ap.add_argument("--no-profile", action="store_true", help="only the plain timing (no cProfile pass)")
    ap.add_argument("--out", help="write the report (markdown) here too")
    args = ap.parse_args()
    if args.quick:
        args.segment_tokens = min(args.segment_tokens, 512)
    config = EngineConfig(max_batch=args.concurrency, overlap_decode=not args.no_overlap)
    engine = Engine.from_pretrained(args.model, config)
    vocab = engine.cfg.vocab_size
    rng = random.Random(0)
    for i in range(args.segments):
        engine.register_segment(f"seg{i}", token_ids=[rng.randrange(10, vocab) for _ in range(args.segment_tokens)])
    sp = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def submit() -> None:
        engine.submit(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(args.question_tokens)],
                      segments=[f"seg{rng.randrange(args.segments)}"], sampling=SamplingParams(**sp))

    for _ in range(args.concurrency):
        submit()
    rows_seen: list[int] = []
    blocked = [0.0]  # seconds the host waited in ModelRunner.collect (the device's share)
    collect = engine.runner.collect

    def timed_collect(pending):
        t = time.perf_counter()
        try:
            return collect(pending)
        finally:
            blocked[0] += time.perf_counter() - t

    engine.runner.collect = timed_collect

    def run(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = engine.step()
            for o in outs:
                if o.finished:
                    submit()
            rows_seen.append(len(outs))
        return time.perf_counter() - t0

    t = time.perf_counter()
    run(args.warm_steps)
    warm_s = time.perf_counter() - t
    rows_seen.clear()
    blocked[0] = 0.0
    plain = run(args.steps)
    waited = blocked[0]
    tokens = sum(rows_seen)
    prof = cProfile.Profile()
    profiled = 0.0
    if not args.no_profile:
        prof.enable()
        profiled = run(args.steps)
        prof.disable()
    lines = [f"# Host profile of the engine loop ({args.model or 'embedded default model'})", "",
             f"C={args.concurrency}, {args.segments} segments x {args.segment_tokens} tokens, "
             f"{args.question_tokens}-token questions, {args.max_tokens} tokens each; warm-up {args.warm_steps} "
             f"steps ({warm_s:.1f} s)", "",
             f"- plain: {1e3 * plain / args.steps:.2f} ms per step, {tokens / plain:.0f} output tok/s, "
             f"{tokens / args.steps:.1f} outputs per step",
             f"- host time per step (wall minus the wait for the device in `collect`): "
             f"{1e3 * (plain - waited) / args.steps:.2f} ms; waited {1e3 * waited / args.steps:.2f} ms",
             f"- under cProfile: {1e3 * profiled / args.steps:.2f} ms per step", ""]
    for key in () if args.no_profile else ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        lines += [f"## by {key}", "", "```", buf.getvalue().strip(), "```", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    engine.close()


if __name__ == "__main__":
    main()
