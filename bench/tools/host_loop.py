"""The engine loop's host time per step with the device left out, on any machine (CPU included).

The serving workload of ``profile_host.py`` (C clients in a closed loop over shared segments, each
request a fresh question naming one segment) runs through the real scheduler, page manager and
the runner's packing (``ModelRunner._pack``: the step's host arrays, laid out as the device reads
them), but no step goes to a device: a model-free runner "samples" a token that depends only on
its position (``tests/support/fake_runner.py``).  So the figure is the Python the
host spends per step on scheduling, packing and results - the part of ``profile_host.py``'s
"host time per step" that does not depend on the accelerator - and it can be compared before and
after a change on the CPU machine (bench/NOTES.md, "Host time without a device").

The model is tiny (the shapes that matter are the rows, the pages and the segments): page size
16 like the GPU runs, so a 4096-token segment is 256 shared pages.

    python bench/tools/host_loop.py                     # C = 256, 8 segments x 4096, 64 + 64 tokens
    python bench/tools/host_loop.py --concurrency 64 --profile
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]

from inferscale_jax import Engine, EngineConfig  # noqa: E402
from models import ModelConfig, RopeConfig, init_params  # noqa: E402
from tests.support.fake_runner import FakeRunner  # noqa: E402


class HostOnlyRunner(FakeRunner):
    """The tests' model-free runner (``tests/support/fake_runner.py``: ids from the rows'
    positions, no device), but each step is packed first as the real runner packs it (bucket,
    host arrays: ``ModelRunner._pack``), its time kept in ``pack_s``."""

    def __init__(self, real):
        super().__init__(real)
        self.pack_s = 0.0
        self.by_bucket: dict[str, list[int]] = {}  # "decode 256" / "mixed 512": [steps, real tokens]

    def dispatch(self, plan, prev=None, defer_sample=False):
        t = time.perf_counter()
        self._pack(plan.rows, plan.num_logprobs, plan.groups, plan.src)
        self.pack_s += time.perf_counter() - t
        n = sum(len(r.tokens) for r in plan.rows)
        name = (f"decode {self.buckets.rows_for(n)}" if n == len(plan.rows)
                else f"mixed {self.buckets.tokens_for(n)}")
        self.by_bucket.setdefault(name, [0, 0])
        self.by_bucket[name][0] += 1
        self.by_bucket[name][1] += n
        return super().dispatch(plan, prev)


def main() -> None:
    from sections import closed_loop_clients, closed_loop_parser  # bench/lib/sections.py

    ap = closed_loop_parser(__doc__, warm_steps=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="a cProfile pass after the plain one")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", help="write the report (markdown) here too")
    ap.add_argument("--no-round-down", action="store_true",
                    help="never round a step's token budget down to a bucket (scheduler.py's ROUND_DOWN_MIN_TOKENS; "
                         "the scheduler before session 31)")
    args = ap.parse_args()
    vocab = 512
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=32, intermediate_size=48,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5,
                      rope=RopeConfig(), max_position_embeddings=2 * args.segment_tokens + 512)
    pages_per_req = -(-(args.segment_tokens + args.question_tokens + args.max_tokens + 16) // 16)
    pages = args.segments * pages_per_req + args.concurrency * 16 + 64
    config = EngineConfig(dtype="float32", page_size=16, hbm_pages=pages, max_batch=args.concurrency,
                          prefill_chunk=512, max_num_batched_tokens=max(2048, 2 * args.concurrency))
    engine = Engine(init_params(cfg, jax.random.PRNGKey(0), scale=0.5), cfg, None, config)
    fake = HostOnlyRunner(engine.runner)
    engine.runner = engine.kv.runner = engine.tiers.runner = engine.loop.runner = fake
    if args.no_round_down:
        engine.scheduler.round_down = 0
    submit = closed_loop_clients(engine, args)

    for _ in range(args.concurrency):
        submit()

    def run(steps: int) -> tuple[float, int]:
        made = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            for o in engine.step():
                made += len(o.new_token_ids)
                if o.finished:
                    submit()
        return time.perf_counter() - t0, made

    run(args.warm_steps)
    fake.pack_s = 0.0
    fake.by_bucket.clear()
    gc.collect()
    wall, made = run(args.steps)
    head = (f"C={args.concurrency}, {args.segments} segments x {args.segment_tokens} tokens, "
            f"{args.question_tokens}-token questions, {args.max_tokens} tokens each; {args.steps} steps "
            f"after {args.warm_steps}")
    lines = ["# Host time of the engine loop without a device", "", head, "",
             f"- host ms per step: {1e3 * wall / args.steps:.2f} (of which packing "
             f"{1e3 * fake.pack_s / args.steps:.2f}); {made / args.steps:.1f} tokens per step, "
             f"{made / wall:.0f} tokens/s the host alone could drive", "",
             "| step bucket | steps | real tokens per step | padding |", "| --- | --- | --- | --- |"]
    for name, (steps, real) in sorted(fake.by_bucket.items(), key=lambda kv: (kv[0][0], int(kv[0].split()[1]))):
        size = int(name.split()[1])
        lines.append(f"| {name} | {steps} | {real / steps:.1f} | {1 - real / (steps * size):.0%} |")
    lines.append("")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(args.steps)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        lines += ["## cProfile (tottime)", "", "```", buf.getvalue().strip(), "```", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
