"""The model, config and requests test_multiprocess.py runs in one process and in two."""

import jax
import numpy as np

from inferscale_jax import EngineConfig, SamplingParams
from models import ModelConfig, RopeConfig, init_params

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope=RopeConfig(), max_position_embeddings=512)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
_rng = np.random.default_rng(0)
_SEG = _rng.integers(3, 96, 37).tolist()
CASES = [dict(prompt_token_ids=_rng.integers(3, 96, 9).tolist(), segments=["a"],
              sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
         dict(prompt_token_ids=_rng.integers(3, 96, 5).tolist(), segments=["a"],
              sampling=SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
         dict(prompt_token_ids=_rng.integers(3, 96, 20).tolist(),
              sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]


def model():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5), CFG


def segment():
    return list(_SEG)


def config(**kw):
    return EngineConfig(**dict(dict(dtype="float32", page_size=8, hbm_pages=40, prefill_chunk=16), **kw))


def fill(engine):
    """More segments than the 40-page pool holds beside "a": the least recently used go to the host tier."""
    for i in range(10):
        engine.register_segment(f"fill{i}", token_ids=segment()[i:] + [i + 3])
