"""Plain generation over a dense KV cache: the simplest end-to-end path (``inferscale generate``).

One sequence: the prompt is padded to a power-of-two bucket and prefilled in one jitted call,
then one jitted decode step per token; both donate the cache so it is updated in place.  The
sampler is the engine's (``sampling.sample_tokens``, penalties included: the generated and
prompt ids go with each token's sampling, padded to a power of two).  The model's dots run at
``matmul_precision`` (None: "highest" for float32, as ``EngineConfig.resolved_matmul_precision``
resolves it; docs/architecture.md).  The engine's paged path replaces this for serving; it
stays as a small, independent reference.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from inferscale_jax.config import EngineConfig
from inferscale_jax.sampling import SamplingParams, request_key, sample_tokens, step_bias
from models import DenseKVCache, ModelConfig, forward
from pallas_kernels import common


def bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "precision"), donate_argnames=("cache",))
def _step(params, cfg: ModelConfig, tokens, positions, cache, last, *, precision: str):
    """tokens/positions [1, T]; last [1]: index of the token whose next-token logits we want."""
    logits, cache = forward(params, cfg, tokens, positions, cache, logits_index=last, precision=precision)
    return logits, cache  # [1, V]


def _padded(ids: list[int]) -> np.ndarray:
    """[1, W] int32: ``ids`` padded with -1 to a power-of-two width >= 16 (few compiles)."""
    out = np.full((1, bucket(len(ids) + 1)), -1, np.int32)
    out[0, :len(ids)] = ids
    return out


def _padded_values(values: list[float], width: int) -> np.ndarray:
    """[1, width] float32: ``values`` padded with zeros (the bias of ``_padded`` ids)."""
    out = np.zeros((1, width), np.float32)
    out[0, :len(values)] = values
    return out


def generate_dense(params: dict, cfg: ModelConfig, prompt_ids: list[int], sampling: SamplingParams,
                   dtype=jnp.float32, matmul_precision: str | None = None) -> tuple[list[int], dict]:
    """Generate up to ``sampling.max_tokens`` ids after ``prompt_ids``; returns (ids, timings)."""
    sampling.validate(cfg.vocab_size)
    if sampling.bad_words:
        raise ValueError("SamplingParams.bad_words needs a tokenizer: use the engine (Engine.generate), "
                         "or logit_bias with the words' token ids")
    precision = EngineConfig(dtype=jnp.dtype(dtype).name, matmul_precision=matmul_precision).resolved_matmul_precision
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("prompt is empty: give at least one token")
    total = n + sampling.max_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds the model's "
            f"max_position_embeddings {cfg.max_position_embeddings}; shorten the prompt or lower max_tokens")
    cache = DenseKVCache.create(cfg, 1, bucket(total), dtype)
    t = bucket(n)
    toks = np.zeros((1, t), np.int32)
    toks[0, :n] = prompt_ids
    pos = np.arange(t, dtype=np.int32)[None]
    key = request_key(sampling.seed)[None]  # [1, 2]
    stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(cfg.eos_token_ids))
    temp = jnp.array([sampling.temperature], jnp.float32)
    top_k = jnp.array([sampling.top_k], jnp.int32)
    top_p = jnp.array([sampling.top_p], jnp.float32)
    pen_params = np.array([[sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
                            sampling.min_p]], np.float32)
    pen_prompt = _padded(prompt_ids if sampling.repetition_penalty != 1 else [])
    processed = sampling.has_penalty or sampling.has_bias or sampling.min_p > 0

    t0 = time.perf_counter()
    logits, cache = _step(params, cfg, jnp.asarray(toks), jnp.asarray(pos), cache, jnp.array([n - 1]),
                          precision=precision)
    out: list[int] = []
    ttft = None
    for i in range(sampling.max_tokens):
        penalties = None
        if processed:
            bias = step_bias(sampling, i, out, sorted(stop), [])
            bias_ids, bias_vals = bias if bias is not None else ([], [])
            penalties = (_padded(out), pen_prompt, pen_params, _padded(bias_ids),
                         _padded_values(bias_vals, _padded(bias_ids).shape[1]))
        tok, *_ = sample_tokens(logits, temp, top_k, top_p, key, jnp.array([i], jnp.int32), penalties=penalties,
                                draw=common.sampler_draw())
        tid = int(tok[0])
        if ttft is None:
            ttft = time.perf_counter() - t0
        out.append(tid)
        if tid in stop or i == sampling.max_tokens - 1:
            break
        logits, cache = _step(params, cfg, jnp.array([[tid]], jnp.int32),
                              jnp.array([[n + i]], jnp.int32), cache, jnp.array([0]), precision=precision)
    elapsed = time.perf_counter() - t0
    return out, {"ttft_s": ttft, "total_s": elapsed, "prompt_tokens": n, "generated_tokens": len(out)}
