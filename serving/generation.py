"""Completions and chat completions: request -> engine streams -> OpenAI JSON or SSE.

The life of a generation request:

1. **Build** (``completion_job`` / ``chat_job``): validated body -> ``Engine.submit`` keyword
   arguments (prompt text or token ids, segments, the caller's tenant, ``SamplingParams``,
   mode, a server-made request id), one set per sample (``n``; with a ``seed``, sample i uses
   ``seed + i``).  Chat renders the tokenizer's chat template to text.
2. **Admit** (``ServerState.admit``): if the tenant's queued count (its requests submitted but
   not yet producing a token: engine-waiting or in prefill) has reached
   ``max_waiting_per_tenant``, answer 429; if the server's has reached ``max_waiting``, 503;
   both with ``Retry-After``.  Counting on the server keeps the hot path free of engine round
   trips; ``engine.stats()["waiting"]`` is never larger than this count.
3. **First deltas** (``_start``): ``AsyncEngine.stream`` submits sample 0 on the engine thread;
   the handler awaits its first delta, by which time the prompt's full pages are in the prefix
   cache, and only then submits samples 1..n-1, which hit those pages (only the last, partial
   page is computed again per sample).  Every sample's first delta is awaited *before*
   answering, so every validation error (unknown segment, too long, bad sampling value) is a
   proper HTTP status, not an error inside a 200 stream.  While waiting it also watches the
   connection: a client that leaves is detected at once.
4. **Answer**: non-streaming requests collect every sample's deltas and return one JSON body,
   ``choices`` indexed 0..n-1; ``usage`` counts the prompt once and sums the samples' completion
   tokens.  Streaming requests return ``text/event-stream``: one ``data: {chunk}`` per delta in
   OpenAI's chunk format, the samples' chunks interleaved as they come and told apart by
   ``index`` (chat starts each choice with the assistant role; completions with ``echo`` start
   it with the prompt text), a chunk with ``finish_reason`` per choice, an optional usage chunk
   (``stream_options.include_usage``), then ``data: [DONE]``.  An engine failure after the
   stream started is sent as a ``data: {"error": ...}`` event before ``[DONE]``.
5. **Cancel**: if the client disconnects, the response task is cancelled, which closes every
   ``AsyncEngine.stream`` generator, which aborts the requests on the engine thread before the
   next step: their pages are freed at once.

Streamed text is each delta's ``text`` (``AsyncEngine.stream`` decodes incrementally, holding
back incomplete UTF-8 and any suffix that could start a stop string), so the concatenated
deltas equal the non-streaming text.  Log-probs (``logprobs``) come in OpenAI's shapes: completions
``{tokens, token_logprobs, top_logprobs, text_offset}``, chat ``{content: [{token, logprob,
bytes, top_logprobs}]}``; when streaming, each chunk carries those of the tokens it was made
from.  Deltas carry their tokens' log-probs when the engine sets ``RequestOutput.logprobs``;
where it does not, the chunks of a sample asked for log-probs are held until its final output,
which carries them all, and then sent in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferscale_jax.sampling import SamplingParams
from inferscale_jax.structured import StructuredOutputs
from serving import chat, response_format, tools
from serving.auth import Principal
from serving.errors import APIError, from_engine, internal_error, invalid_field
from serving.middleware import LOG_KEY
from serving.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("inferscale.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class Job:
    kind: str  # "completion" | "chat"
    id: str  # the response's id; choice i of several runs in the engine as "{id}-{i}"
    # Engine.submit keyword arguments, one per choice: prompt-major, choice = prompt x n + sample
    submits: list[dict]
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per position (None: off)
    stop: list[str]
    n: int = 1  # samples per prompt
    echo: list[str] = dataclasses.field(default_factory=list)  # per prompt (completions with echo=true)
    session: tuple | None = None  # chat with a session: (session id, tenant, chat.ChatPrompt)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    # prompt log-probs: alternatives per prompt token (None: not asked); ``echo_logprobs``: the
    # completions' echo + logprobs form (OpenAI's), else vLLM's ``prompt_logprobs`` form
    score_top: int | None = None
    echo_logprobs: bool = False
    prompt_logprobs: int | None = None
    scores: list | None = None  # per prompt: engine PromptScores (filled before generation)
    score_only: bool = False  # max_tokens == 0: the prompt's scores, no generation
    ignored: list[str] = dataclasses.field(default_factory=list)  # x-inferscale-ignored-fields
    # structured outputs: (the spec, the field that gave it), compiled before admission
    structured: tuple | None = None
    # chat tools (serving/tools.py): None (no tools / "none"), "auto", "required" or a function name
    tool_choice: str | None = None
    tool_parser: str = "hermes"

    @property
    def num_prompts(self) -> int:
        return len(self.submits) // self.n

    def echo_of(self, choice: int) -> str:
        return self.echo[choice // self.n] if self.echo else ""

    def headers(self) -> dict[str, str]:
        h = {"X-Request-Id": self.id}
        if self.ignored:
            h["x-inferscale-ignored-fields"] = ",".join(self.ignored)
        return h


def _check_model(state, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise APIError(404, f"model {model!r} does not exist; this server serves {' / '.join(map(repr, state.model_names))} "
                       "(GET /v1/models)", "model_not_found", "model")


def _sampling(req, max_tokens: int, logprobs: int | None, seed: int | None,
              structured: StructuredOutputs | None = None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=seed, stop=list(req.stop or []),
                              stop_token_ids=list(req.stop_token_ids), logprobs=logprobs,
                              ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                              min_p=req.min_p, min_tokens=req.min_tokens, logit_bias=req.logit_bias_ids(),
                              bad_words=list(req.bad_words), skip_special_tokens=req.skip_special_tokens,
                              spaces_between_special_tokens=req.spaces_between_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              truncate_prompt_tokens=req.truncate_prompt_tokens, structured_outputs=structured)
    except ValueError as e:
        raise from_engine(e) from None


def _job(state, kind: str, req, principal: Principal, prompts: list[dict], max_tokens: int, logprobs,
         echo: list[str] | None = None, structured: tuple | None = None) -> Job:
    """One submit per prompt and sample; ``max_tokens == 0`` (completions with echo or
    prompt_logprobs) still builds them, as the scoring requests' arguments.  ``structured``:
    (StructuredOutputs, the field that gave it) or None."""
    _check_model(state, req.model)
    if req.seed is not None and req.seed + req.n - 1 >= 2**63:
        raise invalid_field(f"seed={req.seed} is too large for n={req.n}: sample i uses seed + i, which must stay "
                            f"below 2**63; send a seed <= {2**63 - req.n}", "seed")
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    many = len(prompts) * req.n > 1
    submits = []
    for p, prompt in enumerate(prompts):
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            choice = p * req.n + i
            submits.append(dict(prompt, segments=list(req.segments), tenant=principal.tenant, mode=req.mode,
                                sampling=_sampling(req, max(max_tokens, 1), logprobs, seed,
                                                   structured[0] if structured else None),
                                request_id=f"{rid}-{choice}" if many else rid))
    job = Job(kind, rid, submits, req.stream, req.include_usage, logprobs, list(req.stop or []), n=req.n,
              echo=echo or [], continuous_usage=req.continuous_usage, prompt_logprobs=req.prompt_logprobs,
              score_only=max_tokens == 0, ignored=req.ignored_fields(), structured=structured)
    echo_lp = kind == "completion" and req.echo and logprobs is not None
    if echo_lp or req.prompt_logprobs is not None:
        job.echo_logprobs = echo_lp
        job.score_top = max(logprobs if echo_lp else 0, req.prompt_logprobs or 0)
    return job


def _echo_ids(state, ids: list[int]) -> str:
    """The text of a token-id prompt to echo; ids outside the vocabulary are the client's 400
    (checked here: the tokenizer would raise on them before the engine could)."""
    vocab = state.engine.cfg.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt holds token id {bad} outside [0, {vocab}) (the model's vocab size)",
                       "invalid_field", "prompt")
    return state.decode(ids)


def completion_job(state, req: CompletionRequest, principal: Principal) -> Job:
    prompts, echo = [], []
    for p in req.prompts:
        if isinstance(p, str):
            prompts.append(dict(prompt=p))
            echo.append(p)
        else:
            prompts.append(dict(prompt_token_ids=p))
            echo.append(_echo_ids(state, p) if req.echo else "")
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    for field in ("tools", "tool_choice"):
        if getattr(req, field) not in (None, [], "none"):
            raise invalid_field(f"{field} is a chat field: send it to /v1/chat/completions", field)
    so, field = response_format.spec(req)
    return _job(state, "completion", req, principal, prompts, max_tokens, req.logprobs, echo if req.echo else None,
                structured=(so, field) if so is not None else None)


async def chat_job(state, req: ChatCompletionRequest, principal: Principal) -> Job:
    """Segments placed inside the messages and the session (``chat.py``) become the submits' chain
    items, prompt ids and ``session``."""
    chat.require_template(state.tokenizer, state.chat_template)
    tool_list, choice = tools.check(req.tools, req.tool_choice)
    so, field = response_format.spec(req)
    forced = tools.grammar(tool_list, choice, req.parallel_tool_calls)
    if forced is not None:
        if so is not None:
            raise invalid_field(f"tool_choice={req.tool_choice!r} constrains the output and so does {field}: send one "
                                "of them", field)
        so, field = forced, "tool_choice"
    prompt = await chat.build(state.tokenizer, req, _tokenizer(state), state.engine.bos_prefix, state.chat_template,
                              tool_list if choice is not None else None)
    max_tokens = req.max_completion_tokens or req.max_tokens or state.default_max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    job = _job(state, "chat", req, principal, [dict(prompt_token_ids=prompt.prompt_token_ids, session=req.session)],
               max_tokens, logprobs, structured=(so, field) if so is not None else None)
    job.tool_choice, job.tool_parser = choice, state.tool_parser
    for sub in job.submits:
        sub["segments"] = list(prompt.segments)
    if req.session is not None:
        job.session = (req.session, principal.tenant, prompt)
    return job


def _tokenizer(state):
    async def tokenize(text: str) -> list[int]:
        try:
            return await state.async_engine.tokenize(text)
        except Exception as e:  # noqa: BLE001 - surfaced as the request's error
            raise from_engine(e) from None
    return tokenize


async def save_session(state, job: Job, outs: list) -> None:
    """After the reply (sample 0's): the conversation so far becomes the session's next version
    (``chat.py``).  A failure is logged, not raised: the reply itself is complete and valid."""
    if job.session is None or outs[0] is None:
        return
    sid, tenant, prompt = job.session
    try:
        items, tail = await chat.save_items(state.tokenizer, prompt, outs[0].text, _tokenizer(state),
                                            state.engine.bos_prefix, state.chat_template)
        await state.rpc("save_session", sid, token_ids=tail, segments=items, tenant=tenant)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("request %s: session %r was not saved: %s", job.id, sid, e)


class _Watch:
    """While a block runs, a side task reads the request's ``receive`` and cancels this task when
    the client disconnects (``gone`` is then true): the block itself runs in this task, so a
    result it awaits reaches the response's bytes with no hand-off between tasks (each hand-off
    waits behind every stream the event loop woke in the same step: ~20 ms at 256 streams on the
    CPU machine, bench/NOTES.md, "The first token's hand-offs").  ``__exit__`` takes back its own
    cancellation (``Task.uncancel``) and swallows the ``CancelledError`` only when nothing else
    cancelled the task: a cancellation from elsewhere (shutdown) propagates, and one already under
    way when the client leaves is not interrupted by a second.  A ``receive`` that fails counts as
    the client gone."""

    def __init__(self, receive):
        self.receive, self.gone, self.task, self.watcher, self.base = receive, False, None, None, 0

    async def _watch(self) -> None:
        try:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - no way to hear from the client: it is gone
            pass
        if self.task.cancelling() > self.base:
            return  # (already being cancelled from elsewhere: that cancellation runs its course)
        self.gone = True
        self.task.cancel()

    def __enter__(self) -> "_Watch":
        self.task = asyncio.current_task()
        self.base = self.task.cancelling()
        self.watcher = asyncio.ensure_future(self._watch())
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self.watcher.cancel()
        if not self.gone:
            return False
        others = self.task.uncancel() > self.base  # (ours is always taken back)
        return not others and kind is not None and issubclass(kind, asyncio.CancelledError)


async def _until_disconnect(request: Request, awaitable):
    """Await ``awaitable`` in this task unless the client disconnects first (then it is
    cancelled and the answer is ``None``)."""
    with _Watch(request.receive):
        return await awaitable
    return None  # (the client left: _Watch swallowed its cancellation)


class _EventStream(StreamingResponse):
    """``text/event-stream`` whose body is sent from the handler's own task (``_Watch``), not from a
    task of its own as Starlette's ``StreamingResponse`` does under ASGI 2.3 (uvicorn's): the
    first chunk, already in hand, is written without waiting for the event loop's other work."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            with _Watch(receive):
                await self.stream_response(send)
        finally:  # a disconnect that cut a ``send`` short leaves the body at a ``yield``: its
            await self.body_iterator.aclose()  # ``finally`` (close the streams: abort) runs now
        if self.background is not None:
            await self.background()


async def _all(awaitables):
    """Their results, in order; the first failure (or this task's cancellation) cancels the rest
    and waits for them, so no stream is still being read when its caller closes it.  A lone one
    is awaited in this task (no hand-off to a task of its own: ``_Watch``)."""
    awaitables = list(awaitables)
    if len(awaitables) == 1:
        return [await awaitables[0]]
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_GONE = object()


async def _start(state, job: Job, streams: list) -> list:
    """Step 3: submit each prompt's first sample and await their first deltas, then the other
    samples and theirs.  ``streams`` (one slot per choice, None until opened) receives each stream
    as it is opened, so the caller can close them all."""
    leaders = list(range(0, len(job.submits), job.n))
    for i in leaders:
        streams[i] = state.async_engine.stream(**job.submits[i])
    firsts: list = [None] * len(job.submits)
    for i, f in zip(leaders, await _all(_first(streams[i]) for i in leaders)):
        firsts[i] = f
    if any(firsts[i] is _GONE for i in leaders) or job.n == 1:
        return firsts
    rest = [i for i in range(len(job.submits)) if i % job.n]
    for i in rest:
        streams[i] = state.async_engine.stream(**job.submits[i])
    tenant = job.submits[0]["tenant"]
    state.pending += len(rest)  # (admitted with the job: counted, never refused)
    state.pending_by_tenant[tenant] += len(rest)
    try:
        for i, f in zip(rest, await _all(_first(streams[i]) for i in rest)):
            firsts[i] = f
    finally:
        state.release(len(rest), tenant)
    return firsts


async def _scores(state, job: Job) -> list:
    """Each prompt's log-probs (``Engine.prompt_logprobs``, on the engine thread)."""
    out = []
    for p in range(job.num_prompts):
        sub = job.submits[p * job.n]
        prompt = {k: sub[k] for k in ("prompt", "prompt_token_ids") if k in sub}
        out.append(await state.rpc(
            "prompt_logprobs", **prompt, segments=sub["segments"], tenant=sub["tenant"],
            num_logprobs=job.score_top, truncate_prompt_tokens=sub["sampling"].truncate_prompt_tokens))
    return out


async def _close(streams: list) -> None:
    for s in streams:
        if s is not None:
            await s.aclose()


async def run_job(state, request: Request, job: Job) -> Response:
    """Steps 2-5 of the module docstring."""
    fields = request.scope.get(LOG_KEY, {})
    fields.update(id=job.id, segments=[s for s in job.submits[0]["segments"] if isinstance(s, str)],
                  mode=job.submits[0]["mode"], stream=job.stream)
    if len(job.submits) > 1:
        fields["n"] = len(job.submits)
    if job.structured is not None:  # a 400 before it is queued (serving/response_format.py)
        await response_format.check(state, *job.structured)
    admitted, tenant = job.num_prompts, job.submits[0]["tenant"]
    state.admit(admitted, tenant)
    streams: list = [None] * len(job.submits)
    firsts = None
    try:
        if job.score_top is not None:
            job.scores = await _until_disconnect(request, _scores(state, job))
            if job.scores is None:
                return Response(status_code=499)  # the client left
        if job.score_only:
            return _scored_response(state, job, fields)
        firsts = await _until_disconnect(request, _start(state, job, streams))
    except Exception as e:
        raise _api_error(e, job) from None
    finally:
        state.release(admitted, tenant)
        if firsts is None or _GONE in firsts:
            await _close(streams)
    if firsts is None:
        return Response(status_code=499)  # the client left; nobody reads this
    if _GONE in firsts:
        raise internal_error(job.id)
    state.note_started(len(firsts))
    if not job.stream:
        outs = await _until_disconnect(request, _all(_collect(state, job, s, f) for s, f in zip(streams, firsts)))
        if outs is None:
            return Response(status_code=499)
        _record(state, fields, outs)
        await save_session(state, job, outs)
        return JSONResponse(_full_response(state, job, outs), headers=job.headers())
    return _EventStream(_sse(state, job, streams, firsts, fields), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.headers()})


def _scored_response(state, job: Job, fields: dict) -> Response:
    """``max_tokens == 0``: every choice is its prompt's echo and log-probs, nothing generated."""
    fields.update(prompt_tokens=sum(s.num_tokens for s in job.scores), generated_tokens=0)
    usage = {"prompt_tokens": sum(s.num_tokens for s in job.scores), "completion_tokens": 0,
             "total_tokens": sum(s.num_tokens for s in job.scores), "prompt_tokens_details": {"cached_tokens": 0}}
    choices = []
    for c in range(len(job.submits)):
        choice = {"index": c, "text": job.echo_of(c), "logprobs": None, "finish_reason": "length"}
        choice.update(_prompt_fields(state, job, c))
        choices.append(choice)
    created = int(time.time())
    if not job.stream:
        return JSONResponse({"id": job.id, "object": "text_completion", "created": created,
                             "model": state.model_name, "choices": choices, "usage": usage}, headers=job.headers())

    async def events():
        for choice in choices:
            body = {"id": job.id, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [choice]}
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        if job.include_usage:
            body = {"id": job.id, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.headers()})


async def _first(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _GONE


async def _collect(state, job, stream, first):
    delta, last_t = first, time.perf_counter()
    try:
        while not delta.finished:
            delta = await stream.__anext__()
            now = time.perf_counter()
            if delta.new_token_ids:
                state.metrics.inter_token.observe((now - last_t) / len(delta.new_token_ids))
            last_t = now
    except Exception as e:
        raise _api_error(e, job) from None
    finally:
        await stream.aclose()
    return delta.output


def _api_error(e: Exception, job: Job) -> APIError:
    err = from_engine(e)
    if err.status == 500:
        log.error("request %s failed", job.id, exc_info=e)
        err = internal_error(job.id)
    return err


def _record(state, fields: dict, outs: list) -> None:
    for out in outs:
        state.metrics.observe_finished(out.metrics)
    m = outs[0].metrics
    fields.update(prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens,
                  generated_tokens=sum(o.metrics.generated_tokens for o in outs), ttft_s=round(m.ttft_s, 6),
                  queue_s=round(m.queue_s, 6),
                  finish_reason=outs[0].finish_reason if len(outs) == 1 else [o.finish_reason for o in outs])


def _usage(job: Job, outs: list) -> dict:
    """Each prompt once (its first sample's counts: that sample computed the prompt), every
    sample's generated tokens."""
    firsts = [outs[p * job.n].metrics for p in range(job.num_prompts)]
    prompt = sum(m.prompt_tokens for m in firsts)
    completion = sum(o.metrics.generated_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.cached_tokens for m in firsts)}}


def _token_str(state, tid: int) -> str:
    return state.decode([tid])


def _top(lp: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])[:n]


def _logprobs(state, job: Job, token_ids: list[int], lps: list, offset: int = 0):
    """OpenAI's log-probs object for these tokens; ``offset``: where their text starts
    (completions).  An entry of ``lps`` may be None (a prompt's first token): null there."""
    n = job.logprobs or 0
    pairs = list(zip(token_ids, lps))
    if job.kind == "chat":
        content = []
        for tid, lp in pairs:
            s = _token_str(state, tid)
            content.append({"token": s, "logprob": lp[tid], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (t := _token_str(state, i)), "logprob": v,
                                              "bytes": list(t.encode())} for i, v in _top(lp, n)]})
        return {"content": content}
    tokens, offsets, pos = [], [], offset
    for tid, _ in pairs:
        s = _token_str(state, tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp[tid] for tid, lp in pairs],
            "top_logprobs": [None if lp is None else {_token_str(state, i): v for i, v in _top(lp, n)}
                             for _, lp in pairs],
            "text_offset": offsets}


def _echo_logprobs(state, job: Job, choice: int) -> dict:
    """Completions with echo and logprobs: the prompt's tokens' log-probs (OpenAI's shape)."""
    score = job.scores[choice // job.n]
    return _logprobs(state, job, score.token_ids, score.logprobs)


def _vllm_prompt_logprobs(state, job: Job, p: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, null (the first) or ``{id: {logprob, rank,
    decoded_token}}`` holding the token and the top ``prompt_logprobs`` alternatives."""
    score = job.scores[p]
    out = []
    for tid, lp, rank in zip(score.token_ids, score.logprobs, score.ranks):
        if lp is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": lp[tid], "rank": rank, "decoded_token": _token_str(state, tid)}}
        for r, (i, v) in enumerate(_top(lp, job.prompt_logprobs), start=1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": _token_str(state, i)})
        out.append(entry)
    return out


def _prompt_fields(state, job: Job, choice: int) -> dict:
    """The prompt log-prob parts of a completions choice (echo's log-probs, vLLM's prompt_logprobs)."""
    out = {}
    if job.scores is not None and job.echo_logprobs:
        out["logprobs"] = _echo_logprobs(state, job, choice)
    if job.scores is not None and job.prompt_logprobs is not None and job.kind == "completion":
        out["prompt_logprobs"] = _vllm_prompt_logprobs(state, job, choice // job.n)
    return out


def _join_logprobs(head: dict | None, tail: dict | None) -> dict | None:
    """Completions: the prompt's log-probs object followed by the generated tokens' (offsets go on)."""
    if head is None or tail is None:
        return head or tail
    shift = sum(len(t) for t in head["tokens"])
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]]}


def _full_response(state, job: Job, outs: list) -> dict:
    choices = []
    for i, out in enumerate(outs):
        lp = None
        echo = job.echo_of(i)
        if job.logprobs is not None and out.logprobs is not None:
            lp = _logprobs(state, job, out.token_ids, out.logprobs, 0 if job.echo_logprobs else len(echo))
        if job.kind == "chat":
            msg, calls = tools.message(out.text, job.tool_choice, job.tool_parser)
            choices.append({"index": i, "message": msg, "logprobs": lp,
                            "finish_reason": tools.finish_reason(out.finish_reason, job.tool_choice, calls)})
        else:
            extra = _prompt_fields(state, job, i)
            if "logprobs" in extra:
                extra["logprobs"] = _join_logprobs(extra["logprobs"], lp)
            choices.append({"index": i, "text": echo + out.text, "logprobs": lp,
                            "finish_reason": out.finish_reason, **extra})
    obj = "chat.completion" if job.kind == "chat" else "text_completion"
    body = {"id": job.id, "object": obj, "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": _usage(job, outs)}
    if job.kind == "chat" and job.scores is not None and job.prompt_logprobs is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(state, job, 0)
    return body


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _chunk(state, job: Job, created: int, index: int, text: str | None, finish: str | None,
           role: bool = False, logprobs: dict | None = None, usage: dict | None = None,
           extra: dict | None = None, tool_calls: list | None = None) -> str:
    if text and not (role or finish or logprobs or usage or extra or tool_calls):  # the per-token chunk: no dict, one dumps
        field = '"delta": {"content": %s}' if job.kind == "chat" else '"text": %s'
        return (f'data: {{"id": "{job.id}", "object": "{_chunk_object(job)}", "created": {created}, '
                f'"model": {json.dumps(state.model_name, ensure_ascii=False)}, "choices": [{{"index": {index}, '
                f'{field % json.dumps(text, ensure_ascii=False)}, "logprobs": null, "finish_reason": null}}]}}\n\n')
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    choice.update(extra or {})
    body = {"id": job.id, "object": _chunk_object(job), "created": created, "model": state.model_name,
            "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Choice:
    """One choice's streaming state: its log-prob position, the chunks held for log-probs, and
    its token counts (``stream_options.continuous_usage_stats``)."""

    def __init__(self, state, job: Job, index: int):
        self.state, self.job, self.index = state, job, index
        self.n_tokens = 0  # generated tokens seen so far
        self.prompt_tokens = 0  # the request's sequence, from its first delta
        self.offset = len(job.echo_of(index))  # text_offset of the next token (completions' log-probs)
        if job.echo_logprobs and job.scores is not None:
            self.offset = sum(len(t) for t in _echo_logprobs(state, job, index)["tokens"])
        self.held: list[tuple[str, list[int]]] = []  # chunks waiting for their log-probs
        # chat with tools: which text is content and which is tool calls (serving/tools.py)
        self.tools = tools.Stream(job.tool_choice, job.tool_parser) if job.tool_choice is not None else None

    def usage(self) -> dict | None:
        if not self.job.continuous_usage:
            return None
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.n_tokens,
                "total_tokens": self.prompt_tokens + self.n_tokens}

    def opening(self, created: int) -> list[str]:
        """The chunk before any token: chat's role; completions' echo (with its log-probs)."""
        job = self.job
        if job.kind == "chat":
            return [_chunk(self.state, job, created, self.index, None, None, role=True)]
        extra = _prompt_fields(self.state, job, self.index)
        lp = extra.pop("logprobs", None)
        if job.echo_of(self.index) or lp is not None or extra:
            return [_chunk(self.state, job, created, self.index, job.echo_of(self.index), None, logprobs=lp,
                           extra=extra)]
        return []

    def _lp(self, ids: list[int], lps) -> dict | None:
        if self.job.logprobs is None or not ids:
            return None
        obj = _logprobs(self.state, self.job, ids, lps, self.offset)
        self.offset += sum(len(t) for t in obj.get("tokens", ()))
        return obj

    def _content(self, created: int, piece: str, logprobs: dict | None) -> list[str]:
        calls = None
        if self.tools is not None:
            piece, calls = self.tools.feed(piece)
        if not piece and logprobs is None and not calls:
            return []
        return [_chunk(self.state, self.job, created, self.index, piece, None, logprobs=logprobs,
                       usage=self.usage(), tool_calls=calls)]

    def chunks(self, created: int, delta) -> list[str]:
        """The chunks for one delta: its text (``delta.text``, AsyncEngine's incremental
        detokenization) with its tokens' log-probs, and the finish chunk after the last one."""
        job, ids, piece = self.job, list(delta.new_token_ids), delta.text
        self.n_tokens += len(ids)
        if getattr(delta, "prompt_tokens", 0):
            self.prompt_tokens = delta.prompt_tokens
        if delta.finished and delta.output is not None:
            self.prompt_tokens = delta.output.metrics.prompt_tokens
        out: list[str] = []
        if job.logprobs is None:
            out += self._content(created, piece, None)
        else:
            lps = getattr(delta, "logprobs", None)  # RequestOutput.logprobs where the engine sets it
            if lps is None or self.held:
                self.held.append((piece, ids))
            else:
                out += self._content(created, piece, self._lp(ids, lps))
        if delta.finished:
            result = delta.output
            if self.held:  # the final output holds every position's log-probs
                all_lps = result.logprobs or []
                pos = self.n_tokens - sum(len(held_ids) for _, held_ids in self.held)
                for held_piece, held_ids in self.held:
                    lp = self._lp(held_ids, all_lps[pos:pos + len(held_ids)]) if all_lps else None
                    pos += len(held_ids)
                    out += self._content(created, held_piece, lp)
                self.held = []
            reason = result.finish_reason
            if self.tools is not None:
                piece, calls = self.tools.end()
                if piece or calls:
                    out.append(_chunk(self.state, job, created, self.index, piece, None, tool_calls=calls))
                reason = tools.finish_reason(reason, job.tool_choice, self.tools.has_calls)
            out.append(_chunk(self.state, job, created, self.index, None, reason, usage=self.usage()))
        return out


async def _next_delta(state, stream, last_t: float) -> tuple:
    """The stream's next delta and when it came, its gap from ``last_t`` counted per token."""
    delta = await stream.__anext__()
    now = time.perf_counter()
    if delta.new_token_ids:
        state.metrics.inter_token.observe((now - last_t) / len(delta.new_token_ids))
    return delta, now


async def _sse(state, job: Job, streams: list, firsts: list, fields: dict):
    created = int(time.time())
    choices = [_Choice(state, job, i) for i in range(len(streams))]
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int) -> None:
        """Choice i's deltas into the shared queue (an exception ends the whole stream)."""
        delta, last_t = firsts[i], time.perf_counter()
        try:
            while True:
                await queue.put((i, delta))
                if delta.finished:
                    return
                delta, last_t = await _next_delta(state, streams[i], last_t)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band by the reader below
            await queue.put((i, e))

    # one choice (n = 1, the common request): its deltas are read here, without a pump task and the
    # queue's hand-off: 0.2-0.3 ms less to the first chunk on the CPU machine (bench/NOTES.md, session 24)
    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))] if len(streams) > 1 else []
    single_first, last_t = not pumps, time.perf_counter()
    outs: list = [None] * len(streams)
    try:
        for c in choices:
            for chunk in c.opening(created):
                yield chunk
        if job.kind == "chat" and job.scores is not None and job.prompt_logprobs is not None:
            body = {"id": job.id, "object": _chunk_object(job), "created": created, "model": state.model_name,
                    "choices": [], "prompt_logprobs": _vllm_prompt_logprobs(state, job, 0)}
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        while any(o is None for o in outs):
            if pumps:
                i, item = await queue.get()
            elif single_first:
                i, item, single_first = 0, firsts[0], False
            else:
                i = 0
                try:
                    item, last_t = await _next_delta(state, streams[0], last_t)
                except Exception as e:  # noqa: BLE001 - raised below, as a pump's is
                    item = e
            if isinstance(item, Exception):
                raise item
            for chunk in choices[i].chunks(created, item):
                yield chunk
            if item.finished:
                outs[i] = item.output
        _record(state, fields, outs)
        await save_session(state, job, outs)
        if job.include_usage:
            usage = {"id": job.id, "object": _chunk_object(job), "created": created, "model": state.model_name,
                     "choices": [], "usage": _usage(job, outs)}
            yield f"data: {json.dumps(usage)}\n\n"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
        err = _api_error(e, job)
        fields.update(error=err.code)
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await _close(streams)
    yield "data: [DONE]\n\n"
