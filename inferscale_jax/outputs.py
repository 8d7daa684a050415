"""What ``Engine.generate`` returns: the text, the ids, per-token log-probs and the metrics."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


@dataclasses.dataclass
class RequestMetrics:
    ttft_s: float = 0.0  # request start -> first token sampled
    # request start -> first admitted with its pages (running): the queue's share of ttft_s (a chain
    # node computed for it by a node job counts as queue)
    queue_s: float = 0.0
    prompt_tokens: int = 0  # the whole sequence: segments + prompt
    cached_tokens: int = 0  # of those, tokens whose KV was reused (segments, chains, prefix hits)
    generated_tokens: int = 0
    decode_tokens_per_s: float = 0.0  # generated tokens after the first / their decode time
    e2e_s: float = 0.0


@dataclasses.dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) | "length" (max_tokens)
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None  # per generated position: {token_id: logprob}
    request_id: str = ""
    # SamplingParams.prompt_logprobs: per prompt token, {token_id: logprob} (None: the sequence's
    # first token, which has nothing before it); scoring.py
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ids: list[int] | None = None  # the prompt's ids, when prompt_logprobs is set


class PromptScores(NamedTuple):
    """``Engine.prompt_logprobs``: per prompt token, its ``{token_id: logprob}`` (the token and
    the top alternatives; None for the sequence's first token) and its rank (1: most likely)."""
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    ranks: list[int | None]
    num_tokens: int  # the whole scored sequence: BOS + segments + prompt
