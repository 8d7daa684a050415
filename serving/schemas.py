"""Request bodies: OpenAI field names and types, plus the ``segments`` / ``mode`` extensions.

Validation is strict (pydantic strict mode): ``"16"`` is not an integer and ``true`` is not a
number, as in OpenAI's API.  NaN and infinities are rejected.  Every validation error is a 400
(``invalid_field``) whose ``param`` names the field, as OpenAI and vLLM answer.

**Field policy** (docs/architecture.md, "Field policy").  A misspelled or unknown field is a 400
(``unknown or unsupported field 'NAME'``): silently dropping a field this server does not
implement would answer a question the client did not ask.  A known OpenAI or vLLM field that
does not change the output (``IGNORED_FIELDS``, and the neutral values of ``_NEUTRAL``'s fields)
is accepted and named in the response header ``x-inferscale-ignored-fields``.  A known field
whose effect is not built (``UNSUPPORTED_FIELDS``, a non-neutral ``_NEUTRAL`` value) is a 400
saying ``unsupported field``.

Parameters (C: ``/v1/completions``, Ch: ``/v1/chat/completions``):

=============================  =====  ==========================================================
 parameter                      where  support
=============================  =====  ==========================================================
 ``model``                      C Ch   optional; one of the served names (else 404)
 ``prompt``                     C      a string or token ids, or a list of up to 256 of either:
                                       each prompt its own choices (``index`` = prompt x n + sample)
 ``messages``                   Ch     roles system/developer/user/assistant/tool; content a string
                                       or parts: ``{"type": "text", "text"}`` and
                                       ``{"type": "segment", "id"}`` (serving/chat.py)
 ``max_tokens``                 C Ch   C: >= 0, default 16 (0 only with ``echo`` or
                                       ``prompt_logprobs``: the prompt scored, nothing generated);
                                       Ch: >= 1, default the server's; ``max_completion_tokens``
 ``temperature``, ``top_p``     C Ch   [0, 2] (0 is greedy), (0, 1]
 ``n``                          C Ch   1..16 samples of each prompt, sharing its KV pages; with
                                       ``seed``, sample i uses ``seed + i``
 ``seed``                       C Ch   [0, 2**63 - n]: reproducible sampling
 ``stop``                       C Ch   a string or up to 16 non-empty strings
 ``stream``                     C Ch   SSE; ``stream_options``: ``include_usage`` (a final usage
                                       chunk), ``continuous_usage_stats`` (usage in every chunk)
 ``logprobs``                   C Ch   C: 0..20 alternatives; Ch: true (+ ``top_logprobs`` 0..20);
                                       streamed too
 ``echo``                       C      the prompt text before the output (the prompt only, not the
                                       segments); with ``logprobs``, the prompt tokens' log-probs
                                       first (the first is null), as lm-eval reads them
 ``presence_penalty``,          C Ch   [-2, 2]
 ``frequency_penalty``
 ``logit_bias``                 C Ch   up to 300 ``"token id": bias`` in [-100, 100], on the device
 ``user``, ``store``,           C Ch   accepted, no effect (``x-inferscale-ignored-fields``)
 ``metadata``,
 ``service_tier``,
 ``prompt_cache_key``,
 ``safety_identifier``,
 ``priority``,
 ``guided_decoding_backend``
 ``response_format``,           C Ch   structured outputs, enforced by a grammar on the device
 ``structured_outputs``,               (serving/response_format.py): json_object, json_schema;
 ``guided_json``, ``_regex``,          vLLM's json / regex / choice / grammar (Lark or GBNF)
 ``_choice``, ``_grammar``
 ``tools``, ``tool_choice``,    Ch     tool calling in the model family's format (serving/tools.py);
 ``parallel_tool_calls``               messages: assistant ``tool_calls``, ``tool`` + ``tool_call_id``
 ``functions``,                 C Ch   only neutral: ``[]``, ``"none"``, ``best_of`` 1, ``suffix``
 ``function_call``,                    null (ignored); other values 400
 ``best_of``, ``suffix``
=============================  =====  ==========================================================

Extensions (vLLM's names): ``segments`` (ids to inject, in order; in chat they go inside the
system message), ``mode`` (``exact`` | ``compose`` | ``blend``), ``session`` (chat: conversation
memory, inferscale_jax/sessions.py), ``top_k`` (-1 or 0: off), ``min_p`` [0, 1], ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``repetition_penalty`` ((0, 2]; 1 is off), ``bad_words``,
``skip_special_tokens``, ``spaces_between_special_tokens``, ``include_stop_str_in_output``,
``truncate_prompt_tokens`` (keep the prompt's last k tokens), ``prompt_logprobs`` (0..20; see
docs/architecture.md, "Prompt log-probs"); chat: ``chat_template_kwargs`` (template variables),
``add_generation_prompt``, ``continue_final_message``.  ``PUT /v1/segments/{id}`` and ``POST
/v1/segments/{id}/append`` take ``{"text"}`` or ``{"token_ids"}`` (``SegmentContent``).  Inside
chat ``messages``, extra keys that clients echo back from earlier responses (``refusal``,
``annotations``, ...) are ignored.

Segment ids (``POST /v1/segments``): 1-256 characters of ``A-Z a-z 0-9 . _ - : /``
(docs/architecture.md, "Python API"); others are a 400 naming ``id``, since the
``/v1/segments/{id}`` routes could never match them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator,
                      model_validator)

from inferscale_jax.sampling import MAX_LOGPROBS, MAX_STOP_STRINGS
from inferscale_jax.segments import SEGMENT_ID_ALPHABET, SEGMENT_ID_RE

SegmentId = Annotated[str, StringConstraints(min_length=1, max_length=256)]
MAX_SEGMENTS_PER_REQUEST = 64
MAX_N = 16  # samples per request
MAX_MESSAGES = 4096
MAX_PROMPTS = 256  # prompts of one completions request
MAX_CHOICES = 1024  # prompts x n


def _check_id(v: str, what: str = "a segment id") -> str:
    if not SEGMENT_ID_RE.fullmatch(v):
        why = "characters outside that set" if 1 <= len(v) <= 256 else f"{len(v)} characters"
        raise ValueError(f"{what} is 1-256 characters of {SEGMENT_ID_ALPHABET} (this one has {why}); "
                         "choose an id of those characters only")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def unsupported(field: str, fix: str) -> str:
    return f"unsupported field {field!r} with this value: {fix}"


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


# Known OpenAI / vLLM fields that do not change the output: accepted, listed in the response
# header x-inferscale-ignored-fields (docs/architecture.md, "Field policy").
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                  "priority", "guided_decoding_backend")
# Known fields accepted only with their neutral value (then listed as ignored); any other value is
# a 400 saying the effect is not built.  name -> (is this value neutral?, what to send instead)
_NEUTRAL = {
    "functions": (lambda v: not v, "omit it or send []: function calling is not implemented"),
    "function_call": (lambda v: v in (None, "none"), 'omit it or send "none"'),
    "best_of": (lambda v: v in (None, 1), "omit it or send 1; n=... returns several samples"),
    "suffix": (lambda v: v is None, "omit it (insertion is not implemented)"),
    "use_beam_search": (lambda v: v in (None, False), "omit it or send false (beam search is not implemented)"),
}
# Known fields whose effect is not built: any value but null is a 400 saying so.
UNSUPPORTED_FIELDS = ("chat_template", "documents", "mm_processor_kwargs", "audio",
                      "modalities", "prediction", "reasoning_effort", "web_search_options")


class _Generation(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=300)
    # extensions (vLLM's names)
    segments: list[SegmentId] = Field(default_factory=list, max_length=MAX_SEGMENTS_PER_REQUEST)
    mode: Literal["exact", "compose", "blend"] = "exact"
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    bad_words: list[Annotated[str, StringConstraints(min_length=1)]] = Field(default_factory=list, max_length=64)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # accepted, no effect on the output (IGNORED_FIELDS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    priority: int | None = None
    guided_decoding_backend: str | None = None
    # structured outputs (serving/response_format.py) and tools (serving/tools.py)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # accepted only when neutral (_NEUTRAL)
    functions: list | None = None
    function_call: str | dict | None = None
    use_beam_search: bool | None = None
    # known, not built (UNSUPPORTED_FIELDS)
    chat_template: object = None
    documents: object = None
    mm_processor_kwargs: object = None
    audio: object = None
    modalities: object = None
    prediction: object = None
    reasoning_effort: object = None
    web_search_options: object = None

    @field_validator(*_NEUTRAL, check_fields=False)
    @classmethod
    def _neutral(cls, v, info: ValidationInfo):
        neutral, fix = _NEUTRAL[info.field_name]
        if not neutral(v):
            raise ValueError(unsupported(info.field_name, fix))
        return v

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, v, info: ValidationInfo):
        if v is not None:
            raise ValueError(f"unsupported field {info.field_name!r}: this server does not implement it "
                             "(docs/architecture.md, 'Field policy'); omit it")
        return v

    def ignored_fields(self) -> list[str]:
        """The fields the client set that change nothing (docs/architecture.md, "Field policy")."""
        names = [f for f in IGNORED_FIELDS if f in self.model_fields_set]
        names += [f for f in _NEUTRAL if f in self.model_fields_set and f in type(self).model_fields]
        return sorted(names)

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        v = [v] if isinstance(v, str) else v
        if v is not None and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(v)})")
        if v is not None and any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for k in v or {}:
            if not k.isdigit() or len(k) > 10:
                raise ValueError(f"logit_bias keys are token ids as strings (\"50256\"), not {k!r}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request (got {len(v)}); split the batch")
            if any(not p for p in v):
                raise ValueError("every prompt of the list needs at least one character or token")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (a list of strings or of token-id lists is several)."""
        v = self.prompt
        return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]

    @model_validator(mode="after")
    def _zero_tokens(self):
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens=0 generates nothing: it needs echo=true (with logprobs to score the "
                             "prompt) or prompt_logprobs; otherwise send max_tokens >= 1")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts)} prompts x n={self.n} is more than {MAX_CHOICES} choices; "
                             "split the batch")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class SegmentPart(BaseModel):
    """A segment placed inside a message (``serving/chat.py``)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["segment"]
    id: SegmentId

    @field_validator("id")
    @classmethod
    def _id(cls, v):
        return _check_id(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | SegmentPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an earlier assistant turn's calls (serving/tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat-template controls (serving/chat.py)
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _tokens(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree: send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message=true needs add_generation_prompt=false (the reply continues "
                             "the last message instead of starting a new one)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message=true needs the last message to be the assistant's")
        return self

    # conversation memory (inferscale_jax/sessions.py): the tenant's session this turn reads and extends
    session: SegmentId | None = None

    @field_validator("session")
    @classmethod
    def _session(cls, v):
        return v if v is None else _check_id(v, "a session id")


class SegmentCreate(_Strict):
    id: str
    text: str | None = None
    token_ids: list[int] | None = None
    public: bool = False
    pin: bool = False

    @field_validator("id")
    @classmethod
    def _id(cls, v):
        return _check_id(v)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' or 'token_ids'")
        return self


class SegmentContent(_Strict):
    """``PUT /v1/segments/{id}`` (the new content) and ``POST /v1/segments/{id}/append`` (the tokens
    to append): exactly one of ``text`` / ``token_ids``."""
    text: str | None = None
    token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' or 'token_ids'")
        return self
