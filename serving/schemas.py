"""Request bodies: OpenAI field names and types, plus the ``segments`` / ``mode`` extensions.

Validation is strict (pydantic strict mode): ``"16"`` is not an integer and ``true`` is not a
number, as in OpenAI's API.  NaN and infinities are rejected.

**Unknown fields are rejected (422, ``invalid_field``), not ignored.**  OpenAI itself rejects
unrecognized arguments; silently dropping a field this server does not implement (``n: 4``,
``tools``, ``response_format``, a typo like ``max_token``) would return an answer to a question
the client did not ask.  Fields OpenAI clients commonly send with neutral values are accepted
when neutral and rejected otherwise with a message saying so: ``n`` (1), ``presence_penalty`` /
``frequency_penalty`` (0), ``logit_bias`` (empty), ``echo`` (false), ``best_of`` (1),
``suffix`` (null), ``user`` (accepted, unused).  Inside chat ``messages``, extra keys that clients
echo back from earlier responses (``refusal``, ``annotations``, ...) are ignored.

Extensions (vLLM names where vLLM has one): ``segments`` (ids to inject, in order), ``mode``
(``exact`` | ``compose`` | ``blend``), ``top_k``, ``stop_token_ids``, ``ignore_eos``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from inferscale_jax.sampling import MAX_LOGPROBS, MAX_STOP_STRINGS

SegmentId = Annotated[str, StringConstraints(min_length=1, max_length=256)]
MAX_SEGMENTS_PER_REQUEST = 64
MAX_MESSAGES = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions
    segments: list[SegmentId] = Field(default_factory=list, max_length=MAX_SEGMENTS_PER_REQUEST)
    mode: Literal["exact", "compose", "blend"] = "exact"
    top_k: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        v = [v] if isinstance(v, str) else v
        if v is not None and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(v)})")
        if v is not None and any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported: send one request per completion")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported: omit the field or send 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported: omit the field or send {}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            return v[0]
        return v

    @model_validator(mode="after")
    def _neutral(self):
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _tokens(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree: send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


class SegmentCreate(_Strict):
    id: SegmentId
    text: str | None = None
    token_ids: list[int] | None = None
    public: bool = False
    pin: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' or 'token_ids'")
        return self
