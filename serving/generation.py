"""Completions and chat completions: request -> engine stream -> OpenAI JSON or SSE.

The life of a generation request:

1. **Build** (``completion_job`` / ``chat_job``): validated body -> ``Engine.submit`` keyword
   arguments (prompt text or token ids, segments, the caller's tenant, ``SamplingParams``,
   mode, a server-made request id).  Chat renders the tokenizer's chat template to text.
2. **Admit** (``ServerState.admit``): if the server's queued count (its requests submitted but
   not yet producing a token: engine-waiting or in prefill) has reached ``max_waiting``, answer
   503 with ``Retry-After``.  Counting on the server keeps the hot path free of engine round
   trips; ``engine.stats()["waiting"]`` is never larger than this count.
3. **First delta**: ``AsyncEngine.stream`` submits on the engine thread and yields deltas.  The
   handler awaits the first one *before* answering, so every validation error (unknown segment,
   too long, bad sampling value) is a proper HTTP status, not an error inside a 200 stream.
   While waiting it also watches the connection: a client that leaves is detected at once.
4. **Answer**: non-streaming requests collect every delta and return one JSON body.  Streaming
   requests return ``text/event-stream``: one ``data: {chunk}`` per delta in OpenAI's chunk
   format (chat starts with the assistant role), a last chunk with ``finish_reason``, an optional
   usage chunk (``stream_options.include_usage``), then ``data: [DONE]``.  An engine failure
   after the stream started is sent as a ``data: {"error": ...}`` event before ``[DONE]``.
5. **Cancel**: if the client disconnects, the response task is cancelled, which closes the
   ``AsyncEngine.stream`` generator, which aborts the request on the engine thread before its
   next step: its pages are freed at once.

Streamed text is decoded incrementally (``TextStream``): trailing incomplete UTF-8 and any
suffix that could start a stop string are held back, so the concatenated deltas equal the
non-streaming text.  ``logprobs`` are reported for non-streaming requests only (the engine's
deltas carry token ids, its final output carries log-probs); with ``stream=true`` they are a 422.
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
from serving.auth import Principal
from serving.errors import APIError, from_engine, internal_error
from serving.middleware import LOG_KEY
from serving.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("inferscale.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class Job:
    kind: str  # "completion" | "chat"
    submit: dict
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per position (None: off)
    stop: list[str]


class TextStream:
    """Incremental detokenization with hold-back (module docstring)."""

    def __init__(self, decode, stop: list[str]):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.sent = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        text = self.decode(self.ids)
        safe = len(text)
        while safe and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k:safe] == s[:k]:
                    safe -= k
                    break
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):safe]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.sent):
            log.warning("streamed text diverged from the final text; sending nothing more")
            return ""
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta


def _check_model(state, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r} "
                       "(GET /v1/models)", "model_not_found", "model")


def _sampling(req, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=req.seed, stop=list(req.stop or []),
                              stop_token_ids=list(req.stop_token_ids), logprobs=logprobs,
                              ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise from_engine(e) from None


def _job(state, kind: str, req, principal: Principal, prompt: dict, max_tokens: int, logprobs) -> Job:
    _check_model(state, req.model)
    if req.stream and logprobs is not None:
        raise APIError(422, "logprobs are returned for stream=false only; drop logprobs or stream=false",
                       "invalid_field", "logprobs")
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    submit = dict(prompt, segments=list(req.segments), tenant=principal.tenant, mode=req.mode,
                  sampling=_sampling(req, max_tokens, logprobs), request_id=rid)
    return Job(kind, submit, req.stream, req.include_usage, logprobs, list(req.stop or []))


def completion_job(state, req: CompletionRequest, principal: Principal) -> Job:
    prompt = dict(prompt=req.prompt) if isinstance(req.prompt, str) else dict(prompt_token_ids=req.prompt)
    max_tokens = req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    return _job(state, "completion", req, principal, prompt, max_tokens, req.logprobs)


def chat_job(state, req: ChatCompletionRequest, principal: Principal) -> Job:
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template, so chat messages cannot be "
                       "formatted; use /v1/completions with your own prompt format", "no_chat_template")
    try:
        text = tok.apply_chat_template(req.template_messages(), tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are the client's
        raise APIError(400, f"the chat template rejected the messages: {e}", "invalid_messages",
                       "messages") from None
    max_tokens = req.max_completion_tokens or req.max_tokens or state.default_max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _job(state, "chat", req, principal, dict(prompt=text), max_tokens, logprobs)


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


_GONE = object()


async def run_job(state, request: Request, job: Job) -> Response:
    """Steps 2-5 of the module docstring."""
    fields = request.scope.get(LOG_KEY, {})
    fields.update(id=job.submit["request_id"], segments=job.submit["segments"], mode=job.submit["mode"],
                  stream=job.stream)
    state.admit()
    stream = state.async_engine.stream(**job.submit)
    first = None
    try:
        first = await _until_disconnect(request, _first(stream))
    except Exception as e:
        raise _api_error(e, job) from None
    finally:
        state.pending -= 1
        if first is None:
            await stream.aclose()
    if first is None:
        return Response(status_code=499)  # the client left; nobody reads this
    if first is _GONE:
        raise internal_error(job.submit["request_id"])
    if not job.stream:
        out = await _until_disconnect(request, _collect(state, job, stream, first))
        if out is None:
            return Response(status_code=499)
        _record(state, fields, out)
        return JSONResponse(_full_response(state, job, out))
    return StreamingResponse(_sse(state, job, stream, first, fields), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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
        log.error("request %s failed", job.submit["request_id"], exc_info=e)
        err = internal_error(job.submit["request_id"])
    return err


def _record(state, fields: dict, out) -> None:
    m = out.metrics
    state.metrics.observe_finished(m)
    fields.update(prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens,
                  generated_tokens=m.generated_tokens, ttft_s=round(m.ttft_s, 6),
                  finish_reason=out.finish_reason)


def _usage(out) -> dict:
    m = out.metrics
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.generated_tokens,
            "total_tokens": m.prompt_tokens + m.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}


def _token_str(state, tid: int) -> str:
    return state.decode([tid])


def _logprobs(state, job: Job, out):
    if job.logprobs is None or out.logprobs is None:
        return None
    n = job.logprobs
    pairs = list(zip(out.token_ids, out.logprobs))
    if job.kind == "chat":
        content = []
        for tid, lp in pairs:
            s = _token_str(state, tid)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:n]
            content.append({"token": s, "logprob": lp[tid], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (t := _token_str(state, i)), "logprob": v,
                                              "bytes": list(t.encode())} for i, v in top]})
        return {"content": content}
    tokens, offsets, pos = [], [], 0
    for tid, _ in pairs:
        s = _token_str(state, tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [lp[tid] for tid, lp in pairs],
            "top_logprobs": [{_token_str(state, i): v for i, v in sorted(lp.items(), key=lambda kv: -kv[1])[:n]}
                             for _, lp in pairs],
            "text_offset": offsets}


def _full_response(state, job: Job, out) -> dict:
    rid, created = job.submit["request_id"], int(time.time())
    lp = _logprobs(state, job, out)
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                  "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice],
            "usage": _usage(out)}


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _chunk(state, job: Job, created: int, text: str | None, finish: str | None, role: bool = False) -> str:
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    body = {"id": job.submit["request_id"], "object": _chunk_object(job), "created": created,
            "model": state.model_name, "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _sse(state, job: Job, stream, first, fields: dict):
    created = int(time.time())
    text = TextStream(state.decode, job.stop)
    delta, last_t = first, time.perf_counter()
    try:
        if job.kind == "chat":
            yield _chunk(state, job, created, None, None, role=True)
        while True:
            if delta.finished:
                out = delta.output
                rest = text.finish(out.text)
                if rest:
                    yield _chunk(state, job, created, rest, None)
                yield _chunk(state, job, created, None, out.finish_reason)
                _record(state, fields, out)
                if job.include_usage:
                    usage = {"id": job.submit["request_id"], "object": _chunk_object(job), "created": created,
                             "model": state.model_name, "choices": [], "usage": _usage(out)}
                    yield f"data: {json.dumps(usage)}\n\n"
                break
            piece = text.push(delta.new_token_ids)
            if piece:
                yield _chunk(state, job, created, piece, None)
            delta = await stream.__anext__()
            now = time.perf_counter()
            if delta.new_token_ids:
                state.metrics.inter_token.observe((now - last_t) / len(delta.new_token_ids))
            last_t = now
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
        err = _api_error(e, job)
        fields.update(error=err.code)
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
