"""A request's state as the scheduler keeps it: ``Request`` (one generation), ``NodeJob`` (a
missing chain node computed for the requests waiting on it), ``RequestOutput`` (what a step gives
back per request) and ``RequestStatus``, the states a request moves through:

    WAITING --admitted--> RUNNING --last token, a stop, an abort--> FINISHED
    WAITING --admitted, its chain node missing--> NODE --the node computed (or its job dropped)--> WAITING
    RUNNING --preempted (its pages are needed)--> WAITING
    COMPILING --its grammar compiled (structured.py)--> WAITING   (a constrained request starts here)
    (an abort or an error finishes a request from any state)

``RequestStatus`` is a ``str`` enum, so a status still compares equal to its name ("running").
The scheduler (scheduler.py) owns every transition; nothing else writes ``status``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from typing import TYPE_CHECKING

import numpy as np

from inferscale_jax.outputs import GenerationOutput
from inferscale_jax.runner import StepRow
from inferscale_jax.sampling import SamplingParams, step_bias
from inferscale_jax.segments import ChainNode, Segment
from inferscale_jax.tracing import RequestTrace

if TYPE_CHECKING:
    from inferscale_jax.kv_manager import Seq


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"  # queued for admission (FairQueue)
    COMPILING = "compiling"  # its grammar compiles off the engine thread; admitted after
    NODE = "node"  # admitted, waiting on a NodeJob that computes its missing chain node
    RUNNING = "running"  # has pages: prefilling its prompt, then decoding
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(eq=False)  # identity: `req in running` / `remove` compared every field of every row
class Request:
    id: str
    tenant: str
    prompt_tokens: list[int]  # bos + segment tokens + prompt
    chain: list[Segment]
    sampling: SamplingParams
    mode: str
    key: np.ndarray  # [2] uint32
    arrival: float
    status: RequestStatus = RequestStatus.WAITING
    seq: Seq | None = None  # its pages while running (kv_manager.Seq)
    slot: int = -1  # its row in the runner's page tables while it decodes (page_tables.py)
    job: NodeJob | None = None  # the node job it waits on (status "node")
    chain_computed: int = 0  # tokens of chain nodes computed for it (not counted as cached)
    prefill_end: int = 0  # seq.computed reaches this when the (re)admitted prompt is computed
    nodes: list[ChainNode] = dataclasses.field(default_factory=list)
    out_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    cached_tokens: int | None = None
    ttft_s: float | None = None
    t_first: float = 0.0
    t_running: float = 0.0  # when it first ran (admitted with its pages): RequestMetrics.queue_s
    finish_reason: str | None = None
    text: str | None = None
    preemptions: int = 0
    stop_ids: frozenset | None = None  # stop token ids + EOS unless ignore_eos (set at the first token)
    trace: RequestTrace | None = None  # spans and the JSON log line (tracing.py)

    # bad words as token ids (``sampling.tokenize_bad_words``, set by ``Engine.submit``)
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None  # per prompt token (``Engine.submit`` with prompt_logprobs)
    prompt_ids: list[int] | None = None  # the client's prompt ids (with prompt_logprobs)
    # structured outputs (structured.py): its grammar's matcher, or a future of it while it compiles
    grammar: object | None = None

    def __post_init__(self):
        sp = self.sampling
        self.penalty = sp.has_penalty  # (read per row per step)
        self.processed = sp.has_penalty or sp.has_bias or sp.min_p > 0
        # its next row's bias depends on its last generated token (a multi-token bad word), so that
        # token must be on the host before the row is built (no device feed)
        self.needs_host_tail = any(len(w) > 1 for w in self.bad_words_ids)
        # after its first, each token needs only the stop-id and max_tokens checks (no log-probs, stop
        # strings, grammar or min_tokens): the scheduler handles it inline (_apply_all)
        self.plain = sp.logprobs is None and not sp.stop and self.grammar is None and not sp.min_tokens

    @property
    def matcher(self):
        """Its grammar's matcher once compiled (None: unconstrained, or still compiling)."""
        g = self.grammar
        return g if g is not None and not isinstance(g, concurrent.futures.Future) else None

    @property
    def prefilling(self) -> bool:
        return self.seq is not None and self.seq.computed < self.prefill_end

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    def row(self, tokens: list[int], start: int, fed: int = 0) -> StepRow:
        """Its step row; ``fed``: its token is the in-flight step's (last) sample, read on the
        device, and that step samples ``fed`` of its tokens (one; a decode loop's row: up to its
        budget), so this row samples its generated token ``len(out_ids) + fed``."""
        sp = self.sampling
        step = len(self.out_ids) + fed
        samples = start + len(tokens) >= self.prefill_end  # (else a prompt chunk before the last: its sample is
        # dropped, so it draws nothing - a step whose drawing rows were all such chunks would run the sampler's
        # draw for nothing, runner.ModelRunner.dispatch)
        row = StepRow(tokens, start, self.seq.pages, sp.temperature if samples else 0.0, sp.top_k, sp.top_p,
                      self.key, step, slot=self.slot)
        if self.processed:  # the lists themselves: the runner copies them when it packs the step
            row.presence_penalty, row.frequency_penalty = float(sp.presence_penalty), float(sp.frequency_penalty)
            row.repetition_penalty = float(sp.repetition_penalty)
            row.output_ids, row.prompt_ids = self.out_ids, self.prompt_tokens
            row.min_p = float(sp.min_p)
            if sp.has_bias:
                row.bias = step_bias(sp, step, None if fed else self.out_ids, self.stop_ids or (),
                                     self.bad_words_ids)
        if self.grammar is not None and samples:
            row.matcher = self.matcher  # (fed: its mask is made once the fed token is applied: _step)
        return row


@dataclasses.dataclass(eq=False)  # (identity, as Request)
class NodeJob:
    """A missing chain node computed as prefill rows for the requests waiting on it (scheduler.py's
    module docstring, 2).  It holds one reader on ``parent`` while it exists and one reference on each
    of ``seq``'s pages until the node takes them over (or the job is dropped)."""
    key: tuple  # the node's chain-index key (namespace, uids)
    chain: list[Segment]
    parent: ChainNode
    waiters: list[Request] = dataclasses.field(default_factory=list)
    seq: Seq | None = None  # its pages once allocated (kv_manager.Seq)
    wants_logprobs = False

    def row(self, tokens: list[int], start: int) -> StepRow:
        return StepRow(tokens, start, self.seq.pages)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: GenerationOutput | None = None
    error: Exception | None = None  # set when the request could not be served
    text: str = ""  # the text these ids add (``AsyncEngine.stream`` fills it; the engine leaves it "")
    logprobs: list[dict[int, float]] | None = None  # per new id, when the request asked for logprobs
    prompt_tokens: int = 0  # the request's whole sequence (segments + prompt); usage before the end
