"""Structured outputs: a grammar decides which tokens a request may sample next.

A request with ``SamplingParams.structured_outputs`` (a ``StructuredOutputs``: a JSON schema,
any JSON object, a regular expression, a list of choices, or a Lark / GBNF grammar) samples only
tokens that keep its output inside the grammar.  The grammar engine is llguidance (chosen over
xgrammar, which vLLM and SGLang also use, because xgrammar's wheels require torch and triton at
run time, which this engine does not otherwise need; llguidance has no dependencies and computes
its token masks in Rust with the GIL released).  How a request goes:

1. ``StructuredOutputs.grammar_text`` turns the request's spec into llguidance's grammar text.
   JSON is compact (``", "`` and ``": "`` between items, no other whitespace), so a model cannot
   pad its answer with whitespace forever; an object schema that lists ``properties`` and says
   nothing of ``additionalProperties`` admits only those properties (``closed``: what vLLM's
   default grammar backend does, xgrammar's strict mode), so a model cannot invent keys forever.
2. ``GrammarCompiler.submit`` (``Engine.submit``) returns a matcher for it: a copy of the cached
   compiled matcher when the same grammar was seen before (an LRU of ``cache_size`` entries), else
   a future from a small thread pool that compiles it, so a new schema never stalls the engine
   loop.  The scheduler holds the request until its matcher is ready (``Scheduler.add``); a
   grammar that does not compile fails that request alone with a ``ValueError`` naming the
   problem.  ``GrammarCompiler.check`` compiles in the caller (the API server validates before
   queueing, so a bad schema is a 400 there).
3. Each step, every constrained row that samples gets its allowed-token bitmask (``token_masks``:
   ``[rows, ceil(V / 32)]`` int32, bit ``v % 32`` of word ``v // 32`` set when token ``v`` is
   allowed) computed on the host from its matcher, all rows at once in llguidance's thread pool;
   the step's own executable runs unchanged (it also returns the rows' logits), and a small
   sampling executable (``ModelRunner.sample``, compiled on first use per step shape) samples
   those logits again with the mask sent as one array (``sampling.apply_token_mask``): no
   variant of the model's step is ever compiled for structured outputs, and steps without
   constrained rows pay nothing.  The mask needs the row's previous token on the host: when
   overlapped decode feeds that token on the device, the step is launched at once and its
   sampling waits (the scheduler reads the in-flight step, applies its tokens to the matchers,
   then ``ModelRunner.sample`` makes the masks and samples the step's logits).
4. Each sampled token advances the matcher (``Scheduler._on_token``); when the grammar is
   complete and allows nothing more, the request finishes with ``stop``.

Log-probabilities stay the model's raw distribution (docs/architecture.md), as for every other
logit processor.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading

import numpy as np

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema / regex / grammar's size (characters)
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass
class StructuredOutputs:
    """What a request's output must match: exactly one of ``json`` (a JSON schema, as a dict or
    its JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (Lark, llguidance's dialect, or GBNF / EBNF as llama.cpp writes it)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def validate(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs={self.__dict__!r} is invalid: give exactly one of json, regex, "
                             f"choice, grammar or json_object (got {given or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json is a {type(self.json).__name__}: it must be a JSON schema "
                             "(an object, or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} is invalid: it must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice is invalid: it must be a list of 1 to {MAX_CHOICES} "
                                 "non-empty strings")
        if len(self.key) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs is {len(self.key)} characters long: the limit is "
                             f"{MAX_GRAMMAR_CHARS}; send a smaller schema or grammar")

    @property
    def key(self) -> str:
        """The grammar cache's key: the spec, canonical."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, dict) else _loads(self.json)
            return "json:" + json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(list(self.choice))
        return "grammar:" + (self.grammar or "")

    def grammar_text(self) -> str:
        """llguidance's grammar text for this spec; ``ValueError`` when it cannot be built."""
        import llguidance

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else closed(
                self.json if isinstance(self.json, dict) else _loads(self.json))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        kind = "gbnf" if "::=" in self.grammar else "lark"
        return llguidance.grammar_from(kind, self.grammar)


def closed(schema):
    """``schema`` with ``"additionalProperties": false`` added to every object schema that lists
    ``properties`` and does not say (module docstring, 1)."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("enum", "const", "default", "examples") else v for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "unevaluatedProperties",
                                                           "patternProperties"} & set(schema):
        out["additionalProperties"] = False
    return out


def _loads(text: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as err:
        raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    return schema


class GrammarCompiler:
    """Compiled grammars for one tokenizer and vocabulary (module docstring, 2).  Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), cache_size: int = 256, workers: int = 2):
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer: this engine has none")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos = [int(t) for t in eos_token_ids] or None
        self._lltok = None
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="inferscale-grammar")
        self.counters = collections.Counter()

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos)
            return self._lltok

    def check(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` here (cached); ``ValueError`` naming the problem when it does not."""
        self._template(spec)

    def submit(self, spec: StructuredOutputs):
        """A fresh matcher for ``spec`` when it is cached, else a future of one (compiled in the
        pool).  The future raises ``ValueError`` for a grammar that does not compile."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.counters["hits"] += 1
                return hit.deep_copy()
        return self._pool.submit(lambda: self._template(spec).deep_copy())

    def _template(self, spec: StructuredOutputs):
        import llguidance

        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        tok = self._tokenizer()
        try:
            text = spec.grammar_text()
        except ValueError as err:
            raise ValueError(f"structured output: {err}") from None
        bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tok)
        if bad:
            raise ValueError(f"structured output does not compile: {'; '.join(messages)[:2000]}")
        matcher = llguidance.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output does not compile: {matcher.get_error()[:2000]}")
        with self._lock:
            self.counters["compiled"] += 1
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_executor = None  # llguidance's thread pool for many rows' masks (created on first use)


def token_masks(rows: list[tuple[object, int]], num_rows: int, vocab_size: int) -> np.ndarray:
    """``[num_rows, ceil(vocab_size / 32)]`` int32: all bits set, except the rows ``(matcher,
    index)`` given, which get the tokens their matcher allows next (module docstring, 3)."""
    import llguidance
    import llguidance.numpy as lln

    global _executor
    mask = np.full((num_rows, -(-vocab_size // 32)), -1, np.int32)
    if len(rows) == 1:
        lln.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
    elif rows:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        lln.fill_next_token_bitmask_par(_executor, rows, mask)
    return mask


def allowed(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids one bitmask row allows (for tests and debugging)."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.nonzero(bits)[0]
