"""``AsyncEngine``: the engine on one background thread, driven from asyncio.

The ``Engine`` is single-threaded by design (its page pool, prefix cache and scheduler are
plain Python state).  ``AsyncEngine`` owns it from one thread, the *engine loop*:

1. run every queued command (submit, abort, register/delete/list segments, stats, snapshot),
   each a function executed on the loop thread; its result or exception is handed back to
   the awaiting coroutine through a ``concurrent.futures.Future``;
2. if any request is unfinished, run one ``engine.step()`` and push each ``RequestOutput`` to
   its request's asyncio queue: one ``loop.call_soon_threadsafe`` per step for all of them (a
   wake-up of the event loop per stream and step was 256 per step at 256 streams);
3. otherwise sleep until the next command arrives (and take a periodic snapshot when due).

So request handlers never block the event loop on device work, and every HTTP request is
continuously batched with the others.  Prompt and segment *text* is tokenized before the
command is queued, on a small worker pool with private tokenizer copies, so a huge prompt
delays only itself, never the engine loop.  ``stream()`` yields a request's deltas as they are
produced, each with its ``text`` (incremental detokenization, ``detokenize.py``: never a split
UTF-8 character, never the start of a stop string the engine may cut); leaving it early
(client disconnect, ``break``, task cancellation) aborts the request on the loop thread before
the next step, which frees its pages at once.

Failures: the engine contains a request's own failure (that request's stream raises its error,
the others go on) and an unexpected step error (the running requests get ``EngineFault``, the
engine checks its page accounting and goes on).  A lost device sets ``engine.fault``: every
open stream and every later call raises that ``EngineFault``, ``fatal`` holds it, and the
``on_fatal`` callback (the server's: shut down and exit non-zero) is called once, so a broken
engine never half-serves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable

from inferscale_jax.detokenize import Deltas, IncrementalDetokenizer, StreamQueue, put_in_order
from inferscale_jax.errors import EngineFault
from inferscale_jax.outputs import GenerationOutput
from inferscale_jax.request import RequestOutput
from inferscale_jax.tokenizer import INLINE_ENCODE_CHARS, encode_text

log = logging.getLogger("inferscale.async")


def _private_copy(tokenizer):
    """A tokenizer of one's own (HF fast tokenizers are not safe to share across threads)."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - an uncopyable tokenizer is shared (encode/decode are read-only)
        return tokenizer


class AsyncEngine:
    def __init__(self, engine, *, on_fatal: Callable[[EngineFault], None] | None = None,
                 tokenizer_threads: int = 2):
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal: EngineFault | None = None
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, StreamQueue]] = {}
        tok = getattr(engine, "tokenizer", None)
        self._detok_tokenizer = _private_copy(tok) if tok is not None else None  # event-loop side
        self._local = threading.local()  # each tokenizer thread's own copy
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="inferscale-tok")
        self.warming: tuple[int, int] | None = None  # (buckets done, total) while ``warmup`` runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inferscale-engine", daemon=True)
        self._thread.start()

    def start_warmup(self, first_runs: str = "idle") -> None:
        """Run ``Engine.warmup`` on the engine thread, first in line; ``warming`` holds its
        progress until it is done (``/health`` answers 503 "warming up" meanwhile).  Requests
        submitted during the warm-up wait behind it.  ``first_runs`` (``Engine.warmup``'s):
        "idle" (``serve``'s default) leaves each bucket's first run to the loop's idle time after the
        warm-up, "now" makes them in it (a longer warm-up; no step under load pays one)."""
        from inferscale_jax.engine import check_first_runs

        check_first_runs(first_runs)  # (here, in the caller's thread: not on the engine thread)
        self.warming = (0, 0)

        def progress(done: int, total: int) -> None:
            self.warming = (done, total)

        def run() -> None:
            try:
                info = self.engine.warmup(progress=progress, first_runs=first_runs)
                log.info("warm-up done: %d step buckets in %.1f s", info["buckets"], info["seconds"])
            finally:
                self.warming = None
        self._cmds.put((run, None))

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.fatal is None and self.engine.has_unfinished()
            # the warm-up's first runs left for idle time (Engine.warm_idle): one bucket, then commands
            idle_runs = not busy and self.warming is None and self.engine.warm_idle()
            try:
                fn, fut = self._cmds.get(block=not (busy or idle_runs), timeout=0.05)
            except queue.Empty:
                fn = fut = None
            if fn is not None:
                self._run_command(fn, fut)
                while True:  # drain the rest before the next device step
                    try:
                        fn, fut = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._run_command(fn, fut)
            try:
                self.engine.maybe_snapshot()  # periodic snapshot when due (runs in the background)
            except Exception:  # noqa: BLE001 - a failed snapshot must not stop serving
                log.exception("periodic snapshot failed")
            if self.fatal is None and self.engine.has_unfinished():
                try:
                    outs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - the engine contains the rest (module docstring)
                    self._on_step_error(e)
                    continue
                self._deliver_all([(out.request_id, out.error if out.error is not None else out) for out in outs])

    def _on_step_error(self, e: Exception) -> None:
        fault = getattr(self.engine, "fault", None)
        if fault is None:  # not a lost engine: fail what was in flight and keep serving
            log.exception("engine step failed")
            self._fail_all(e)
            return
        log.critical("the engine stopped serving: %s", fault)
        self.fatal = fault
        if self.on_fatal is not None:  # before the streams learn of it: whoever reads their errors
            try:                       # sees the server already stopping
                self.on_fatal(fault)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal callback failed")
        self._fail_all(fault)

    def _run_command(self, fn: Callable, fut: concurrent.futures.Future | None) -> None:
        if fut is not None and not fut.set_running_or_notify_cancel():
            return  # the caller was cancelled before the command ran: skip it
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            if fut is not None:
                fut.set_exception(e)
            else:
                log.warning("background command failed: %r", e)
            return
        if fut is not None:
            fut.set_result(result)

    def _deliver(self, request_id: str, item: Any) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop per step (not
        one per stream), whose callback fills every queue."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is None:
                continue
            loop, q = target
            if isinstance(item, BaseException) or getattr(item, "finished", False):
                self._streams.pop(request_id, None)
            by_loop.setdefault(loop, []).append((q, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(put_in_order, batch)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step")
            self._deliver(rid, error)

    # -- calls from asyncio ---------------------------------------------------------------
    async def call(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the engine thread and await its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((lambda: fn(*args, **kwargs), fut))
        return await asyncio.wrap_future(fut)

    async def rpc(self, name: str, *args, **kwargs):
        """A named engine call (``engine_rpc.RPCS``) on the engine thread: the server's way to
        the engine, the same over the engine core process (``serving/core_client.py``)."""
        from inferscale_jax.engine_rpc import run_rpc

        return await self.call(run_rpc, self.engine, name, args, kwargs)

    def process_info(self) -> dict:
        """``/v1/stats``' process layout: the engine runs in this process, on a thread."""
        import os

        return {"engine_process": {"pid": os.getpid(), "in_process": True},
                "api_processes": [{"pid": os.getpid(), "index": 0}]}

    def _encode(self, text: str) -> list[int]:
        """On a tokenizer thread, with that thread's own copy of the tokenizer."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = _private_copy(self.engine.tokenizer)
        return encode_text(tok, text)

    async def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids (as the engine encodes it): a short text on the event loop, a long one on a
        tokenizer thread (``INLINE_ENCODE_CHARS``); never on the engine loop."""
        if not isinstance(text, str) or getattr(self.engine, "tokenizer", None) is None:
            raise ValueError("text needs a model with a tokenizer; pass token ids instead")
        if len(text) <= INLINE_ENCODE_CHARS:  # here, with the loop's own copy (tokenizer.py)
            return encode_text(self._detok_tokenizer, text)
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, self._encode, text)

    async def _pretokenized(self, request: dict, field: str, ids_field: str) -> dict:
        text = request.get(field)
        if not isinstance(text, str) or getattr(self.engine, "tokenizer", None) is None \
                or request.get(ids_field) is not None:
            return request  # the engine gives the usual error for anything else
        rest = {k: v for k, v in request.items() if k != field}
        return {**rest, ids_field: await self.tokenize(text)}

    async def stream(self, **request) -> AsyncIterator[RequestOutput]:
        """Submit a request (``Engine.submit``'s keyword arguments) and yield its deltas, each
        with the ``text`` its ids add; the last one has ``finished=True`` and the final
        ``GenerationOutput`` (the deltas' texts concatenate to its ``text``)."""
        if self.fatal is not None:
            raise self.fatal
        loop = asyncio.get_running_loop()
        q = StreamQueue()
        request = await self._pretokenized(request, "prompt", "prompt_token_ids")
        sampling = request.get("sampling")
        detok = IncrementalDetokenizer(self._detok_tokenizer, getattr(sampling, "stop", None) or (), sampling)

        def submit():
            rid = self.engine.submit(**request)
            self._streams[rid] = (loop, q)  # before the next step can produce output
            return rid

        try:
            rid = await self.call(submit)
        except asyncio.CancelledError:
            rid = request.get("request_id")
            if rid is not None:  # the submit may have run already: abort it (commands run in order)
                self._cmds.put((lambda: (self._streams.pop(rid, None), self.engine.abort(rid)), None))
            raise
        deltas = Deltas(q, detok)
        try:
            async for item in deltas:
                yield item
        finally:
            if not deltas.done:  # disconnect / cancel: free the pages before the next step
                self._streams.pop(rid, None)
                self._cmds.put((lambda: self.engine.abort(rid), None))

    async def generate(self, **request) -> GenerationOutput:
        out = None
        async for delta in self.stream(**request):
            out = delta.output
        return out

    async def register_segment(self, *args, **kwargs):
        """``Engine.register_segment``; its ``text`` is tokenized off the engine loop."""
        kwargs = await self._pretokenized(kwargs, "text", "token_ids")
        return await self.call(self.engine.register_segment, *args, **kwargs)

    async def update_segment(self, *args, **kwargs):
        """``Engine.update_segment``; its ``text`` is tokenized off the engine loop."""
        kwargs = await self._pretokenized(kwargs, "text", "token_ids")
        return await self.call(self.engine.update_segment, *args, **kwargs)

    async def append_segment(self, *args, **kwargs):
        """``Engine.append_segment``; its ``text`` is tokenized off the engine loop."""
        kwargs = await self._pretokenized(kwargs, "text", "token_ids")
        return await self.call(self.engine.append_segment, *args, **kwargs)

    async def delete_segment(self, *args, **kwargs):
        return await self.call(self.engine.delete_segment, *args, **kwargs)

    async def list_segments(self, *args, **kwargs):
        return await self.call(self.engine.list_segments, *args, **kwargs)

    async def stats(self) -> dict:
        return await self.call(self.engine.stats)

    @property
    def stopped(self) -> bool:
        """Whether the engine loop thread has ended (after ``shutdown``)."""
        return not self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step; wait up to ``timeout`` s (``stopped`` tells)."""
        self._stop.set()
        self._thread.join(timeout)
        self._tok_pool.shutdown(wait=False, cancel_futures=True)
