"""Shared by the tier / persistence tests and their crash-test child process: a tiny fp32 model
(deterministic weights, so every process builds the same engine fingerprint) and its engine."""

import jax

from inferscale_jax import Engine, EngineConfig, SamplingParams
from models import ModelConfig, RopeConfig, init_params

S = 8
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope=RopeConfig(), max_position_embeddings=512)
SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
PROMPT = [5, 6, 7]  # with a 20-token segment: 23 tokens, no full page past the segment's own


def params():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5)


def make_engine(pages=64, fingerprint=None, **kw):
    kw = dict(dict(dtype="float32", page_size=S, hbm_pages=pages, prefill_chunk=16), **kw)
    engine = Engine(params(), CFG, None, EngineConfig(**kw), fingerprint=fingerprint)
    engine.debug_checks = True
    return engine


def seg_tokens(i: int, n: int = 20) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 1 for j in range(n)]


def gen(engine, sid, tenant="default"):
    out = engine.generate(prompt_token_ids=PROMPT, segments=[sid], tenant=tenant, sampling=SP)
    return out.token_ids, out.logprobs
