"""``inferscale demo``: KV injection side by side with full prefill, on one screen.

1. Load the model (the embedded default unless ``--model``) into two engines that share the
   weights: one serving with a registered knowledge-base segment, one with prefix caching off
   (what a user who re-sends the context with every question pays).
2. Register the knowledge base (the shipped handbook text) as a segment: its KV is computed once.
3. Warm both engines up: ``Engine.warmup()`` compiles the step buckets (every one on a GPU/TPU,
   the small set on the CPU; both engines share the compiled steps; ``max_batch=4`` keeps the set
   small: the demo asks one question at a time), then a question that is not in the table runs
   once (the steps of the knowledge base's length and the copy of the segment's partly filled
   last page compile there), so no compile lands in the timings.  The CLI keeps XLA's compilation cache on disk
   (``inferscale_cli/main.py``), so a second run mostly loads these compiles instead of redoing them.
4. Ask each question twice - injected (``segments=["kb"]``) and as one long prompt holding the
   same tokens - and print TTFT with / without, prompt vs cached tokens, and whether the
   generated tokens are identical.  In exact mode they must be: the command exits 1 otherwise.

Each phase prints a progress line on stderr as it starts, so the wait (mostly compiling on a
first run) is explained while it happens; the table goes to ``out``.

``cached`` is the number of prompt tokens whose KV was reused rather than computed: the
segment's tokens plus the BOS token when the tokenizer adds one (the BOS leads the segment's
KV; the default model has none).  The last page of the segment is only partly filled, so the
request copies it and computes the question from there.  A question asked before would also
hit the prefix cache for the page that holds the segment's tail and the question's first
tokens - which is why the warm-up question is not one of the table's.
"""

from __future__ import annotations

import sys
import time
from importlib import resources

import jax

from inferscale_jax.config import resolve_dtype
from inferscale_jax.config import EngineConfig
from inferscale_jax.default_model import default_model_dir
from inferscale_jax.engine import Engine
from inferscale_jax.sampling import SamplingParams
from inferscale_jax.tokenizer import load_tokenizer

QUESTIONS = [
    "Q: How long is the warranty? A:",
    "Q: Can I return a kettle I have used? A:",
    "Q: How often should I descale the kettle? A:",
    "Q: What temperature is best for green tea? A:",
    "Q: Do you ship to Canada? A:",
]
WARMUP_QUESTION = "Q: Where are the kettles made? A:"


def knowledge_base() -> str:
    return resources.files("inferscale_jax").joinpath("data/corpus.txt").read_text(encoding="utf-8")


class Progress:
    """One line per phase on ``err``, stamped with the seconds since it was made; flushes ``out``
    first so the two streams interleave in order on a terminal or a shared pipe."""

    def __init__(self, err=sys.stderr, out=sys.stdout):
        self.err, self.out, self.t0 = err, out, time.perf_counter()

    def __call__(self, line: str) -> None:
        self.out.flush()
        print(f"[{time.perf_counter() - self.t0:5.1f} s] {line}", file=self.err, flush=True)


def demo_pool_pages(kb_tokens: int, max_tokens: int, page_size: int = 16) -> int:
    """KV pages for a demo engine on the CPU: the segment and one request (knowledge base, a
    question of up to 64 tokens, the answer) twice over, plus the null page.  The CPU cannot
    donate buffers, so each step copies the whole pool: the pool is sized to the demo, not the
    engine's CPU default, which would make every decode step copy far more than it reads."""
    return 2 * -(-(kb_tokens + 64 + max_tokens) // page_size) + 1


def run_demo(model_dir: str | None = None, max_tokens: int = 24, out=sys.stdout, dtype: str = "auto",
             progress: Progress | None = None) -> bool:
    """Run the demo; True when every injected answer equals full prefill.  ``dtype="auto"``:
    bfloat16 on a GPU/TPU, float32 on the CPU (``config.resolve_dtype``)."""
    progress = progress or Progress(out=out)
    dtype = resolve_dtype(dtype)
    kb = knowledge_base()
    progress(f"loading the model ({model_dir or 'the embedded default model'}, {dtype}) on "
             f"{jax.devices()[0].device_kind}")
    pages = None  # on an accelerator: sized from free device memory
    if jax.default_backend() == "cpu":
        pages = demo_pool_pages(len(load_tokenizer(model_dir or default_model_dir()).encode(kb)), max_tokens)
    engine = Engine.from_pretrained(model_dir, EngineConfig(dtype=dtype, hbm_pages=pages, max_batch=4))
    if engine.tokenizer is None:
        raise ValueError(f"the demo needs a model folder with a tokenizer: {model_dir} has no tokenizer files")
    baseline = Engine(engine.params, engine.cfg, engine.tokenizer,
                      EngineConfig(dtype=dtype, hbm_pages=pages, prefix_caching=False, max_batch=4),
                      fingerprint=engine.fingerprint)
    progress("compiling the step buckets (Engine.warmup, a progress bar below; the first run compiles, later "
             "runs load the compiles from the cache)")
    engine.warmup()
    baseline.warmup(progress_bar=False)  # (the same steps: the compiles are shared)
    progress("registering the knowledge base as segment 'kb' (its KV is computed once)")
    info = engine.register_segment("kb", text=kb)
    kb_ids = engine.store.resolve("kb", "default").token_ids
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def ask(q: str):
        q_ids = engine.tokenizer.encode(q, add_special_tokens=False)
        with_kv = engine.generate(prompt=q, segments=["kb"], sampling=greedy)
        without = baseline.generate(prompt_token_ids=kb_ids + q_ids, sampling=greedy)
        return with_kv, without

    progress("warming up with a question outside the table (the copy of the segment's last page compiles here)")
    ask(WARMUP_QUESTION)
    compiles = engine.stats()["compiles"] + baseline.stats()["compiles"]
    progress(f"ready ({compiles} step shapes compiled); asking {len(QUESTIONS)} questions, each with the "
             "segment injected and as one full prompt")
    bos = len(engine.bos_prefix)
    print(f"model: {engine.cfg.architecture}, {engine.cfg.num_layers} layers, {dtype}, "
          f"attention={engine.stats()['attention_impl']}, device={jax.devices()[0].device_kind}", file=out)
    print(f"knowledge base segment 'kb': {info.num_tokens} tokens, KV computed once\n", file=out)
    head = f"{'question':<46} {'TTFT inject':>11} {'TTFT full':>10} {'speedup':>8} {'prompt':>7} {'cached':>7} {'identical':>9}"
    print(head, file=out)
    print("-" * len(head), file=out)
    all_same = True
    for q in QUESTIONS:
        a, b = ask(q)
        same = a.token_ids == b.token_ids
        all_same &= same
        print(f"{q[:46]:<46} {a.metrics.ttft_s * 1e3:>9.1f}ms {b.metrics.ttft_s * 1e3:>8.1f}ms "
              f"{b.metrics.ttft_s / a.metrics.ttft_s:>7.1f}x {a.metrics.prompt_tokens:>7} "
              f"{a.metrics.cached_tokens:>7} {'yes' if same else 'NO':>9}", file=out, flush=True)
    bos_note = " + 1 BOS token" if bos else " (this tokenizer adds no BOS token)"
    print(f"\nprompt = the {info.num_tokens} knowledge-base tokens{' + BOS' if bos else ''} + the question's tokens; "
          f"cached = tokens whose KV was reused, not computed:\nthe segment's {info.num_tokens}{bos_note}. "
          "Full prefill (prefix caching off) computes all of them for every question.", file=out)
    gibberish = " (random weights, so gibberish)" if model_dir is None else ""
    print(f"\nanswer to the last question{gibberish}: {a.text!r}"[:200], file=out)
    print("all outputs identical to full prefill: " + ("yes" if all_same else "NO"), file=out)
    return all_same
