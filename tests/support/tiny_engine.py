"""A tiny deterministic model and engine for the engine/scheduler tests (no checkpoint files)."""

import jax

from inferscale_jax import Engine, EngineConfig
from models import ModelConfig, RopeConfig, init_params

S = 8
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope=RopeConfig(), max_position_embeddings=512)


def make_engine(pages=64, **kw):
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    engine = Engine(params, CFG, None, EngineConfig(**{"dtype": "float32", "page_size": S, "hbm_pages": pages,
                                                       "prefill_chunk": 16, **kw}))
    engine.debug_checks = True  # page accounting invariants after every device step
    return engine


def assert_only_nodes_hold_pages(engine):
    """After all requests finish, the only page references left are the chain nodes' own."""
    held = {}
    for node in engine.store.nodes():
        for p in node.pages:
            held[p] = held.get(p, 0) + 1
    for p in range(1, engine.pool.num_pages):
        assert engine.pool.refcount(p) == held.get(p, 0), f"page {p} leaked"


PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 23, 29], [2, 4, 6], [9] * 20]  # a chunked prompt, a short one, a long one


def greedy_tokens_and_logprobs(engine, prompts=PROMPTS, max_tokens=6):
    """Each prompt's greedy tokens and their log-probs, run as one continuously batched burst (prefill, mixed
    and decode steps)."""
    from inferscale_jax import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    outs = engine.generate_batch([dict(prompt_token_ids=p, sampling=sp) for p in prompts])
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def assert_same_generations(a, b, atol=1e-4):
    """``greedy_tokens_and_logprobs`` results: the same tokens, log-probs within ``atol``."""
    import numpy as np
    assert [x[0] for x in a] == [x[0] for x in b]
    for (_, la), (_, lb) in zip(a, b):
        np.testing.assert_allclose(la, lb, atol=atol)


def switch_ab(monkeypatch, var: str, values: tuple, module, kernel: str, prompts=PROMPTS, **engine_kw) -> list:
    """A tiny engine on the Pallas kernels (interpret mode; ``engine_kw`` to ``make_engine``) under each of
    ``values`` of environment switch ``var`` in turn, each with fresh jit caches: per value, (its
    ``greedy_tokens_and_logprobs`` of ``prompts``, how many times ``module.<kernel>`` was traced, the cache's
    ``switches`` key)."""
    import jax
    calls = []
    real = getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    runs = []
    for value in values:
        monkeypatch.setenv(var, value)
        calls.clear()
        jax.clear_caches()
        engine = make_engine(**{"attention_impl": "pallas", "max_batch": 4, **engine_kw})
        runs.append((greedy_tokens_and_logprobs(engine, prompts), len(calls), engine.runner.cache.switches))
    jax.clear_caches()
    return runs
