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
