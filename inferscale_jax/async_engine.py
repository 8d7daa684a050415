"""``AsyncEngine``: the engine on one background thread, driven from asyncio.

The ``Engine`` is single-threaded by design (its page pool, prefix cache and scheduler are
plain Python state).  ``AsyncEngine`` owns it from one thread, the *engine loop*:

1. run every queued command (submit, abort, register/delete/list segments, stats, snapshot),
   each a function executed on the loop thread; its result or exception is handed back to
   the awaiting coroutine through a ``concurrent.futures.Future``;
2. if any request is unfinished, run one ``engine.step()`` and push each ``RequestOutput`` to
   its request's asyncio queue (``loop.call_soon_threadsafe``);
3. otherwise sleep until the next command arrives (and take a periodic snapshot when due).

So request handlers never block the event loop on device work, and every HTTP request is
continuously batched with the others.  ``stream()`` yields a request's deltas as they are
produced; leaving it early (client disconnect, ``break``, task cancellation) aborts the request
on the loop thread before the next step, which frees its pages at once.  An exception inside
``engine.step()`` (a bug, not bad input: input is validated at submit) fails the requests in
flight with that error and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable

from inferscale_jax.outputs import GenerationOutput
from inferscale_jax.scheduler import RequestOutput

log = logging.getLogger("inferscale.async")


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inferscale-engine", daemon=True)
        self._thread.start()

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            try:
                fn, fut = self._cmds.get(block=not busy, timeout=0.05)
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
            if self.engine.has_unfinished():
                try:
                    outs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                for out in outs:
                    self._deliver(out.request_id, out.error if out.error is not None else out)

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
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        if isinstance(item, BaseException) or getattr(item, "finished", False):
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, item)

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

    async def stream(self, **request) -> AsyncIterator[RequestOutput]:
        """Submit a request (``Engine.submit``'s keyword arguments) and yield its deltas; the
        last one has ``finished=True`` and the final ``GenerationOutput``."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

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
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # disconnect / cancel: free the pages before the next step
                self._streams.pop(rid, None)
                self._cmds.put((lambda: self.engine.abort(rid), None))

    async def generate(self, **request) -> GenerationOutput:
        out = None
        async for delta in self.stream(**request):
            out = delta.output
        return out

    async def register_segment(self, *args, **kwargs):
        return await self.call(self.engine.register_segment, *args, **kwargs)

    async def delete_segment(self, *args, **kwargs):
        return await self.call(self.engine.delete_segment, *args, **kwargs)

    async def list_segments(self, *args, **kwargs):
        return await self.call(self.engine.list_segments, *args, **kwargs)

    async def stats(self) -> dict:
        return await self.call(self.engine.stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
