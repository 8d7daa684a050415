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

Logit bias (vLLM's extras; ``step_bias`` builds a row's, applied after the penalties as one
sparse scatter-add of (token id, value) pairs in the same per-step arrays): ``logit_bias`` adds
its values; a bad word (``tokenize_bad_words``: the word alone and after a space) gets ``-inf``
on its last token when the generated ids end with the rest of it (always, for a one-token
word); while fewer than ``min_tokens`` tokens are generated, EOS and ``stop_token_ids`` get
``-inf``.  A multi-token bad word needs the row's last generated token on the host, so a step
holding such a request settles the in-flight step first (no device feed for it;
``scheduler.py``).  ``min_p`` keeps the tokens whose probability is at least ``min_p`` times the
most likely one's (after temperature, with top-k / top-p), i.e. scaled logits >= max + log(min_p).
Greedy rows take the argmax of the biased logits; log-probs stay the raw distribution's.
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

from inferscale_jax.structured import StructuredOutputs
from pallas_kernels.common import SAMPLER_CHOICES

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: each token decodes a tail window proportional to it
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # ids, counts and top-k travel to the device as int32
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2]; repetition in (0, 2]
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_BAD_WORDS = 64


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
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the most likely token's probability (0: off)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> [-100, 100] added to its logit
    bad_words: list[str] = dataclasses.field(default_factory=list)  # never completed (module docstring)
    skip_special_tokens: bool = True  # text: special tokens left out of the decoded text
    spaces_between_special_tokens: bool = True  # text: (slow tokenizers) spaces around special tokens
    include_stop_str_in_output: bool = False  # text: keep the stop string that ended the output
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (segments kept)
    prompt_logprobs: int | None = None  # log-probs of the prompt's tokens + this many alternatives
    # the output must match this grammar (a JSON schema, regex, choices, Lark / GBNF: structured.py)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0  # vLLM's "off"
        self.validate()

    @property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_bias(self) -> bool:
        """Whether the device step needs a per-row sparse logit bias (``logit_bias``,
        ``bad_words``, ``min_tokens``)."""
        return bool(self.logit_bias) or bool(self.bad_words) or self.min_tokens > 0

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
        if not _is_finite_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "must be a finite number in [0, 1] (0 = off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"<{type(self.logit_bias).__name__}>",
                    f"must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries")
            for t, v in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t <= id_max:
                    bad("logit_bias", f"<key {t!r}>", f"every key must be a token id in [0, {id_max}]")
                if not _is_finite_real(v) or not -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE:
                    bad("logit_bias", f"<value {v!r} for token {t}>",
                        f"every bias is a finite number in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]")
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words):
            bad("bad_words", self.bad_words, "must be a list of non-empty strings")
        if len(self.bad_words) > MAX_BAD_WORDS:
            bad("bad_words", f"<{len(self.bad_words)} words>", f"at most {MAX_BAD_WORDS} words")
        for field in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                bad(field, getattr(self, field), "must be a bool")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or not 1 <= self.truncate_prompt_tokens <= INT32_MAX):
            bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "must be an integer >= 1 or None")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad("structured_outputs", f"<{type(self.structured_outputs).__name__}>",
                    "must be a StructuredOutputs or None")
            self.structured_outputs.validate()


def step_bias(sampling: SamplingParams, generated: int, out_ids: list[int] | None, stop_ids,
              bad_words_ids: list[list[int]]) -> tuple[list[int], list[float]] | None:
    """The sparse logit bias of one row's next token (module docstring, "Logit bias"), or None.

    ``generated``: tokens the request has generated before this one; ``out_ids``: the generated
    ids the host knows (None: not known this step, so multi-token bad words are not checked;
    the scheduler never lets that happen for a request that has them); ``stop_ids``: EOS and
    ``stop_token_ids`` (banned while ``generated < min_tokens``); ``bad_words_ids``: each bad
    word's token ids (``tokenize_bad_words``)."""
    ids: list[int] = []
    vals: list[float] = []
    if sampling.logit_bias:
        ids += list(sampling.logit_bias)
        vals += [float(v) for v in sampling.logit_bias.values()]
    for word in bad_words_ids:
        *head, last = word
        if not head or (out_ids is not None and len(out_ids) >= len(head) and out_ids[-len(head):] == head):
            ids.append(last)
            vals.append(-math.inf)
    if generated < sampling.min_tokens:
        ids += list(stop_ids)
        vals += [-math.inf] * len(stop_ids)
    return (ids, vals) if ids else None


def tokenize_bad_words(words: list[str], encode) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (as vLLM does: a word inside text is
    usually tokenized with its leading space); ``encode(text) -> ids`` adds no special tokens."""
    out: list[list[int]] = []
    for w in words:
        for variant in (w, " " + w.lstrip()):
            ids = list(encode(variant))
            if ids and ids not in out:
                out.append(ids)
    return out


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
                    params: jax.Array, bias_ids: jax.Array | None = None,
                    bias_vals: jax.Array | None = None) -> jax.Array:
    """Penalized logits (module docstring): logits [B, V] float32; gen_ids [B, Wg] and
    prompt_ids [B, Wp] int32 token ids (entries outside [0, V) are padding); params [B, 4]
    float32 (presence, frequency, repetition, min_p; min_p is read by the sampler); bias_ids /
    bias_vals [B, Wb] int32 / float32: a sparse bias added to those tokens' logits (ids outside
    [0, V) are padding) -> [B, V] float32."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    drop = lambda ids: jnp.where((ids >= 0) & (ids < v), ids, v)  # noqa: E731 - padding -> out of range
    counts = jnp.zeros((b, v), jnp.int32).at[rows, drop(gen_ids)].add(1, mode="drop")  # [B, V]
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, drop(prompt_ids)].set(True, mode="drop") | (counts > 0)
    presence, frequency, repetition = params[:, 0:1], params[:, 1:2], params[:, 2:3]  # [B, 1] each
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen & (repetition != 1.0), repeated, logits)
    logits = logits - frequency * counts.astype(jnp.float32) - presence * (counts > 0).astype(jnp.float32)
    if bias_ids is not None and bias_ids.shape[1]:
        logits = logits.at[rows, drop(bias_ids)].add(bias_vals, mode="drop")
    return logits


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """``logits`` [B, V] with the tokens ``mask`` [B, ceil(V / 32)] int32 does not allow set to
    ``-inf`` (bit ``v % 32`` of word ``v // 32``: token ``v``; structured.py).  A row whose
    mask allows nothing keeps its logits (the host ends such a request)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    ok = bits.reshape(mask.shape[0], -1)[:, :logits.shape[1]] > 0
    ok = ok | ~jnp.any(ok, axis=-1, keepdims=True)
    return jnp.where(ok, logits, -jnp.inf)


def _draw_by_cdf(row_keys: jax.Array, kept: jax.Array, block: int = 256, uniform: jax.Array | None = None) -> jax.Array:
    """One token per row from ``softmax(kept)`` ([B, V] float32, ``-inf``: never drawn) by inverting its CDF with
    one uniform per row: block sums of the probabilities, the block whose running sum passes the uniform, then
    the token inside it.  The same distribution as ``jax.random.categorical`` (up to float32 rounding), with one
    random number a row instead of one a vocabulary entry (the Gumbel noise's threefry bits over ``[B, V]``).
    ``uniform`` ([B] in [0, 1)): the rows' uniforms instead of the keys' (tests)."""
    b, v = kept.shape
    nb = -(-v // block)
    x = jnp.pad(kept, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf)
    top = jnp.max(x, axis=-1, keepdims=True)
    p = jnp.exp(x - jnp.where(jnp.isfinite(top), top, 0.0)).reshape(b, nb, block)  # 0 where -inf
    sums = jnp.sum(p, axis=-1)  # [B, NB]
    run = jnp.cumsum(sums, axis=-1)
    if uniform is None:
        uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(row_keys)
    u = uniform * run[:, -1]  # [B] in [0, total)
    # the block: run[j - 1] <= u < run[j]; rounding may leave u at the total: the last block that can be drawn
    last_block = nb - 1 - jnp.argmax((sums > 0)[:, ::-1], axis=-1)
    j = jnp.minimum(jnp.sum(run <= u[:, None], axis=-1), last_block)
    inner = jnp.take_along_axis(p, j[:, None, None], axis=1)[:, 0]  # [B, block]
    base = jnp.where(j > 0, jnp.take_along_axis(run, jnp.maximum(j - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    i = jnp.sum(base[:, None] + jnp.cumsum(inner, axis=-1) <= u[:, None], axis=-1)
    # rounding may leave u past the block's own sum: the block's last token that can be drawn
    last = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    return (j * block + jnp.minimum(i, last)).astype(jnp.int32)


SAMPLER_DRAWS = SAMPLER_CHOICES  # (INFERSCALE_SAMPLER's values, pallas_kernels/common.py)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "filtered", "draw", "sampled"))
def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  keys: jax.Array, steps: jax.Array, num_logprobs: int = 0, penalties=None,
                  filtered: bool = True, token_mask=None, draw: str = "gumbel", sampled: bool = True):
    """Sample one token per row.

    ``filtered`` (static): whether any row may have top-k or top-p set; False skips the
    vocabulary sort (those rows' filters are then ignored: the caller must know none has one).
    There is no data-dependent branch: greedy rows take the argmax, the others sample, in every
    compiled variant (a traced ``lax.cond`` would make the device report its predicate to the
    host before the step could finish, holding the host for the step's whole device time).

    logits [B, V] float32; temperature/top_p [B] float32; top_k [B] int32 (0 = off);
    keys [B, 2] uint32 request keys; steps [B] int32 (folded into the key); penalties: None
    (no row has a penalty, ``min_p`` or a logit bias) or ``apply_penalties``'s arguments (gen_ids
    [B, Wg], prompt_ids [B, Wp], params [B, 3 or 4], and optionally bias_ids [B, Wb], bias_vals [B, Wb]);
    token_mask: None (no row is constrained) or [B, ceil(V / 32)] int32 allowed-token bits
    (``apply_token_mask``), applied after the penalties.
    draw (static): how a sampled row's token is drawn from its kept logits: ``"gumbel"`` (the default,
    ``jax.random.categorical``: Gumbel noise over the whole vocabulary) or ``"cdf"`` (:func:`_draw_by_cdf`: one
    uniform a row; ``INFERSCALE_SAMPLER``, ``pallas_kernels/common.py``).  The same distribution; the tokens a
    given seed draws differ between the two.
    sampled (static): False draws nothing: every row takes its argmax, whatever its temperature (``filtered``
    and ``draw`` are then ignored).  The engine's model step samples so (its greedy rows' tokens and every
    row's log-probs are final) and a step with a row of temperature > 0 samples its logits again with
    ``sampled=True`` in a small executable of its own (runner.py): no step pays the draw's noise over the
    vocabulary unless a row of it samples.
    Returns (tokens [B] int32, chosen_logprob [B] float32, top_ids [B, n], top_logprobs [B, n]);
    the log-probs are the raw logits' (module docstring).
    """
    if draw not in SAMPLER_DRAWS:
        raise ValueError(f"draw={draw!r}: use one of {list(SAMPLER_DRAWS)}")
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [B, V] the model's full distribution
    min_p = None
    if penalties is not None:
        logits = apply_penalties(logits, *penalties)  # what is sampled from; logprobs stay raw
        if penalties[2].shape[1] > 3:
            min_p = penalties[2][:, 3]  # [B]
    if token_mask is not None:
        logits = apply_token_mask(logits, token_mask)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = greedy if not sampled else _draw(logits, greedy, temperature, top_k, top_p, keys, steps, min_p,
                                              filtered, draw)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp


def _draw(logits, greedy, temperature, top_k, top_p, keys, steps, min_p, filtered: bool, draw: str):
    """``sample_tokens``' tokens with sampling: the greedy rows' argmax, the others drawn from their
    temperature-scaled, filtered logits."""
    t = jnp.maximum(temperature, 1e-6)[:, None]
    scaled = logits / t
    floor = jnp.full((logits.shape[0], 1), -jnp.inf, scaled.dtype)
    if filtered:
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
        floor = jnp.maximum(kth, pth)
    if min_p is not None:  # p >= min_p * p_max  <=>  scaled >= max(scaled) + log(min_p)
        floor = jnp.maximum(floor, jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None])
    kept = jnp.where(scaled >= floor, scaled, -jnp.inf)
    row_keys = jax.vmap(jax.random.fold_in)(keys, steps)
    if draw == "cdf":
        sampled = _draw_by_cdf(row_keys, kept)
    else:
        sampled = jax.vmap(jax.random.categorical)(row_keys, kept).astype(jnp.int32)
    return jnp.where(temperature <= 0.0, greedy, sampled)
