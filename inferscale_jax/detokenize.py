"""Incremental detokenization: text deltas for a stream of generated token ids.

Decoding the whole output at every token is O(n^2); decoding each token alone breaks words
(SentencePiece's leading spaces) and UTF-8 characters split over byte-level tokens.  So, as
vLLM does, each ``push`` decodes only a short window: the ids from ``prefix`` (a few tokens
already emitted, for context) to the end, and emits what that window's text adds over the
text of ``ids[prefix:read]`` (the part already emitted).  A window whose text ends in U+FFFD
(an incomplete UTF-8 character) emits nothing until the character completes.

Stop strings: the engine cuts the final text at the first stop string, so a streamed delta
must never contain a stop string's first characters that might be cut later.  The text that
could still start a stop string (its longest suffix that is a proper prefix of one) is held
back; ``finish(final_text)`` emits the rest of the engine's final text, so the concatenated
deltas always equal ``GenerationOutput.text``.
"""

from __future__ import annotations

import asyncio
import logging

from inferscale_jax.tokenizer import decode_ids

log = logging.getLogger("inferscale.detokenize")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), sampling=None):
        """``sampling``: the request's ``SamplingParams`` (its special-token options), or None."""
        self.tokenizer, self.stop, self.sampling = tokenizer, list(stop), sampling
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the context window already turned into text
        self.read = 0
        self.text = ""  # all text decoded so far (emitted + held back)
        self.sent = 0  # characters of ``text`` emitted

    def push(self, new_ids: list[int]) -> str:
        """Add generated ids; return the text they make safe to emit ("" if none yet)."""
        if self.tokenizer is None or not new_ids:
            return ""
        self.ids += new_ids
        before = decode_ids(self.tokenizer, self.ids[self.prefix:self.read], self.sampling)
        after = decode_ids(self.tokenizer, self.ids[self.prefix:], self.sampling)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._emit()

    def _emit(self) -> str:
        safe = len(self.text)
        for s in self.stop:  # hold back a suffix that may be the start of a stop string
            for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's whole output text) after what was emitted."""
        emitted = self.text[:self.sent]
        if not final_text.startswith(emitted):
            log.warning("streamed text diverged from the final text; sending nothing more")
            return ""
        self.text, self.sent = final_text, len(final_text)
        return final_text[len(emitted):]


class StreamQueue(asyncio.Queue):
    """A stream's queue of outputs; ``started``: whether an output was put on it yet.

    A step's outputs wake their streams in the order they are put, and each wake-up is the
    consumer's SSE chunk on the one event loop, so the deliverers (``AsyncEngine``, the API server's
    ``CoreClient``) put a stream's first and last output before the step's other tokens: a first
    token is the request's TTFT, and a last one ends the response (a closed-loop client sends its
    next request then), while a middle token only waits for the rest of its step's chunks."""

    started = False

    def urgent(self, item) -> bool:
        """Whether ``item`` (an output or an exception) goes before a step's plain middle tokens;
        marks the queue started."""
        first, self.started = not self.started, True
        return first or isinstance(item, BaseException) or item.finished


def put_in_order(pairs: list) -> None:
    """On the event loop: each (``StreamQueue``, output or exception) of a step onto its queue,
    the urgent ones (``StreamQueue.urgent``) first, then the rest; a queue's own items keep their
    order (one held back holds back the ones after it)."""
    later, held = [], set()
    for q, item in pairs:
        if q.urgent(item) and q not in held:
            q.put_nowait(item)
        else:
            later.append((q, item))
            held.add(q)
    for q, item in later:
        q.put_nowait(item)


class Deltas:
    """A stream's outputs as they arrive on its queue, each with its ``text`` (``detok``), until
    the finished one; an exception put on the queue is raised.  ``done`` says whether the stream
    ended (finished or failed), so a caller leaving early knows to abort the request.  The one
    delta loop of ``AsyncEngine.stream`` and of the API server's ``CoreClient.stream``.

    A consumer that falls behind (the engine's steps come faster than it reads: 256 streams in one
    API process) gets every output already waiting merged into one delta - the ids in order, their
    log-probs, the last one's end - so it catches up with one chunk instead of one per token, as
    vLLM's output collector does; a consumer that keeps up gets one delta per engine step.  An
    exception waiting behind outputs is raised on the next read, after them."""

    def __init__(self, queue, detok: IncrementalDetokenizer):
        self.queue, self.detok, self.done = queue, detok, False
        self._error: BaseException | None = None  # read behind merged outputs: raised next

    def __aiter__(self) -> "Deltas":
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        if self._error is not None:
            self.done = True
            raise self._error
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        waiting = []
        while not item.finished and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._error = nxt
                break
            waiting.append(nxt)
            if nxt.finished:
                break
        if waiting:
            item = merge_outputs(item, waiting)
        # each output object is this stream's alone: its text is set in place (no copy per token)
        item.text = (self.detok.finish(item.output.text) if item.finished and item.output is not None
                     else self.detok.push(item.new_token_ids))
        self.done = item.finished
        return item


def merge_outputs(first, rest: list):
    """``first`` (a ``RequestOutput``, this stream's own) extended in place by the outputs after it:
    their ids and log-probs appended (log-probs None when any of them has none: the API server then
    takes them from the final output), the last one's end (``finished``, ``output``, ``error``)."""
    ids, lps = list(first.new_token_ids), first.logprobs
    lps = None if lps is None else list(lps)
    for o in rest:
        ids.extend(o.new_token_ids)
        if lps is not None and o.logprobs is not None:
            lps.extend(o.logprobs)
        else:
            lps = None
        first.prompt_tokens = o.prompt_tokens or first.prompt_tokens
    last = rest[-1]
    first.new_token_ids, first.logprobs = ids, lps
    first.finished, first.output, first.error = last.finished, last.output, last.error
    return first
