"""Sampling parameters and the on-device sampler.

``SamplingParams`` is the public, validated request-side description (docs/architecture.md fields).
Every number it carries is range-checked at submit (``validate``), against the limits of what
the device step packs it into (int32 ids and counts, float32 parameters), so a value that passes
can never fail a step that other requests share.
``sample_tokens`` runs on the device for a whole batch at once, each row with its own
temperature / top-k / top-p / penalties / key, so a batch of mixed requests is one op and the
host reads back only the chosen ids (and, when asked, their log-probabilities).

Randomness: each request's key is ``fold_in(request_key(seed), step)``, so the same seed gives
the same tokens whatever else shares the batch; a request without a seed gets a key drawn from
the OS's entropy (64 bits), so unseeded requests differ from process to process.
``temperature == 0`` is greedy (argmax).  Top-k and top-p filter the temperature-scaled
distribution (top-k first, then the smallest set of tokens whose probability reaches ``top_p``;
the most likely token always survives).  Log-probabilities are always reported from the model's
full, unfiltered distribution (``log_softmax`` of the raw logits, before penalties), as
docs/architecture.md defines.

Penalties (OpenAI / vLLM semantics, applied to the logits before temperature, in vLLM's order):
``repetition_penalty`` p divides a positive logit by p and multiplies a negative one by p, for
every token in the prompt or generated so far; then ``logits -= frequency_penalty * count +
presence_penalty * (count > 0)`` with ``count`` the token's occurrences among the *generated*
tokens.  Greedy decoding takes the argmax of the penalized logits.

How the counts reach the device: each row of a step that has a penalty sends its generated ids
(and its prompt ids when ``repetition_penalty != 1``) as a padded int32 array, bucketed to a
power-of-four width (``runner.penalty_width``: few compiled variants), and ``apply_penalties``
builds the ``[B, V]`` counts with one scatter-add.
A step in which no row has a penalty passes ``penalties=None``, which is the unchanged,
separately compiled common path.  The cost is host packing and a host->device copy of
O(prompt + generated) ids per penalty row per step (16 KB for a 4k-token prompt), plus a scatter
on the device.  The alternative, a device-resident ``[max_batch, V]`` count table updated by
each step, sends nothing per step but needs a table slot per request kept in step with
admission, preemption (the counts rebuilt on re-admission), finishing and the overlapped
decode's discarded rows; the per-step arrays need none of that bookkeeping and cost nothing
for requests without penalties, so they were chosen.  Under overlapped decode the host's
generated ids lag one token behind for rows fed on the device; the runner adds that fed token
to the row's ids on the device (``runner._model_step``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import secrets

import jax
import jax.numpy as jnp
import numpy as np

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: each token decodes a tail window proportional to it
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # ids, counts and top-k travel to the device as int32
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2]; repetition in (0, 2]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_finite_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) and math.isfinite(x)


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None  # None: a fresh key from OS entropy per request
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence among generated tokens
    repetition_penalty: float = 1.0  # (0, 2], prompt and generated tokens (1: off)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field, its value and the allowed range.

        Floats must be finite (NaN and inf are rejected); integer fields reject bools."""
        def bad(field, value, allowed):
            raise ValueError(f"SamplingParams.{field}={value!r} is invalid: {allowed}")

        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            bad("max_tokens", self.max_tokens, f"must be an integer in [1, {INT32_MAX}] "
                "(the model's context limits it further)")
        if not _is_finite_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", self.temperature, f"must be a finite number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        if not _is_finite_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "must be a finite number in (0, 1]")
        top_k_max = INT32_MAX if vocab_size is None else min(INT32_MAX, vocab_size)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= top_k_max:
            what = f"the vocab size {vocab_size}" if vocab_size is not None else f"{INT32_MAX}"
            bad("top_k", self.top_k, f"must be an integer in [0, {top_k_max}] (0 disables top-k; at most {what})")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", self.seed, "must be an integer in [0, 2**63) or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(x) > MAX_STOP_CHARS for x in self.stop):
            longest = max(len(x) for x in self.stop)
            bad("stop", f"<a string of {longest} characters>", f"each stop string has at most {MAX_STOP_CHARS} characters")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"<{len(self.stop_token_ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS} ids")
        id_max = INT32_MAX if vocab_size is None else vocab_size - 1
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= id_max:
                limit = f"< vocab size {vocab_size}" if vocab_size is not None else f"<= {INT32_MAX}"
                bad("stop_token_ids", self.stop_token_ids if len(self.stop_token_ids) <= 16 else f"<entry {t!r}>",
                    f"every entry must be a token id in [0, {id_max}] ({limit})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            bad("ignore_eos", self.ignore_eos, "must be a bool")
        for field in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, field)
            if not _is_finite_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                bad(field, v, f"must be a finite number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)")
        if not _is_finite_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            bad("repetition_penalty", self.repetition_penalty,
                f"must be a finite number in (0, {MAX_PENALTY:g}] (1 = off)")


def request_key(seed: int | None = None) -> np.ndarray:
    """A request's [2] uint32 PRNG key (threefry): ``[seed >> 32, seed & 0xffffffff]``.

    That is ``jax.random.PRNGKey(seed)`` for every seed in [0, 2**63) as JAX computes it with
    x64 on; with x64 off ``PRNGKey`` keeps only the low 32 bits (seeds 5 and 2**32 + 5 would
    collide), so the key is built here on the host from both halves instead.  ``seed=None``:
    64 bits from the OS's entropy (``secrets``), a different stream in every process."""
    if seed is None:
        seed = secrets.randbits(64)
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r} is invalid: must be an integer in [0, 2**64)")
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def apply_penalties(logits: jax.Array, gen_ids: jax.Array, prompt_ids: jax.Array,
                    params: jax.Array) -> jax.Array:
    """Penalized logits (module docstring): logits [B, V] float32; gen_ids [B, Wg] and
    prompt_ids [B, Wp] int32 token ids (entries outside [0, V) are padding); params [B, 3]
    float32 (presence, frequency, repetition) -> [B, V] float32."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    drop = lambda ids: jnp.where((ids >= 0) & (ids < v), ids, v)  # noqa: E731 - padding -> out of range
    counts = jnp.zeros((b, v), jnp.int32).at[rows, drop(gen_ids)].add(1, mode="drop")  # [B, V]
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, drop(prompt_ids)].set(True, mode="drop") | (counts > 0)
    presence, frequency, repetition = params[:, 0:1], params[:, 1:2], params[:, 2:3]  # [B, 1] each
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen & (repetition != 1.0), repeated, logits)
    return logits - frequency * counts.astype(jnp.float32) - presence * (counts > 0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  keys: jax.Array, steps: jax.Array, num_logprobs: int = 0, penalties=None):
    """Sample one token per row.

    logits [B, V] float32; temperature/top_p [B] float32; top_k [B] int32 (0 = off);
    keys [B, 2] uint32 request keys; steps [B] int32 (folded into the key); penalties: None
    (no row has one) or ``apply_penalties``'s (gen_ids [B, Wg], prompt_ids [B, Wp], params [B, 3]).
    Returns (tokens [B] int32, chosen_logprob [B] float32, top_ids [B, n], top_logprobs [B, n]);
    the log-probs are the raw logits' (module docstring).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [B, V] the model's full distribution
    if penalties is not None:
        logits = apply_penalties(logits, *penalties)  # what is sampled from; logprobs stay raw
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
