"""Sampling parameters and the on-device sampler.

``SamplingParams`` is the public, validated request-side description (docs/architecture.md fields).
``sample_tokens`` runs on the device for a whole batch at once, each row with its own
temperature / top-k / top-p / key, so a batch of mixed requests is one op and the host reads
back only the chosen ids (and, when asked, their log-probabilities).

Randomness: each request's key is ``fold_in(PRNGKey(seed), step)``, so the same seed gives the
same tokens whatever else shares the batch.  ``temperature == 0`` is greedy (argmax).  Top-k and
top-p filter the temperature-scaled distribution (top-k first, then the smallest set of tokens
whose probability reaches ``top_p``; the most likely token always survives).  Log-probabilities
are always reported from the model's full, unfiltered distribution (``log_softmax`` of the raw
logits), as docs/architecture.md defines.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field, its value and the allowed range."""
        def bad(field, value, allowed):
            raise ValueError(f"SamplingParams.{field}={value!r} is invalid: {allowed}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", self.temperature, "must be a number in [0, 100] (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0 (0 disables top-k)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", self.seed, "must be an integer in [0, 2**63) or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS} stop strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, f"token ids must be < vocab size {vocab_size}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")


def request_key(seed: int | None, fallback: int) -> jax.Array:
    """A per-request PRNG key; requests without a seed get ``fallback`` (e.g. a request counter)."""
    return jax.random.PRNGKey(seed if seed is not None else fallback)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  keys: jax.Array, steps: jax.Array, num_logprobs: int = 0):
    """Sample one token per row.

    logits [B, V] float32; temperature/top_p [B] float32; top_k [B] int32 (0 = off);
    keys [B, 2] uint32 request keys; steps [B] int32 (folded into the key).
    Returns (tokens [B] int32, chosen_logprob [B] float32, top_ids [B, n], top_logprobs [B, n]).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [B, V] the model's full distribution
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        t = jnp.maximum(temperature, 1e-6)[:, None]
        scaled = logits / t
        vocab = logits.shape[-1]
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [B, 1]
        ranked = jnp.where(jnp.arange(vocab)[None] < k[:, None], sorted_logits, -jnp.inf)
        sorted_probs = jax.nn.softmax(ranked, axis=-1)
        cum = jnp.cumsum(sorted_probs, axis=-1)
        # smallest prefix whose mass reaches top_p: keep tokens whose preceding mass is < top_p
        keep_sorted = (cum - sorted_probs) < top_p[:, None]
        n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
        pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
        filtered = jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)
        row_keys = jax.vmap(jax.random.fold_in)(keys, steps)
        sampled = jax.vmap(jax.random.categorical)(row_keys, filtered).astype(jnp.int32)
        return jnp.where(temperature <= 0.0, greedy, sampled)

    # all-greedy batches (the common serving case) skip the vocab sort entirely
    tokens = jax.lax.cond(jnp.all(temperature <= 0.0), lambda _: greedy, sample, None)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
