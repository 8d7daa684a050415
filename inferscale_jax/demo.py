"""``inferscale demo``: KV injection side by side with full prefill, on one screen.

1. Load the model (the embedded default unless ``--model``) into two engines that share the
   weights: one serving with a registered knowledge-base segment, one with prefix caching off
   (what a user who re-sends the context with every question pays).
2. Register the knowledge base (the shipped handbook text) as a segment: its KV is computed once.
3. Warm both engines up (compiles happen here, not in the table).
4. Ask each question twice - injected (``segments=["kb"]``) and as one long prompt holding the
   same tokens - and print TTFT with / without, prompt vs cached tokens, and whether the
   generated tokens are identical.  In exact mode they must be: the command exits 1 otherwise.
"""

from __future__ import annotations

import sys
from importlib import resources

import jax

from inferscale_jax.config import EngineConfig
from inferscale_jax.engine import Engine
from inferscale_jax.sampling import SamplingParams

QUESTIONS = [
    "Q: How long is the warranty? A:",
    "Q: Can I return a kettle I have used? A:",
    "Q: How often should I descale the kettle? A:",
    "Q: What temperature is best for green tea? A:",
    "Q: Do you ship to Canada? A:",
]


def knowledge_base() -> str:
    return resources.files("inferscale_jax").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def run_demo(model_dir: str | None = None, max_tokens: int = 24, out=sys.stdout) -> bool:
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    engine = Engine.from_pretrained(model_dir, EngineConfig(dtype=dtype))
    if engine.tokenizer is None:
        raise ValueError("the demo needs a model folder with a tokenizer")
    baseline = Engine(engine.params, engine.cfg, engine.tokenizer,
                      EngineConfig(dtype=dtype, prefix_caching=False), fingerprint=engine.fingerprint)
    kb = knowledge_base()
    info = engine.register_segment("kb", text=kb)
    kb_ids = engine.store.resolve("kb", "default").token_ids
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def ask(q: str):
        q_ids = engine.tokenizer.encode(q, add_special_tokens=False)
        with_kv = engine.generate(prompt=q, segments=["kb"], sampling=greedy)
        without = baseline.generate(prompt_token_ids=kb_ids + q_ids, sampling=greedy)
        return with_kv, without

    ask(QUESTIONS[0])  # warm-up: compile every shape used below
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
              f"{a.metrics.cached_tokens:>7} {'yes' if same else 'NO':>9}", file=out)
    print(f"\nanswer to the last question (random weights, so gibberish): {a.text!r}"[:200], file=out)
    print("all outputs identical to full prefill: " + ("yes" if all_same else "NO"), file=out)
    return all_same
