"""Continuous batching: the life of a request inside the engine, one scheduler step at a time.

1. **Submit** (``Engine.submit``): the request is validated (segments resolved for its tenant,
   lengths checked, sampling checked) and queued as *waiting*.  Nothing is allocated yet.
2. **Admit** (``admit``, every iteration): each admission goes to the waiting tenant
   with the fewest requests running, then to its requests first come, first served, except that
   within a short look-ahead window a request whose segment chain is already resident (no chain
   node to compute) goes before one that needs work (``fair_queue.py``).  With
   ``tenant_reserve`` no tenant holds more than ``tenant_cap`` rows (``max_batch`` less the
   reserve), so while one tenant floods, the rows kept free admit another's request at the
   next step instead of after a running request finishes.  Admission
   walks the chain (``KVManager.start``).  If a chain node ``[s1..si]`` is missing, the request
   waits on that node's *node job* (``NodeJob``): one per missing node, shared by every request
   that needs it, holding a reader on the node's parent and, once it has them, the node's
   pages (``KVManager.node_seq``; if the pool cannot hold them the job waits like a request, and
   admission stops behind it; when nothing running or computing could ever free pages, its
   requests fail with ``PoolExhausted``).  The job's tokens are computed as chunks of the
   device steps (3) while other requests keep decoding.  After its last chunk the node is
   cached (``KVManager.add_node``; not if one of its segments was deleted meanwhile) and its
   requests go back to the head of the waiting queue, holding a reader on it: admitted again,
   they find it (a deeper chain may then wait on the next node's job).  A job whose segments
   are deleted is dropped (its pages released) and its requests re-admitted, which fails them
   with ``SegmentNotFound`` as for any deleted segment.  Aborting the last request waiting on
   a job cancels the job and frees its pages (nothing is cached); a job whose rows fail fails
   the requests waiting on it only.  With the whole chain cached, admission *prepares* the
   sequence: shared pages of the final node, prefix-cache hits, a private copy of a shared
   partial page, fresh pages for the rest.  If the pool cannot hold it, the request stays
   waiting (and so do those behind it: no starvation).  At most ``max_batch`` requests run or
   wait on node jobs at once.
3. **One device step per iteration** (``schedule``): every decoding request feeds its last
   sampled token (one row of one token each), then node jobs and prefilling requests add their next
   chunks (at most ``prefill_chunk`` tokens each) until the step's token budget
   (``EngineConfig.max_num_batched_tokens``) is spent, oldest work first.  The device step is
   padded to a token bucket (``buckets.py``), and above ``ROUND_DOWN_MIN_TOKENS`` a bucket's cost
   grows with its tokens, so a step that would just overflow one (256 decode rows and 5 questions
   of 64: 576 tokens in the 1024 bucket) takes only the prefill tokens that fill the bucket below
   (512) when that is at least as many as it leaves for the next step (``_token_budget``): the
   rest rides in a later step, and no step pays for ~450 padding tokens (bench/NOTES.md, session
   31).  The step is plain
   data (``runner.StepPlan``: rows with their tokens, positions and page tables, the log-prob
   width, the cascade groups, the rows fed on the device) that the engine-core loop
   (``step_loop.py``) hands to the runner; the scheduler holds no runner: it plans
   (``schedule``), counts a dispatched step (``dispatched``), applies a read-back step's results
   (``update``) and forgets a lost one (``rollback``).  All rows go through
   one ragged device step (a flat token batch, each row with its own query length), so a long
   prompt or chain node never stalls decodes: it advances one chunk per step beside them.  A
   request whose last chunk is computed samples its first output token (TTFT) from it; from
   the next step on it decodes.  A decode row crossing a page boundary needs a new page
   first; if none is free (after evicting cached chain nodes), the **newest** running request
   is preempted: its pages are released and it goes back to the head of the waiting queue.
   When re-admitted it recomputes prompt + generated tokens (mostly prefix-cache hits) and
   continues with the same per-step sampling keys, so its output is unchanged.
   *Overlap*: each step is dispatched before the previous one is read (the ids that step
   samples feed the new one on the device), and the previous step's ids are processed while
   the device computes.  ``computed`` counts a row from its dispatch, so a prefill continues
   with its next chunk at once; pages enter the prefix cache when their step is read back, and
   a step whose results are lost is forgotten (``computed`` rolled back) and recomputed, each
   row alone (``rows_alone``).
   *Cascade*: among a step's rows (a pure decode step's decode rows; a mixed step's decode rows
   and its requests' prefill chunks), requests that start with the same read-only pages (one
   segment chain's node, or the same prefix-cache hits) form a group; every group of two query
   tokens or more with a decode row (at most ``buckets.MAX_GROUPS``, those saving the most first), when together
   they save enough reads, has its pages read once per step for all its rows
   (``_cascade_groups``, the multi-group cascade kernel: every group in one launch), while the
   other rows in the same step read their own pages.  A question's chunk over a 4k segment that
   decode rows read too so attends the segment in the shared kernel's split programs beside
   them, and only its own tokens in the ragged kernel.
4. **Finish**: EOS, a stop token or string, ``max_tokens``, or ``abort``: the request's page
   references are dropped at once (its full pages stay in the prefix cache) and its chain
   nodes lose a reader; one waiting on a node job leaves it (the last one cancels it).

Every step returns ``RequestOutput`` deltas (new token ids, and the final ``GenerationOutput``
when finished); ``AsyncEngine`` turns them into per-request streams.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferscale_jax.buckets import MAX_GROUPS
from inferscale_jax.config import EngineConfig
from inferscale_jax.errors import EngineFault, PoolExhausted, RequestTooLong, SegmentNotFound
from inferscale_jax.fair_queue import FairQueue
from inferscale_jax.outputs import GenerationOutput, RequestMetrics
from inferscale_jax.request import NodeJob, Request, RequestOutput, RequestStatus
from inferscale_jax.runner import StepPlan, StepRow
from inferscale_jax.sampling import MAX_LOGPROBS, SamplingParams
from inferscale_jax.segments import SESSION_PREFIX, ChainNode, Segment, SegmentStore
from inferscale_jax.tracing import RequestTrace
from models import ModelConfig

if TYPE_CHECKING:
    from inferscale_jax.kv_manager import KVManager
    from inferscale_jax.page_tables import PageTables

log = logging.getLogger("inferscale.scheduler")
# a step whose tokens would overflow a token bucket of at least this many tokens fills that bucket
# instead, when it keeps at least as many prefill tokens as it leaves (module docstring, 3): from
# here up a step's matmuls are compute-bound (H100 / H200: 256 tokens of an 8B model read its
# weights in about the time they compute), so padding costs its share of the step
ROUND_DOWN_MIN_TOKENS = 256
ROUND_DOWN_ENV = "INFERSCALE_ROUND_DOWN_MIN_TOKENS"  # an A/B switch for benchmarks: N, or 0 (never round down)


def round_down_min_tokens() -> int:
    """``ROUND_DOWN_MIN_TOKENS``, or ``$INFERSCALE_ROUND_DOWN_MIN_TOKENS`` when set (0: off)."""
    raw = os.environ.get(ROUND_DOWN_ENV, "").strip()
    if not raw:
        return ROUND_DOWN_MIN_TOKENS
    if not raw.isascii() or not raw.isdigit():
        raise ValueError(f"{ROUND_DOWN_ENV}={raw!r} is invalid: must be a token count (0 turns the round-down "
                         f"off; unset: {ROUND_DOWN_MIN_TOKENS})")
    return int(raw)
LOOKAHEAD = 8  # waiting requests considered for resident-first admission
# cascade decode pays off once the step's groups save this many token reads per layer (the sum of
# (rows - 1) x shared tokens, see _cascade_groups); evidence: bench/NOTES.md, "Cascade (shared-prefix) decode"
CASCADE_MIN_SAVED_TOKENS = 16384
SETTLE = object()  # ``schedule``'s answer when the step in flight must be read and applied first


@dataclass(eq=False)
class Planned:
    """A step the scheduler planned: ``plan`` for the runner, and the scheduler's own view of it."""
    plan: StepPlan
    entries: list[tuple]  # per row: (request or node job, its row, whether it samples the request's next token)
    decode_rows: int  # (the first rows)
    tokens: int
    defer: bool  # its sampling waits until the in-flight step is applied (a constrained row is fed)
    # the sequences whose KV chores the plan carries, with them (``StepPlan.splices``): taken off
    # at dispatch, given back by a rollback (the rows that need them run again)
    splices_of: list[tuple] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVManager, tables: PageTables, *, config: EngineConfig, cfg: ModelConfig,
                 max_batch: int, max_tokens: int, decode: Callable[[list[int], SamplingParams], str],
                 counters: dict, token_buckets: Sequence[int] = ()):
        """Collaborators: ``kv`` (admission, pages, node caching); ``tables`` (the running
        requests' page-table rows by slot, which the runner packs from); ``max_batch`` rows and
        ``max_tokens`` tokens per step (the runner's bucket limits); ``decode`` turns ids into text
        (stop strings, final text); ``counters`` (a plain dict the engine reports) gets each
        finished request's token counts; ``token_buckets``: the runner's token buckets, ascending
        (``buckets.StepBuckets.token_buckets``; empty: a step's budget is never rounded down)."""
        self.kv, self.tables, self.config, self.cfg = kv, tables, config, cfg
        self.max_batch, self.max_tokens, self.decode, self.counters = max_batch, max_tokens, decode, counters
        self.token_buckets = tuple(token_buckets)
        self.round_down = round_down_min_tokens()
        reserve = config.tenant_reserve
        # rows one tenant may hold (module docstring, 2): all of them without a reserve
        self.tenant_cap = max_batch - max(1, math.ceil(reserve * max_batch)) if reserve > 0 and max_batch > 1 \
            else max_batch
        self.waiting = FairQueue()  # fair between tenants (fair_queue.py)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.jobs: dict[tuple, NodeJob] = {}  # node jobs by node key, oldest first
        self.preemptions = 0
        # steps dispatched, their rows (all / decode) and tokens: a served loop's batch shape (stats())
        self.steps = self.step_rows = self.step_decode_rows = self.step_tokens = 0
        self.loops = 0  # of them, decode loops (decode_loop.py)
        self.decode_steps = config.decode_steps  # (a benchmark may change it between runs: bench/engine/steps.py)
        self.failed: list[RequestOutput] = []  # admission failures, reported by the next step
        self._finished: list[RequestOutput] = []  # the final outputs of the current step
        self.compiling: list[Request] = []  # requests whose grammar is compiling (structured.py)

    # -- queue ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.trace = RequestTrace(req.id, req.tenant, req.mode, req.chain, len(req.prompt_tokens))
        sp = req.sampling
        req.stop_ids = frozenset(sp.stop_token_ids) | frozenset(() if sp.ignore_eos else self.cfg.eos_token_ids)
        self.requests[req.id] = req
        if isinstance(req.grammar, concurrent.futures.Future):
            req.status = RequestStatus.COMPILING  # its grammar compiles off this thread (structured.py)
            self.compiling.append(req)
        else:
            self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.jobs or self.compiling)

    def _compiled(self, idle: bool) -> None:
        """Queue the requests whose grammar finished compiling; fail those whose did not."""
        if idle and not self.running and not self.waiting and not self.jobs:
            concurrent.futures.wait([r.grammar for r in self.compiling], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)  # (nothing else to do)
        for req in [r for r in self.compiling if r.grammar.done()]:
            self.compiling.remove(req)
            try:
                req.grammar = req.grammar.result()
            except Exception as err:  # noqa: BLE001 - a grammar that does not compile fails its request alone
                self._fail(req, err if isinstance(err, ValueError) else ValueError(
                    f"structured output does not compile: {type(err).__name__}: {err}"), self.failed)
                continue
            req.status = RequestStatus.WAITING
            self.waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.status == RequestStatus.FINISHED:
            return None
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.COMPILING:
            self.compiling.remove(req)
        return self._finish(req, "abort")

    # -- one iteration (step_loop.py drives it) --------------------------------------------
    def admit(self, idle: bool = True) -> list[RequestOutput]:
        """The start of an iteration: queue what finished compiling, admit waiting requests (module
        docstring, 2); returns the outputs of requests that failed meanwhile.  ``idle``: no step
        is in flight (then, with nothing else to do, it waits briefly on compiling grammars)."""
        self._finished = []  # every request this iteration finishes (``finished_in_step``)
        if self.compiling:
            self._compiled(idle)
        self._admit()
        outs, self.failed = self.failed, []
        return outs

    def has_work(self) -> bool:
        """Whether a step has rows to plan: running requests, or node jobs with pages."""
        return bool(self.running) or any(j.seq is not None for j in self.jobs.values())

    def _resident(self, req: Request) -> bool:
        store = self.kv.store
        return all(store.node(req.chain[:i + 1], touch=False) is not None for i in range(len(req.chain)))

    @property
    def num_waiting(self) -> int:
        """Requests queued or waiting on a node job."""
        return len(self.waiting) + sum(len(j.waiters) for j in self.jobs.values())

    def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Requests per tenant: ``running`` (and on node jobs) and ``waiting`` (queued)."""
        out: dict[str, dict[str, int]] = {}
        for req in self.running + [r for j in self.jobs.values() for r in j.waiters]:
            out.setdefault(req.tenant, {"running": 0, "waiting": 0})["running"] += 1
        for tenant, n in self.waiting.count.items():
            out.setdefault(tenant, {"running": 0, "waiting": 0})["waiting"] = n
        return out

    def _active(self) -> int:
        """Requests running or waiting on a node job (at most ``max_batch``)."""
        return len(self.running) + self.num_waiting - len(self.waiting)

    def _admit(self) -> None:
        self._prune_jobs()
        if not self._provision_jobs():
            return
        capped = self.tenant_cap < self.max_batch
        running = None
        while self.waiting and self._active() < self.max_batch:
            if running is None and (capped or len(self.waiting.count) > 1):
                running = Counter(r.tenant for r in self.running)
                for job in self.jobs.values():
                    running.update(r.tenant for r in job.waiters)
            req = self.waiting.pick(running or Counter(), LOOKAHEAD, self._resident,
                                    self.tenant_cap if capped else None)
            if req is None:
                return  # every waiting tenant holds its cap: the reserved rows stay free
            t_adm = time.perf_counter()
            try:
                self._check_segments(req)
                tiers = [self.kv.tiers.where(seg) for seg in req.chain]  # (tracing: the cache outcome)
                promoted0 = self.kv.tiers.counters["promotion_bytes"]
                missing = self.kv.start(req)
            except PoolExhausted as err:
                if self.running or self.jobs:
                    return  # stays waiting until running requests (or node jobs) free pages
                self.waiting.remove(req)  # nothing will ever free pages for it: fail it
                self.failed.append(self._finish(req, "error", error=err))
                continue
            except EngineFault:
                raise
            except Exception as err:  # noqa: BLE001 - this request's own failure: fail it alone
                self.waiting.remove(req)
                self._fail(req, err, self.failed)
                continue
            self.waiting.remove(req)
            if req.trace is not None:
                computed = missing is not None or req.chain_computed > 0  # by a node job, or in its own prefill
                node = "none" if not req.chain else ("computed" if computed else "reused")
                req.trace.admitted(tiers, self.kv.tiers.counters["promotion_bytes"] - promoted0, node, t_adm)
            if missing is not None:
                if running is not None:
                    running[req.tenant] += 1
                self._wait_for_node(req, *missing)
                if not self._provision_jobs():
                    return
                continue
            req.status = RequestStatus.RUNNING
            req.t_running = req.t_running or time.perf_counter()
            self.running.append(req)
            if running is not None:
                running[req.tenant] += 1

    # -- node jobs (module docstring, 2) ---------------------------------------------------
    def _wait_for_node(self, req: Request, chain: list[Segment], parent: ChainNode) -> None:
        key = (SegmentStore.chain_namespace(chain), tuple(seg.uid for seg in chain))
        job = self.jobs.get(key)
        if job is None:
            job = self.jobs[key] = NodeJob(key, chain, parent)
            parent.readers += 1
        job.waiters.append(req)
        req.job, req.status = job, RequestStatus.NODE

    def _provision_jobs(self) -> bool:
        """Pages for the node jobs that have none yet, oldest first.  False when one must wait
        for pages (admission stops behind it); a job that could never get them (nothing
        running, no other job computing) fails its requests with ``PoolExhausted``."""
        for job in list(self.jobs.values()):
            if job.seq is not None:
                continue
            try:
                job.seq = self.kv.node_seq(job.chain, job.parent)
            except PoolExhausted as err:
                if self.running or any(j.seq is not None for j in self.jobs.values()):
                    return False
                self._fail_job(job, err, self.failed)
                continue
            except EngineFault:
                raise
            except Exception as err:  # noqa: BLE001 - this job's own failure: its requests fail
                self._fail_job(job, err, self.failed)
                continue
            if job.seq.computed >= len(job.seq.tokens):  # every page was a prefix-cache hit
                self._complete_job(job)
        return True

    def _prune_jobs(self) -> None:
        """Drop the jobs of nodes with a deleted (or replaced) segment; their requests are
        re-admitted (``_check_segments`` decides their fate)."""
        store = self.kv.store
        for job in list(self.jobs.values()):
            if not all(store.is_live(seg) for seg in job.chain):
                self._requeue(self._drop_job(job))

    def _drop_job(self, job: NodeJob) -> list[Request]:
        """Forget ``job``: its pages (if any) and its parent reader are released; returns its
        requests, detached from it (they keep their own node readers)."""
        del self.jobs[job.key]
        if job.seq is not None:
            self.kv.release(job.seq.pages)
            job.seq = None
        job.parent.readers -= 1
        waiters, job.waiters = job.waiters, []
        for req in waiters:
            req.job = None
        return waiters

    def _requeue(self, reqs: list[Request]) -> None:
        """Back to the head of the waiting queue, in their order, for admission next step."""
        for req in reversed(reqs):
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def _fail_job(self, job: NodeJob, err: Exception, outs: list[RequestOutput]) -> None:
        for req in self._drop_job(job):
            self._fail(req, err, outs)

    def _complete_job(self, job: NodeJob) -> None:
        """The job's last chunk is computed: cache the node (``KVManager.add_node``), give each of
        its requests a reader on it and requeue them."""
        seq, job.seq = job.seq, None  # the node takes over its page references
        waiters = self._drop_job(job)
        node = self.kv.add_node(job.chain, seq)
        if node is not None:
            if waiters:
                waiters[0].chain_computed += len(seq.tokens) - seq.cached
            node.readers += len(waiters)
            for req in waiters:
                req.nodes.append(node)
        self._requeue(waiters)

    def _check_segments(self, req: Request) -> None:
        """Before admission: every segment the request names must still be registered.  One
        updated after submit (``segment_updates.py``) is re-resolved to its current version: the
        request never ran, so it reads what a request submitted now would (its length checked
        again).  One deleted after submit fails a request that never ran with ``SegmentNotFound``.
        A preempted request already holds the segment's tokens in its prompt, so it continues
        without the chain (its KV is recomputed exactly, mostly from the prefix cache), as does a
        request whose session (``sessions.py``) another turn changed or deleted meanwhile."""
        store = self.kv.store
        if all(store.is_live(seg) for seg in req.chain):
            return
        if req.preemptions or any(seg.info.id.startswith(SESSION_PREFIX) for seg in req.chain):
            req.chain, req.mode = [], "exact"  # (a session changed by another turn: this turn's tokens stand)
            return
        current = [store.current(seg) for seg in req.chain]
        gone = next((seg for seg, cur in zip(req.chain, current) if cur is None), None)
        if gone is not None:
            raise SegmentNotFound(f"segment {gone.info.id!r} not found: it was deleted after this request was "
                                  "submitted; list your segments with GET /v1/segments and retry")
        bos = len(self.kv.bos_prefix)
        question = req.prompt_tokens[bos + sum(len(seg.token_ids) for seg in req.chain):]
        tokens = list(self.kv.bos_prefix) + [t for seg in current for t in seg.token_ids] + question
        total = len(tokens) + req.sampling.max_tokens
        limit = min(self.config.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings,
                    (self.kv.pool.num_pages - 1) * self.config.page_size)
        if total > limit:
            raise RequestTooLong(
                f"request needs {total} tokens ({len(tokens)} prompt + {req.sampling.max_tokens} max_tokens) after "
                f"segment {req.chain[0].info.id!r} was updated, but the limit is {limit} (the model's "
                "max_position_embeddings or the KV page pool); shorten it or lower max_tokens")
        req.chain, req.prompt_tokens = current, tokens

    def _fail(self, req: Request | NodeJob, err: Exception, outs: list[RequestOutput]) -> None:
        """Fail one request with ``err`` (its pages released) and report it in ``outs``; for a
        node job, every request waiting on it."""
        if isinstance(req, NodeJob):
            return self._fail_job(req, err, outs)
        if isinstance(err, (SegmentNotFound, ValueError)):
            log.info("request %s failed: %s", req.id, err)
        else:
            log.error("request %s failed", req.id, exc_info=err)
        outs.append(self._finish(req, "error", error=err))

    def finished_in_step(self) -> list[RequestOutput]:
        """The final outputs of the requests the current step finished: after the step raised,
        they are reported from here (its return value is lost), so no request's stream hangs."""
        outs, self._finished = self._finished, []
        return outs

    def fail_running(self, err: Exception) -> list[RequestOutput]:
        """Fail every running request with ``err`` (an engine-wide fault); waiting ones stay queued.
        (The steps not read back are the caller's to ``rollback`` first: a node job's chunk in
        them must be computed again, or the job would never complete.)"""
        outs: list[RequestOutput] = []
        for req in list(self.running):
            outs.append(self._finish(req, "error", error=err))
        return outs

    def schedule(self, inflight: Planned | None) -> Planned | None | object:
        """Plan one device step: every decoding request's next token, then prefill chunks of node
        jobs and prefilling requests within the token budget (module docstring, 3).  Returns the
        step (``Planned``), None when no row runs, or ``SETTLE`` when ``inflight`` (the step
        dispatched last, not yet read) must be read and applied first (``update``) - a page
        allocation that would need a preemption (preemption needs settled requests), or a row
        whose bias needs its in-flight token on the host - after which the loop plans again.

        A request whose token ``inflight`` samples is fed it on the device (``StepPlan.src``),
        unless that token is its last (``max_tokens``): it gets no row.  A request whose in-flight
        token turns out to end it (EOS, a stop string) has one extra row computed and ignored.
        With ``decode_steps`` > 1, a step of decode rows only runs as a decode loop
        (``_loop_steps``; decode_loop.py); the in-flight step may then have sampled several
        tokens of a request (``lag``), and its next row starts past all of them."""
        s = self.config.page_size
        prev = inflight.entries if inflight is not None else None
        # requests whose next tokens the in-flight step samples (how many: its lag, one unless it
        # is a decode loop's row): they feed the last one on the device
        pend: dict[int, int] = {}
        lag: dict[int, int] = {}
        if prev is not None:
            loop = inflight.plan.stops if inflight.plan.steps > 1 else None
            for j, (o, _, samples) in enumerate(prev):
                if samples:
                    pend[id(o)], lag[id(o)] = j, (loop[j][1] if loop is not None else 1)
        # ... unless those tokens reach its last (max_tokens): they feed nothing more
        ending = {i for i, j in pend.items() if len(prev[j][0].out_ids) + lag[i] >= prev[j][0].sampling.max_tokens}
        if any(prev[j][0].needs_host_tail for j in pend.values()):
            return SETTLE  # a row's bias needs its in-flight token on the host (multi-token bad words)
        # requests whose fed token starts a new page (the position it feeds: its last token's, or
        # past the in-flight ones), oldest first: an allocation may preempt the newest
        # (the first test is the farthest one's bound, cheap and false for most rows: the position fed
        # is at most len(tokens) - 1 + the largest lag)
        top = max(lag.values(), default=1)
        grow = [r for r in self.running if (len(r.seq.tokens) - 1 + top) // s >= len(r.seq.pages)
                and not r.prefilling and id(r) not in ending
                and (len(r.seq.tokens) - 1 + lag.get(id(r), 0)) // s >= len(r.seq.pages)]
        for req in sorted(grow, key=lambda r: r.arrival) if len(grow) > 1 else grow:
            if req.status != RequestStatus.RUNNING:
                continue  # (preempted while making room for an older request)
            seq = req.seq
            if (len(seq.tokens) - 1 + lag.get(id(req), 0)) // s < len(seq.pages):
                continue
            while True:
                try:
                    seq.pages += self.kv.allocate(1)
                    break
                except PoolExhausted:
                    if prev is not None:
                        return SETTLE  # settle the in-flight step before preempting
                    victim = max(self.running, key=lambda r: r.arrival)
                    self._preempt(victim)
                    if victim is req:
                        break
        steps, budgets = self._loop_steps(ending, lag)
        rows, owners, src = [], [], []
        prefilling = []
        tables = self.tables
        for req in self.running:  # decode rows first: every decoding request, one token
            if req.status != RequestStatus.RUNNING or id(req) in ending:
                continue
            if req.prefilling:
                prefilling.append(req)
                continue
            if req.slot < 0:  # its first decode row: its page table gets a persistent row
                req.slot = tables.add()
            j = pend.get(id(req))
            if j is None:
                pos = len(req.seq.tokens) - 1  # the last sampled token, not yet in the cache
                rows.append(req.row([req.seq.tokens[pos]], pos))
            else:  # its (last) in-flight token, read on the device
                rows.append(req.row([0], len(req.seq.tokens) - 1 + lag[id(req)], fed=lag[id(req)]))
            owners.append(req)
            src.append(-1 if j is None else j)
        decode_rows = len(rows)
        work = self._prefill_work(prefilling)
        budget = budget0 = self._token_budget(decode_rows, work)
        for owner in work:  # then chunks, oldest work first, within the budget
            if budget <= 0 or len(rows) >= self.max_batch:
                break
            rows.append(self._chunk_row(owner, budget))
            owners.append(owner)
            src.append(-1)
            budget -= len(rows[-1].tokens)
        if not rows:
            return None
        entries = [(o, row, isinstance(o, Request) and row.start + len(row.tokens) >= o.prefill_end)
                   for o, row in zip(owners, rows)]
        nl = MAX_LOGPROBS if any(o.wants_logprobs for o in owners) else 0
        cascade = self._cascade_groups(owners, rows, decode_rows)
        for gi, (_, members) in enumerate(cascade):
            for i in members:
                rows[i].group = gi
        feeds = prev is not None and any(j >= 0 for j in src)
        # a constrained row fed on the device: its mask needs the fed token applied to its
        # grammar first, so the step's sampling waits for the in-flight step (its forward does not)
        defer = feeds and any(j >= 0 and o.grammar is not None for o, j in zip(owners, src))
        plan = StepPlan(rows, nl, [k for k, _ in cascade], src if feeds else None)
        # the KV chores of sequences whose first row this is (decode rows have none: a sequence
        # computes at least one token of its prompt)
        splices_of = [(o.seq, o.seq.splices) for o in owners[decode_rows:] if o.seq.splices]
        for _, splices in splices_of:
            plan.splices += splices
        if steps > 1:  # (decode rows only: _loop_steps)
            plan.steps, plan.stops = steps, [(o.stop_ids, budgets[id(o)]) for o in owners]
        return Planned(plan, entries, decode_rows, decode_rows + budget0 - budget, defer, splices_of)

    def _loop_steps(self, ending: set[int], lag: dict[int, int]) -> tuple[int, dict[int, int]]:
        """How many decode steps the next step runs in one device loop (decode_loop.py), and each
        decoding request's budget in it (by ``id``; the most tokens it samples there): 1, or
        ``decode_steps`` when every row would be a decode row that needs no host between its
        tokens (no penalty, bias, ``min_p`` or grammar), one of them has ``decode_steps`` tokens
        left to sample at least, no request waits for admission or a prefill chunk (it would wait
        the whole loop), and every decoding request's pages cover the positions the loop writes
        for it (its budget's: ``decode_steps``, or fewer tokens left to ``max_tokens``, which also
        keeps them inside ``max_model_len``) - taken now, all or nothing, from free pages only: a
        loop never evicts or preempts, and when the pool is short the step runs alone, with no
        page taken."""
        n, single = self.decode_steps, (1, {})
        if n <= 1 or self.waiting or self.compiling or any(
                j.seq is not None and j.seq.computed < len(j.seq.tokens) for j in self.jobs.values()):
            return single
        decoding = [r for r in self.running if r.status == RequestStatus.RUNNING and id(r) not in ending]
        if not decoding or any(r.prefilling or r.processed or r.grammar is not None or r.needs_host_tail
                               for r in decoding):
            return single
        # (>= 1 each: a request whose in-flight tokens reach max_tokens is ``ending``)
        budgets = {id(r): min(n, r.sampling.max_tokens - len(r.out_ids) - lag.get(id(r), 0)) for r in decoding}
        if max(budgets.values()) < n:
            return single  # no row can use the whole loop (its iterations all run: decode_loop.py)
        s, pool = self.config.page_size, self.kv.pool
        needs = []
        for req in decoding:
            # the last position the loop writes for it: its input's (its last token, or past its
            # in-flight ones) + its budget - 1
            need = (len(req.seq.tokens) - 2 + lag.get(id(req), 0) + budgets[id(req)]) // s + 1 - len(req.seq.pages)
            if need > 0:
                needs.append((req, need))
        if sum(k for _, k in needs) > pool.num_free:
            return single
        for req, k in needs:
            req.seq.pages += pool.allocate(k)
        return n, budgets

    def dispatched(self, step: Planned) -> None:
        """``step`` is on the device: each row counts as computed from now (the next step continues
        a prefill at once; pages enter the prefix cache only when ``update`` reads the step)."""
        if step.plan.steps > 1:  # a decode loop's row computes its budget's positions
            self.loops += 1
            for (owner, row, _), (_, budget) in zip(step.entries, step.plan.stops):
                owner.seq.computed = row.start + budget
        else:
            for owner, row, _ in step.entries:
                owner.seq.computed = row.start + len(row.tokens)
        for seq, _ in step.splices_of:  # (run before the step, on the device's queue)
            seq.splices = []
        self.steps += 1
        self.step_rows += len(step.entries)
        self.step_decode_rows += step.decode_rows
        self.step_tokens += step.tokens

    def update(self, step: Planned, res) -> list[RequestOutput]:
        """Apply a read-back step's results (``_apply``, row by row; a plain token inline); a
        decode loop's, iteration by iteration for each row (``_apply_loop``)."""
        if step.plan.steps > 1:
            return self._apply_loop(step.entries, res)
        return self._apply_all(step.entries, res)

    def before_sample(self, step: Planned) -> None:
        """A deferred step's sampling is next (its fed tokens are applied): a constrained row whose
        request its fed token ended gets no mask (its result is ignored)."""
        for owner, row, _ in step.entries:
            if row.matcher is not None and owner.status != RequestStatus.RUNNING:
                row.matcher = None

    def rollback(self, *steps: Planned | None) -> None:
        """Forget ``steps`` whose results will never be read: each request's (or node job's)
        ``computed`` goes back to its first row in them (rerunning a position rewrites the same KV),
        and a sequence whose KV chores they carried gets them back (its first row runs again)."""
        starts: dict[int, tuple[object, int]] = {}
        for step in steps:
            for seq, splices in (step.splices_of if step is not None else ()):
                seq.splices = splices
            for owner, row, _ in (step.entries if step is not None else ()):
                if owner.seq is not None:
                    old = starts.get(id(owner), (owner, row.start))[1]
                    starts[id(owner)] = (owner, min(old, row.start))
        for owner, start in starts.values():
            owner.seq.computed = start

    def rows_alone(self) -> tuple[list[Request | NodeJob], list[StepRow]]:
        """After a lost step: the next step's rows, each to run as a step of its own (so a row
        that fails fails its request, or its node job's requests, only).  A decoding request whose
        fed position has no page gets one, or is preempted (recomputed later, same output)."""
        s = self.config.page_size
        decoding = sorted((r for r in self.running if not r.prefilling and r.status == RequestStatus.RUNNING),
                          key=lambda r: r.arrival)
        for req in list(decoding):  # the page of the position each one feeds (a failed step may not have it)
            if (len(req.seq.tokens) - 1) // s >= len(req.seq.pages):
                try:
                    req.seq.pages += self.kv.allocate(1)
                except PoolExhausted:
                    self._preempt(req)  # recomputed later, same output
                    decoding.remove(req)
        owners: list[Request | NodeJob] = list(decoding)
        rows = [r.row([r.seq.tokens[-1]], len(r.seq.tokens) - 1) for r in decoding]
        for owner in self._prefill_work([r for r in self.running if r.prefilling and r.status == RequestStatus.RUNNING]):
            rows.append(self._chunk_row(owner))
            owners.append(owner)
        return owners, rows

    def apply_alone(self, done: list[tuple[Request | NodeJob, StepRow, object]]) -> list[RequestOutput]:
        """Apply the rows ``rows_alone`` planned that ran (owner, row, result)."""
        outs: list[RequestOutput] = []
        for owner, row, res in done:
            if owner.seq is None:
                continue  # (a node job dropped by an earlier row's failure)
            owner.seq.computed = row.start + len(row.tokens)
            outs += self._apply(owner, row.start + len(row.tokens), res, 0)
        return outs

    def fail(self, owner: Request | NodeJob, err: Exception) -> list[RequestOutput]:
        """Fail one request (or a node job's requests) with ``err``: their outputs."""
        outs: list[RequestOutput] = []
        self._fail(owner, err, outs)
        return outs

    def _prefill_work(self, prefilling: list[Request]) -> list[Request | NodeJob]:
        """What has prompt tokens left to compute, in order: node jobs with pages, then the
        ``prefilling`` requests."""
        jobs = [j for j in self.jobs.values() if j.seq is not None and j.seq.computed < len(j.seq.tokens)]
        return jobs + prefilling

    def _token_budget(self, decode_rows: int, work: list) -> int:
        """The prefill tokens a step of ``decode_rows`` decode rows may take from ``work`` (its node
        jobs and prefilling requests, in order): the step's budget, or less when the step would
        just overflow a token bucket of ``round_down`` (``ROUND_DOWN_MIN_TOKENS``) tokens or more and filling that bucket
        keeps at least as many of the tokens it could take as it leaves (module docstring, 3)."""
        budget = self.max_tokens - decode_rows
        if not self.token_buckets or self.round_down <= 0 or budget <= 0:
            return budget
        avail = 0
        for owner in work[:max(0, self.max_batch - decode_rows)]:
            avail += self._chunk_len(owner)
            if avail >= budget:
                return budget
        total = decode_rows + avail
        below = max((b for b in self.token_buckets if b <= total), default=0)
        if below < self.round_down or below == total or below - decode_rows < total - below:
            return budget
        return below - decode_rows

    def _chunk_len(self, owner: Request | NodeJob) -> int:
        """The tokens of a request's or node job's next prompt chunk, with no step budget."""
        seq = owner.seq
        end = owner.prefill_end if isinstance(owner, Request) else len(seq.tokens)
        return min(self.config.prefill_chunk, end - seq.computed)

    def _chunk_row(self, owner: Request | NodeJob, budget: int | None = None) -> StepRow:
        """The next prompt chunk of a request or node job: at most ``prefill_chunk`` tokens (and
        ``budget``), from its ``computed`` position."""
        seq = owner.seq
        take = self._chunk_len(owner) if budget is None else min(self._chunk_len(owner), budget)
        if isinstance(owner, Request) and owner.trace is not None:
            owner.trace.chunk(take, seq.computed)
        return owner.row(seq.tokens[seq.computed:seq.computed + take], seq.computed)

    def _apply_all(self, entries: list[tuple], res) -> list[RequestOutput]:
        """Apply each row's result of a read-back step (``_apply``)."""
        if self.kv.debug_checks:
            self.kv.check_invariants()
        outs = []
        toks = res.token_list
        s = self.config.page_size
        register = self.kv.register_full_pages
        running = RequestStatus.RUNNING
        for i, (owner, row, samples) in enumerate(entries):
            # the common row, inline: a plain request's (``Request.plain``) token after its first,
            # which neither stops nor ends it - what ``_apply`` and ``_on_token`` do for it, in
            # that order, without their per-row calls
            if samples and owner.__class__ is Request and owner.plain and owner.status is running:
                req, tok = owner, toks[i]
                out_ids, seq = req.out_ids, req.seq
                if (out_ids and req.ttft_s is not None and tok not in req.stop_ids
                        and len(out_ids) + 1 < req.sampling.max_tokens):
                    upto = row.start + len(row.tokens)
                    if upto // s > seq.first_own:  # (a page may have filled)
                        register(seq, upto)
                    out_ids.append(tok)
                    seq.tokens.append(tok)  # fed to the next decode step
                    outs.append(RequestOutput(req.id, [tok], False, prompt_tokens=len(req.prompt_tokens)))
                    continue
            outs += self._apply(owner, row.start + len(row.tokens), res, i)
        return outs

    def _apply_loop(self, entries: list[tuple], results: list) -> list[RequestOutput]:
        """Apply a decode loop's results (decode_loop.py; one ``StepResult`` per iteration): each
        row's tokens in order, through the same checks as a single step's (``_apply``), until
        its request ends or the row sampled nothing more (-1: done on the device).  One output
        per request, holding all its new tokens (and its log-probs)."""
        if self.kv.debug_checks:
            self.kv.check_invariants()
        outs = []
        for i, (req, row, _) in enumerate(entries):
            got: list[RequestOutput] = []
            for k, res in enumerate(results):
                if res.token_list[i] < 0 or req.status != RequestStatus.RUNNING:
                    break  # (a request a stop string ended had its later tokens computed for nothing)
                got += self._apply(req, row.start + k + 1, res, i)  # (its iteration k)
            failed = got.pop() if got and got[-1].error is not None else None  # (sent apart, after its tokens)
            if len(got) > 1:
                last = got[-1]
                lps = [lp for o in got for lp in o.logprobs] if last.logprobs is not None else None
                got = [RequestOutput(last.request_id, [t for o in got for t in o.new_token_ids], last.finished,
                                     last.output, logprobs=lps, prompt_tokens=last.prompt_tokens)]
            outs += got + ([failed] if failed is not None else [])
        return outs

    def _apply(self, owner: Request | NodeJob, upto: int, res, i: int) -> list[RequestOutput]:
        """Row ``i`` of a read-back step, which computed its owner's tokens up to ``upto``: its full
        pages enter the prefix cache; a node job's last chunk completes the job; a request's last
        prompt chunk or decode row gives its next token."""
        if isinstance(owner, NodeJob):
            if self.jobs.get(owner.key) is owner and owner.seq is not None and upto >= len(owner.seq.tokens):
                self._complete_job(owner)
            return []
        req = owner
        if req.status != RequestStatus.RUNNING:
            return []  # finished by the step before (this row was computed for nothing) or aborted
        self.kv.register_full_pages(req.seq, upto)
        if upto < req.prefill_end:
            return []
        if req.ttft_s is None:
            req.ttft_s = time.perf_counter() - req.arrival
            req.t_first = time.perf_counter()
        return [self._token(req, res, i)]

    def _cascade_groups(self, owners: list, rows: list[StepRow], decode_rows: int) -> list[tuple[int, list[int]]]:
        """The cascade groups of this step: (shared pages k, row indices) each, or [].

        Rows whose sequences share the same leading read-only pages (``Seq.shared_key``: a chain
        node's full pages, or prefix-cache hits) can read them once for the whole group: the
        decode rows (the first ``decode_rows``), and a prefill chunk (a request's, or a node job's
        over its parent node) that starts past its shared pages (always: those pages were computed
        before the sequence was prepared) when a decode row reads the same pages: the chunk's
        reading then rides in the shared kernel's launch for them, split beside the decode rows,
        instead of one long ragged program per query block (a served loop's mixed step; bench/NOTES.md,
        run AK), while chunks with no decode row over their pages (a lone question's TTFT, a wave of
        new requests) stay in the ragged kernel, which splits their context when the step is
        small.  Every group of >= 2 query tokens with a decode row is taken (the ``MAX_GROUPS``
        saving the most when there are more), if together they save at least
        ``CASCADE_MIN_SAVED_TOKENS`` token reads per layer: the sum of ``(query tokens - 1) x
        shared tokens``.  Below that the cascade's extra kernel and merge cost more than the reads
        they save (H200, bench/NOTES.md).  The shared kernel packs each group's query rows into row
        blocks of their own, so a group costs nothing for the rows outside it."""
        if not self.config.cascade_decode:
            return []
        s = self.config.page_size
        weight: dict[int, int] = {}  # row index -> its query tokens
        for i, owner in enumerate(owners):
            if i < decode_rows:
                weight[i] = 1
            elif owner.seq is not None and owner.seq.shared_key and (
                    rows[i].start >= len(owner.seq.shared_key) * s):
                weight[i] = len(rows[i].tokens)
        by_hash: dict[int, list[int]] = {}
        for i in weight:
            seq = owners[i].seq
            if seq.shared_key:
                by_hash.setdefault(seq.shared_hash, []).append(i)
        groups = []  # (saved pages, shared pages, members)
        for same_hash in by_hash.values():
            if sum(weight[i] for i in same_hash) < 2:
                continue
            # (hash collisions: split by the pages themselves; the keys of one node's sequences are
            # one interned tuple (KVManager.prepare), so the check is an identity test, not a hash)
            by_key: list[tuple[tuple, list[int]]] = []
            for i in same_hash:
                key = owners[i].seq.shared_key
                for known, members in by_key:
                    if key is known or key == known:
                        members.append(i)
                        break
                else:
                    by_key.append((key, [i]))
            for key, m in by_key:
                tokens = sum(weight[i] for i in m)
                if tokens >= 2 and m[0] < decode_rows:
                    groups.append(((tokens - 1) * len(key), len(key), m))
        groups.sort(key=lambda x: -x[0])
        groups = groups[:MAX_GROUPS]
        if sum(saved for saved, _, _ in groups) * s < max(1, CASCADE_MIN_SAVED_TOKENS):
            return []
        return [(k, members) for _, k, members in groups]

    # -- per token ------------------------------------------------------------------------
    def _token(self, req: Request, res, i: int) -> RequestOutput:
        """``_on_token``, failing only this request if processing its token raises."""
        try:
            return self._on_token(req, res, i)
        except Exception as err:  # noqa: BLE001 - e.g. detokenizing for a stop string
            failed: list[RequestOutput] = []
            self._fail(req, err, failed)
            return failed[0]

    def _on_token(self, req: Request, res, i: int) -> RequestOutput:
        sp = req.sampling
        tok = res.token_list[i]
        if not req.out_ids and req.trace is not None:
            req.trace.first_token()
        req.out_ids.append(tok)
        if sp.logprobs is not None:
            lp = {int(t): float(v) for t, v in zip(res.top_ids[i][:sp.logprobs], res.top_logprobs[i][:sp.logprobs])}
            lp[tok] = float(res.logprob[i])
            req.logprobs.append(lp)
        if req.stop_ids is None:
            req.stop_ids = frozenset(sp.stop_token_ids) | frozenset(() if sp.ignore_eos else self.cfg.eos_token_ids)
        n = len(req.out_ids)
        if tok in req.stop_ids and n > sp.min_tokens:  # (the device banned them before min_tokens)
            return self._finish(req, "stop", [tok])
        matcher = req.matcher
        if matcher is not None and not matcher.consume_token(tok):
            raise ValueError(f"structured output: the sampled token {tok} is outside the grammar "
                             f"({matcher.get_error() or 'no token was allowed'})")
        if sp.stop and n >= sp.min_tokens:
            # only the tail can hold a stop string that this token completed: a string of L
            # characters spans at most 4 L byte-level tokens, so decoding is O(L) per token
            window = 4 * max(len(x) for x in sp.stop) + 8
            tail = self.decode(req.out_ids[-window:], sp)
            if any(x in tail for x in sp.stop):
                text = self.decode(req.out_ids, sp)
                hits = [(text.find(x), x) for x in sp.stop if x in text]
                if hits:  # (a window cut inside a character can show a stop the full text lacks)
                    at, hit = min(hits)
                    req.text = text[:at + len(hit)] if sp.include_stop_str_in_output else text[:at]
                    return self._finish(req, "stop", [tok])
        if matcher is not None and matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self._finish(req, "stop", [tok])
        if len(req.out_ids) >= sp.max_tokens:
            return self._finish(req, "length", [tok])
        req.seq.tokens.append(tok)  # fed to the next decode step
        return RequestOutput(req.id, [tok], False, logprobs=req.logprobs[-1:] if sp.logprobs is not None else None,
                             prompt_tokens=len(req.prompt_tokens))

    def _release(self, req: Request) -> None:
        """Drop the request's pages and node readers; the last request leaving a node job
        cancels the job (its pages freed, nothing cached)."""
        job, req.job = req.job, None
        if job is not None:
            job.waiters.remove(req)
            if not job.waiters:
                self._drop_job(job)
        if req.seq is not None:
            self.kv.release(req.seq.pages)
            req.seq = None
        if req.slot >= 0:
            self.tables.remove(req.slot)
            req.slot = -1
        for node in req.nodes:
            node.readers -= 1
        req.nodes = []
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: str, new: list[int] | None = None,
                error: Exception | None = None) -> RequestOutput:
        self._release(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self.requests.pop(req.id, None)
        now = time.perf_counter()
        n = len(req.out_ids)
        dec_s = now - req.t_first if req.t_first else 0.0
        metrics = RequestMetrics(
            ttft_s=req.ttft_s or 0.0, queue_s=req.t_running - req.arrival if req.t_running else 0.0,
            prompt_tokens=len(req.prompt_tokens),
            cached_tokens=req.cached_tokens or 0, generated_tokens=n,
            decode_tokens_per_s=(n - 1) / dec_s if n > 1 and dec_s > 0 else 0.0, e2e_s=now - req.arrival)
        c = self.counters
        c["prompt_tokens"] += metrics.prompt_tokens
        c["cached_tokens"] += metrics.cached_tokens
        c["generated_tokens"] += metrics.generated_tokens
        try:
            text = req.text if req.text is not None else self.decode(req.out_ids, req.sampling)
        except Exception as err:  # noqa: BLE001 - e.g. ids the tokenizer cannot decode: this request fails
            log.error("request %s: its output could not be decoded", req.id, exc_info=err)
            text, reason, error = "", "error", error or err
            req.finish_reason = reason
        if req.trace is not None:
            req.trace.finished(reason, metrics)
        out = GenerationOutput(
            text=text, token_ids=list(req.out_ids), finish_reason=reason, metrics=metrics,
            logprobs=list(req.logprobs) if req.sampling.logprobs is not None else None, request_id=req.id,
            prompt_logprobs=req.prompt_logprobs, prompt_token_ids=req.prompt_ids)
        new = list(new or [])
        lps = req.logprobs[len(req.logprobs) - len(new):] if new and req.sampling.logprobs is not None else None
        res = RequestOutput(req.id, new, True, out, error, logprobs=lps)
        self._finished.append(res)
        return res
