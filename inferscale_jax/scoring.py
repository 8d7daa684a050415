"""Prompt log-probabilities: each prompt token's log-prob given every token before it.

``SamplingParams.prompt_logprobs`` (vLLM's field) and the server's ``echo`` + ``logprobs``
(OpenAI's, e.g. lm-eval's log-likelihood requests) ask for them.  How they are computed:

1. The request's whole token sequence (BOS + segments' tokens + prompt, as ``Engine.submit``
   builds it) runs through the model over a dense KV cache (``models.DenseKVCache``), in chunks of
   at most ``CHUNK`` tokens, the cache sized to a power of two (few compiles).
2. Each chunk's logits are reduced on the device (``_score_chunk``): ``log_softmax`` over the
   vocabulary, the log-prob of the token that actually follows each position, and the top ``n``
   alternatives; only those ``[C, 1 + 2n]`` numbers come back to the host, never ``[C, V]``.
3. Entry ``i`` of the result is the prompt token ``i``'s ``{token_id: logprob}`` (the token
   itself plus the top ``n``), or ``None`` for the sequence's very first token, which has
   nothing before it (OpenAI and vLLM answer null there too).

Segments are **recomputed** here, not read from their stored KV: stored KV holds keys and
values, not the logits a log-prob needs.  So a prompt-log-prob request costs one full prefill of
its sequence on top of its generation, and holds the engine thread while it runs (other requests'
steps wait); it is meant for evaluation (lm-eval, perplexity), not for the serving hot path.
Log-probs are the model's raw distribution (no temperature or penalties), as for generated
tokens (``sampling.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import DenseKVCache, ModelConfig, forward

CHUNK = 512  # tokens per scoring pass


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "top_n", "precision"), donate_argnames=("cache",))
def _score_chunk(params, cfg: ModelConfig, tokens, positions, targets, cache, *, top_n: int, precision):
    """tokens / positions [1, C] int32, targets [C] int32 (the next token after each position) ->
    (target_lp [C] float32, target rank [C] int32, top_ids [C, n] int32, top_lp [C, n] float32), cache."""
    logits, cache = forward(params, cfg, tokens, positions, cache, precision=precision)  # [1, C, V]
    lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)  # [C, V]
    target_lp = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(lp > target_lp[:, None], axis=-1, dtype=jnp.int32)  # [C] (1: the most likely)
    if top_n:
        top_lp, top_ids = jax.lax.top_k(lp, top_n)
    else:
        top_lp, top_ids = jnp.zeros((lp.shape[0], 0), jnp.float32), jnp.zeros((lp.shape[0], 0), jnp.int32)
    return target_lp, rank, top_ids.astype(jnp.int32), top_lp, cache


def prompt_logprobs(params, cfg: ModelConfig, tokens: list[int], num_prompt: int, top_n: int, dtype,
                    precision: str | None, ranks: list | None = None) -> list[dict[int, float] | None]:
    """Log-probs of the last ``num_prompt`` of ``tokens`` (module docstring): one entry per
    prompt token, ``None`` where the token is the sequence's first.  ``ranks``, when given,
    receives each entry's token rank in the distribution (1: the most likely; None for a
    ``None`` entry)."""
    n = len(tokens)
    if not 0 < num_prompt <= n:
        raise ValueError(f"num_prompt={num_prompt} must be in [1, {n}]")
    first = n - num_prompt  # the prompt's first token's position
    out: list[dict[int, float] | None] = [None] if first == 0 else []
    if ranks is not None and first == 0:
        ranks.append(None)
    lo = max(first - 1, 0)  # the position whose logits score the prompt's first scored token
    cache = DenseKVCache.create(cfg, 1, _bucket(n), dtype)
    seq = np.asarray(tokens, np.int32)
    at = 0
    while at < n - 1:
        c = min(CHUNK, n - at)
        width = _bucket(c)
        toks = np.zeros((1, width), np.int32)
        toks[0, :c] = seq[at:at + c]
        pos = np.arange(at, at + width, dtype=np.int32)[None]
        pos = np.minimum(pos, cache.k[0].shape[1] - 1)  # padding positions stay inside the cache
        targets = np.zeros((width,), np.int32)
        m = min(c, n - 1 - at)  # positions of this chunk that have a next token
        targets[:m] = seq[at + 1:at + 1 + m]
        t_lp, t_rank, t_ids, t_top, cache = _score_chunk(params, cfg, jnp.asarray(toks), jnp.asarray(pos),
                                                         jnp.asarray(targets), cache, top_n=top_n,
                                                         precision=precision)
        t_lp, t_rank, t_ids, t_top = np.asarray(t_lp), np.asarray(t_rank), np.asarray(t_ids), np.asarray(t_top)
        for j in range(m):
            p = at + j
            if p < lo:
                continue
            entry = {int(i): float(v) for i, v in zip(t_ids[j], t_top[j])}
            entry[int(seq[p + 1])] = float(t_lp[j])
            out.append(entry)
            if ranks is not None:
                ranks.append(int(t_rank[j]))
        at += c
    return out
