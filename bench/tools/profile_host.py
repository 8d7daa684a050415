"""Where the engine loop's host time goes under issue 30's serving workload, in process.

C clients in a closed loop (each a fresh question naming one of S shared segments, ``max_tokens``
greedy tokens with ``ignore_eos``; a finished request is replaced at once) drive ``Engine.step``
directly - no HTTP, no asyncio.  After ``Engine.warmup`` (every bucket compiled and run once, as
``serve`` has them before its first request; without it, a bucket the warm-up steps missed compiled
or loaded inside the timed steps: run AO's cohort loop, bench/NOTES.md) and ``--warm-steps``, ``--steps`` steps
are timed twice: once plain (wall time per step, and the host's share: wall minus the time
blocked in ``ModelRunner.collect`` waiting for the device; rows per step) and once under ``cProfile`` (the
functions, by own and cumulative time).  On the CPU the device work is small with ``--quick``'s
tiny model, so the profile is mostly host time; on the GPU, time blocked reading the previous
step (``ModelRunner.collect``) is the device's share.

    python bench/tools/profile_host.py --quick --concurrency 256                  # CPU, the tiny model
    python bench/tools/profile_host.py --model /tmp/llama8b --concurrency 256     # GPU (make_checkpoint.py)
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import queue
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

from inferscale_jax import Engine, EngineConfig  # noqa: E402


class PartTimer:
    """Wall time of each part of ``Engine.step``, summed over the timed steps: the runner's packing
    and host-to-device copies, every jitted call (the step's executable, the overlap helpers), the
    wait in ``collect``, the scheduler's admission, cascade grouping and result handling, and the
    garbage collector's pauses (``gc.callbacks``).  Installed after the warm-up, so every executable
    exists and is wrapped."""

    def __init__(self, engine) -> None:
        self.engine, self.t = engine, {}
        runner, sched = engine.runner, engine.scheduler
        for name in ("_pack", "_to_device", "collect"):
            setattr(runner, name, self._wrap(getattr(runner, name), f"runner.{name}"))
        for name in ("_admit", "_apply_all", "_cascade_groups"):
            setattr(sched, name, self._wrap(getattr(sched, name), f"scheduler.{name}"))
        for key, exe in list(runner.executables.items()):
            runner.executables[key] = self._wrap(exe, "call: step executable")
        for key, exe in list(runner.helpers.items()):
            runner.helpers[key] = self._wrap(exe, f"call: helper {key[0]}")
        self.step_kinds = {"decode": 0, "mixed": 0}
        # the device's cadence: a watcher thread waits on each dispatched step's output in order and
        # notes when it was ready; beside it, when the host had queued the step
        self.queued: list[float] = []
        self.ready: list[float] = []
        self._todo: queue.Queue = queue.Queue()
        threading.Thread(target=self._watch, daemon=True).start()
        timed_dispatch = self._wrap(runner.dispatch, "runner.dispatch (all)")

        def watched(plan, prev=None, **kw):
            self.step_kinds["decode" if all(len(r.tokens) == 1 for r in plan.rows) else "mixed"] += 1
            pending = timed_dispatch(plan, prev, **kw)
            self.queued.append(time.perf_counter())
            self._todo.put(pending.packed)  # (a deferred step's: its unmasked samples, the same step's end)
            return pending

        runner.dispatch = watched
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc)

    def _watch(self) -> None:
        while True:
            out = self._todo.get()
            out.block_until_ready()
            self.ready.append(time.perf_counter())

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.t["gc pauses"] = self.t.get("gc pauses", 0.0) + time.perf_counter() - self._gc_t0

    def _wrap(self, fn, name: str):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def reset(self) -> None:
        while not self._todo.empty():
            time.sleep(0.01)
        time.sleep(0.1)
        self.queued.clear()
        self.ready.clear()
        self.t.clear()
        self.step_kinds = {"decode": 0, "mixed": 0}

    def report(self, steps: int, wall: float) -> list[str]:
        runner = self.engine.runner
        t = dict(self.t)  # (before the replay adds its calls)
        time.sleep(0.2)
        n = min(len(self.queued), len(self.ready))
        queued, ready = np.array(self.queued[:n]), np.array(self.ready[:n])
        interval = np.diff(ready)  # device step to device step
        # how long before the device finished step k the host had queued step k + 1 (negative: the
        # device sat idle that long waiting for the host)
        ahead = ready[:-1] - queued[1:]
        idle = np.maximum(-ahead, 0.0)
        replay = runner.replay_last(20)  # the device's own time for the last step's bucket, inputs fixed
        lines = ["## Device cadence", "",
                 f"- device step to device step: p50 {1e3 * np.median(interval):.2f} ms, p90 "
                 f"{1e3 * np.percentile(interval, 90):.2f} ms, mean {1e3 * interval.mean():.2f} ms",
                 f"- next step queued before the device finished the current one: p50 {1e3 * np.median(ahead):.2f} "
                 f"ms; the device idle waiting for the host: mean {1e3 * idle.mean():.2f} ms per step "
                 f"({np.mean(idle > 0):.0%} of steps)", ""]
        lines += ["## Per part of a step (ms per step; the parts nest: dispatch holds pack, device put, calls)", "",
                 f"dispatched steps: {self.step_kinds['decode']} decode-only, {self.step_kinds['mixed']} mixed "
                 "(with chunks); "
                 f"the last step replayed on the device alone: {1e3 * replay:.2f} ms (its bucket: "
                 f"`{runner.last_key}`)", "",
                 "| part | ms per step | share of the step |", "| --- | --- | --- |"]
        for name, sec in sorted(t.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {name} | {1e3 * sec / steps:.3f} | {sec / wall:.0%} |")
        return lines + [""]


def main() -> None:
    from sections import closed_loop_clients, closed_loop_parser  # bench/lib/sections.py

    ap = closed_loop_parser(__doc__, warm_steps=200)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=30, help="functions listed (default: %(default)s)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="EngineConfig(overlap_decode=False): the device runs only while the host waits (on "
                         "the CPU, where the 'device' shares the cores, the host time is then its own)")
    ap.add_argument("--no-profile", action="store_true", help="only the plain timing (no cProfile pass)")
    ap.add_argument("--per-call", action="store_true",
                    help="time each part of a step on its own (packing, transfers, each jitted call, the wait, "
                         "admission, applying results, GC pauses) and the device's own step time (replay)")
    ap.add_argument("--fresh-inputs", action="store_true",
                    help="ModelRunner.stable_inputs off: fresh device buffers for the step's inputs every step "
                         "(the default refills persistent ones)")
    ap.add_argument("--gc-threshold", type=int,
                    help="the young generation's GC threshold for the timed steps (Python's default: 700; "
                         "bench/NOTES.md, run AH)")
    ap.add_argument("--out", help="write the report (markdown) here too")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip Engine.warmup: the buckets the loop meets compile in --warm-steps (a quick A/B on a "
                         "fresh machine; the report counts any compiled in the timed steps)")
    args = ap.parse_args()
    if args.quick:
        args.segment_tokens = min(args.segment_tokens, 512)
    config = EngineConfig(max_batch=args.concurrency, overlap_decode=not args.no_overlap)
    engine = Engine.from_pretrained(args.model, config)
    warmup_s = 0.0 if args.no_warmup else engine.warmup(progress_bar=False)["seconds"]
    if args.fresh_inputs:
        engine.runner.stable_inputs = False
    submit = closed_loop_clients(engine, args)
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
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    print(f"young GC threshold: {gc.get_threshold()[0]}", flush=True)
    parts = PartTimer(engine) if args.per_call else None
    warm_s = time.perf_counter() - t
    rows_seen.clear()
    blocked[0] = 0.0
    if parts is not None:
        parts.reset()
    compiles0 = engine.runner.compiles
    plain = run(args.steps)
    waited = blocked[0]
    compiles = engine.runner.compiles - compiles0
    part_lines = parts.report(args.steps, plain) if parts is not None else []
    tokens = sum(rows_seen)
    prof = cProfile.Profile()
    profiled = 0.0
    if not args.no_profile:
        prof.enable()
        profiled = run(args.steps)
        prof.disable()
    lines = [f"# Host profile of the engine loop ({args.model or 'embedded default model'})", "",
             f"C={args.concurrency}, {args.segments} segments x {args.segment_tokens} tokens, "
             f"{args.question_tokens}-token questions, {args.max_tokens} tokens each; Engine.warmup {warmup_s:.1f} s, "
             f"then {args.warm_steps} steps ({warm_s:.1f} s); {compiles} step buckets compiled in the timed steps", "",
             f"- plain: {1e3 * plain / args.steps:.2f} ms per step, {tokens / plain:.0f} output tok/s, "
             f"{tokens / args.steps:.1f} outputs per step",
             f"- host time per step (wall minus the wait for the device in `collect`): "
             f"{1e3 * (plain - waited) / args.steps:.2f} ms; waited {1e3 * waited / args.steps:.2f} ms",
             f"- under cProfile: {1e3 * profiled / args.steps:.2f} ms per step", ""] + part_lines
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
