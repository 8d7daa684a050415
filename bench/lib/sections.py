"""The two ends of a benchmark's main: its options parser, and running its sections to the report.

Most benchmarks end their ``main`` the same way: log the devices, run the sections the
``--sections`` letters name (each a ``report.section``, so a failure is reported and the run goes
on), write the report, exit non-zero when a check failed.  ``run_sections`` is that tail, and
``parser`` the start (the options every benchmark has)::

    ap = parser(__doc__, "tiny shapes (CPU)")
    ...
    plan = [("ab", ceilings), ("b", large), ("c", small)]
    sys.exit(run_sections(args, plan, lambda a, t0: finish(a.out, "x.md", "X", t0, ROOT)))
"""

from __future__ import annotations

import argparse
import os
import time

from report import FAILURES, log  # bench/lib/report.py


def run_sections(args, plan, report, *, chosen: str | None = None, note: str = "") -> int:
    """Log the devices (and ``note``); run each ``(keys, fn)`` of ``plan`` in order as ``fn(args)``
    when a letter of ``keys`` is in ``chosen`` (default ``args.sections``; ``keys`` None: always,
    ``""``: never, e.g. a ``--tune`` step not asked for); then ``report(args, t0)`` writes the report
    (``t0``: the ``time.time()`` before the first section).  Returns the exit status: 1, the failures
    listed last, when a check failed; else 0."""
    import jax

    log(f"devices: {jax.devices()}  jax {jax.__version__}" + (f"  {note}" if note else ""))
    chosen = args.sections if chosen is None else chosen
    t0 = time.time()
    for keys, fn in plan:
        if keys is None or any(k in chosen for k in keys):
            fn(args)
    report(args, t0)
    if FAILURES:
        log("\nFAILURES:\n  " + "\n  ".join(FAILURES))
        return 1
    log(f"all checks passed ({time.time() - t0:.0f} s)")
    return 0


def parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The options parser of a benchmark whose docstring is ``doc``, with the options every one has:
    ``--out`` (the report's folder, default ``bench/results``) and ``--quick`` (tiny shapes; ``quick_help``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def closed_loop_parser(doc: str, warm_steps: int) -> argparse.ArgumentParser:
    """The options of the tools that drive ``Engine.step`` in a closed loop of clients over shared
    segments (``bench/tools/profile_host.py``, ``profile_graph.py``): the model, ``--quick``, the
    workload (clients, segments, their tokens, question and answer tokens) and the warm-up steps."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    ap.add_argument("--quick", action="store_true", help="the embedded default model, small segments (CPU)")
    for flag, value in (("--concurrency", 256), ("--segments", 8), ("--segment-tokens", 4096),
                        ("--question-tokens", 64), ("--max-tokens", 64), ("--warm-steps", warm_steps)):
        ap.add_argument(flag, type=int, default=value, help="(default: %(default)s)")
    ap.add_argument("--max-tokens-spread", type=int, default=0,
                    help="each request's max_tokens uniform in max_tokens +- this (default 0: all equal; the "
                         "served loop's arrivals are spread over steps, a cohort's are not: try 32)")
    return ap


def closed_loop_clients(engine, args):
    """The closed loop's workload on ``engine`` (``closed_loop_parser``'s options): registers
    ``args.segments`` segments of random tokens and returns ``submit()``, which submits one client's
    next request (a fresh question naming a random segment, greedy, ``ignore_eos``)."""
    import random

    from inferscale_jax import SamplingParams

    vocab = engine.cfg.vocab_size
    rng = random.Random(0)
    for i in range(args.segments):
        engine.register_segment(f"seg{i}", token_ids=[rng.randrange(10, vocab) for _ in range(args.segment_tokens)])
    spread = min(getattr(args, "max_tokens_spread", 0), args.max_tokens - 1)

    def submit() -> None:
        sp = SamplingParams(max_tokens=args.max_tokens + (rng.randint(-spread, spread) if spread else 0), temperature=0.0,
                            ignore_eos=True)
        engine.submit(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(args.question_tokens)],
                      segments=[f"seg{rng.randrange(args.segments)}"], sampling=sp)

    return submit
