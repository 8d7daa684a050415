"""Completions and chat completions: request -> engine streams -> OpenAI JSON or SSE.

The life of a generation request:

1. **Build** (``completion_job`` / ``chat_job``): validated body -> ``Engine.submit`` keyword
   arguments (prompt text or token ids, segments, the caller's tenant, ``SamplingParams``,
   mode, a server-made request id), one set per sample (``n``; with a ``seed``, sample i uses
   ``seed + i``).  Chat renders the tokenizer's chat template to text.
2. **Admit** (``ServerState.admit``): if the server's queued count (its requests submitted but
   not yet producing a token: engine-waiting or in prefill) has reached ``max_waiting``, answer
   503 with ``Retry-After``.  Counting on the server keeps the hot path free of engine round
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
from serving import chat
from serving.auth import Principal
from serving.errors import APIError, from_engine, internal_error, invalid_field
from serving.middleware import LOG_KEY
from serving.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("inferscale.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class Job:
    kind: str  # "completion" | "chat"
    id: str  # the response's id; sample i of n > 1 runs in the engine as "{id}-{i}"
    submits: list[dict]  # Engine.submit keyword arguments, one per sample (n)
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per position (None: off)
    stop: list[str]
    echo: str = ""  # completions with echo=true: the prompt text, put before each choice's text
    session: tuple | None = None  # chat with a session: (session id, tenant, chat.ChatPrompt)


def _check_model(state, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r} "
                       "(GET /v1/models)", "model_not_found", "model")


def _sampling(req, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=seed, stop=list(req.stop or []),
                              stop_token_ids=list(req.stop_token_ids), logprobs=logprobs,
                              ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty)
    except ValueError as e:
        raise from_engine(e) from None


def _job(state, kind: str, req, principal: Principal, prompt: dict, max_tokens: int, logprobs,
         echo: str = "") -> Job:
    _check_model(state, req.model)
    if req.seed is not None and req.seed + req.n - 1 >= 2**63:
        raise invalid_field(f"seed={req.seed} is too large for n={req.n}: sample i uses seed + i, which must stay "
                            f"below 2**63; send a seed <= {2**63 - req.n}", "seed")
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    submits = []
    for i in range(req.n):
        seed = None if req.seed is None else req.seed + i
        submits.append(dict(prompt, segments=list(req.segments), tenant=principal.tenant, mode=req.mode,
                            sampling=_sampling(req, max_tokens, logprobs, seed),
                            request_id=rid if req.n == 1 else f"{rid}-{i}"))
    return Job(kind, rid, submits, req.stream, req.include_usage, logprobs, list(req.stop or []), echo)


def _echo_ids(state, req: CompletionRequest) -> str:
    """The text of a token-id prompt to echo; ids outside the vocabulary are the client's 400
    (checked here: the tokenizer would raise on them before the engine could)."""
    vocab = state.engine.cfg.vocab_size
    bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt holds token id {bad} outside [0, {vocab}) (the model's vocab size)",
                       "invalid_field", "prompt")
    return state.decode(req.prompt)


def completion_job(state, req: CompletionRequest, principal: Principal) -> Job:
    if isinstance(req.prompt, str):
        prompt, echo = dict(prompt=req.prompt), req.prompt
    else:
        prompt, echo = dict(prompt_token_ids=req.prompt), _echo_ids(state, req) if req.echo else ""
    max_tokens = req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    return _job(state, "completion", req, principal, prompt, max_tokens, req.logprobs, echo if req.echo else "")


async def chat_job(state, req: ChatCompletionRequest, principal: Principal) -> Job:
    """Segments placed inside the messages and the session (``chat.py``) become the submits' chain
    items, prompt ids and ``session``."""
    chat.require_template(state.tokenizer)
    prompt = await chat.build(state.tokenizer, req, _tokenizer(state), state.engine.bos_prefix)
    max_tokens = req.max_completion_tokens or req.max_tokens or state.default_max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    job = _job(state, "chat", req, principal, dict(prompt_token_ids=prompt.prompt_token_ids, session=req.session),
               max_tokens, logprobs)
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
                                            state.engine.bos_prefix)
        await state.async_engine.call(state.engine.save_session, sid, token_ids=tail, segments=items, tenant=tenant)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("request %s: session %r was not saved: %s", job.id, sid, e)


async def _until_disconnect(request: Request, awaitable):
    """Await ``awaitable`` unless the client disconnects first (then cancel it, return ``None``)."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler is cancelled (shutdown): take the work down with it
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone either way
        pass
    return None


async def _all(awaitables):
    """Their results, in order; the first failure (or this task's cancellation) cancels the rest
    and waits for them, so no stream is still being read when its caller closes it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_GONE = object()


async def _start(state, job: Job, streams: list) -> list:
    """Step 3: submit sample 0 and await its first delta, then the other samples and theirs.
    ``streams`` receives each stream as it is opened, so the caller can close them all."""
    streams.append(state.async_engine.stream(**job.submits[0]))
    first = await _first(streams[0])
    if first is _GONE or len(job.submits) == 1:
        return [first]
    rest = [state.async_engine.stream(**sub) for sub in job.submits[1:]]
    streams.extend(rest)
    state.pending += len(rest)
    try:
        return [first, *await _all(_first(s) for s in rest)]
    finally:
        state.pending -= len(rest)


async def _close(streams: list) -> None:
    for s in streams:
        await s.aclose()


async def run_job(state, request: Request, job: Job) -> Response:
    """Steps 2-5 of the module docstring."""
    fields = request.scope.get(LOG_KEY, {})
    fields.update(id=job.id, segments=[s for s in job.submits[0]["segments"] if isinstance(s, str)],
                  mode=job.submits[0]["mode"], stream=job.stream)
    if len(job.submits) > 1:
        fields["n"] = len(job.submits)
    state.admit()
    streams: list = []
    firsts = None
    try:
        firsts = await _until_disconnect(request, _start(state, job, streams))
    except Exception as e:
        raise _api_error(e, job) from None
    finally:
        state.pending -= 1
        if firsts is None or _GONE in firsts or len(firsts) < len(job.submits):
            await _close(streams)
    if firsts is None:
        return Response(status_code=499)  # the client left; nobody reads this
    if _GONE in firsts:
        raise internal_error(job.id)
    if not job.stream:
        outs = await _until_disconnect(request, _all(_collect(state, job, s, f) for s, f in zip(streams, firsts)))
        if outs is None:
            return Response(status_code=499)
        _record(state, fields, outs)
        await save_session(state, job, outs)
        return JSONResponse(_full_response(state, job, outs), headers={"X-Request-Id": job.id})
    return StreamingResponse(_sse(state, job, streams, firsts, fields), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": job.id})


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
                  finish_reason=outs[0].finish_reason if len(outs) == 1 else [o.finish_reason for o in outs])


def _usage(outs: list) -> dict:
    """The prompt once (sample 0's cached count: it computed the prompt), every sample's tokens."""
    m = outs[0].metrics
    completion = sum(o.metrics.generated_tokens for o in outs)
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": completion,
            "total_tokens": m.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}


def _token_str(state, tid: int) -> str:
    return state.decode([tid])


def _logprobs(state, job: Job, token_ids: list[int], lps: list[dict[int, float]], offset: int = 0):
    """OpenAI's log-probs object for these tokens; ``offset``: where their text starts (completions)."""
    n = job.logprobs
    pairs = list(zip(token_ids, lps))
    if job.kind == "chat":
        content = []
        for tid, lp in pairs:
            s = _token_str(state, tid)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:n]
            content.append({"token": s, "logprob": lp[tid], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (t := _token_str(state, i)), "logprob": v,
                                              "bytes": list(t.encode())} for i, v in top]})
        return {"content": content}
    tokens, offsets, pos = [], [], offset
    for tid, _ in pairs:
        s = _token_str(state, tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [lp[tid] for tid, lp in pairs],
            "top_logprobs": [{_token_str(state, i): v for i, v in sorted(lp.items(), key=lambda kv: -kv[1])[:n]}
                             for _, lp in pairs],
            "text_offset": offsets}


def _full_response(state, job: Job, outs: list) -> dict:
    choices = []
    for i, out in enumerate(outs):
        lp = None
        if job.logprobs is not None and out.logprobs is not None:
            lp = _logprobs(state, job, out.token_ids, out.logprobs)
        if job.kind == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                            "finish_reason": out.finish_reason})
        else:
            choices.append({"index": i, "text": job.echo + out.text, "logprobs": lp,
                            "finish_reason": out.finish_reason})
    obj = "chat.completion" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": _usage(outs)}


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _chunk(state, job: Job, created: int, index: int, text: str | None, finish: str | None,
           role: bool = False, logprobs: dict | None = None) -> str:
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    body = {"id": job.id, "object": _chunk_object(job), "created": created, "model": state.model_name,
            "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Choice:
    """One sample's streaming state: its log-prob position and the chunks held for log-probs."""

    def __init__(self, state, job: Job, index: int):
        self.state, self.job, self.index = state, job, index
        self.n_tokens = 0  # generated tokens seen so far
        self.offset = len(job.echo)  # text_offset of the next token (completions' log-probs)
        self.held: list[tuple[str, list[int]]] = []  # chunks waiting for their log-probs

    def _lp(self, ids: list[int], lps) -> dict | None:
        if self.job.logprobs is None or not ids:
            return None
        obj = _logprobs(self.state, self.job, ids, lps, self.offset)
        self.offset += sum(len(t) for t in obj.get("tokens", ()))
        return obj

    def _content(self, created: int, piece: str, logprobs: dict | None) -> list[str]:
        if not piece and logprobs is None:
            return []
        return [_chunk(self.state, self.job, created, self.index, piece, None, logprobs=logprobs)]

    def chunks(self, created: int, delta) -> list[str]:
        """The chunks for one delta: its text (``delta.text``, AsyncEngine's incremental
        detokenization) with its tokens' log-probs, and the finish chunk after the last one."""
        job, ids, piece = self.job, list(delta.new_token_ids), delta.text
        self.n_tokens += len(ids)
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
            out.append(_chunk(self.state, job, created, self.index, None, result.finish_reason))
        return out


async def _sse(state, job: Job, streams: list, firsts: list, fields: dict):
    created = int(time.time())
    choices = [_Choice(state, job, i) for i in range(len(streams))]
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int) -> None:
        """Sample i's deltas into the shared queue (an exception ends the whole stream)."""
        delta, last_t = firsts[i], time.perf_counter()
        try:
            while True:
                await queue.put((i, delta))
                if delta.finished:
                    return
                delta = await streams[i].__anext__()
                now = time.perf_counter()
                if delta.new_token_ids:
                    state.metrics.inter_token.observe((now - last_t) / len(delta.new_token_ids))
                last_t = now
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band by the reader below
            await queue.put((i, e))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    outs: list = [None] * len(streams)
    try:
        for c in choices:
            if job.kind == "chat":
                yield _chunk(state, job, created, c.index, None, None, role=True)
            elif job.echo:
                yield _chunk(state, job, created, c.index, job.echo, None)
        while any(o is None for o in outs):
            i, item = await queue.get()
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
                     "choices": [], "usage": _usage(outs)}
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
