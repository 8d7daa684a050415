"""``CoreClient``: an API-server process's handle on the engine core process (``inferscale_jax/engine_core.py``).

It has the surface ``serving/app.py`` uses of an ``AsyncEngine`` (``stream``, ``rpc``,
``register_segment`` / ``update_segment`` / ``append_segment``, ``tokenize``, ``fatal``,
``warming``, ``start_warmup``, ``shutdown``, ``stopped``, and ``engine``: the model config,
tokenizer, BOS prefix and pool sizes the core sent when it was ready), so ``create_app`` serves
either.  Tokenization and detokenization happen here, in the API process; the core sees token ids.

Threads: one I/O thread owns the ZMQ DEALER socket.  It forwards what the event loop sends
(through an ``inproc`` PUSH/PULL pair: ZMQ sockets are not shared across threads), decodes what
the core sends, and checks every ``LIVENESS_S`` that the core process is alive.  A ``step``
message (one per engine step, every stream of this server in it) is handed to the event loop
with one ``call_soon_threadsafe``; there each entry becomes a ``RequestOutput`` on its stream's
queue.  RPC replies complete a ``concurrent.futures.Future``.

The life of a request here:

1. ``stream(**submit_kwargs)``: the prompt text is tokenized on a worker thread (a private
   tokenizer copy), the stream's queue is registered under its request id (one is made when
   missing), and ``submit`` is sent.
2. Each entry for it becomes a delta whose ``text`` comes from its ``IncrementalDetokenizer``
   (the final one's from the engine's final text, stop strings cut there), exactly as
   ``AsyncEngine.stream`` yields them; an entry with an error raises it.
3. Leaving the stream early sends ``abort``.

Failures: a ``fatal`` message (the engine lost its device), or the core process ending, sets
``fatal`` (an ``EngineFault``), fails every open stream and pending call with it (so every SSE
stream ends with an error event, never a hang), makes ``/health`` answer 503, and calls
``on_fatal`` once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import types
import uuid
from typing import AsyncIterator, Callable

from inferscale_jax import engine_core
from inferscale_jax.async_engine import _private_copy
from inferscale_jax.detokenize import Deltas, IncrementalDetokenizer, StreamQueue, put_in_order
from inferscale_jax.errors import EngineFault
from inferscale_jax.tokenizer import INLINE_ENCODE_CHARS, encode_text

log = logging.getLogger("inferscale.server")
LIVENESS_S = 0.1  # how often the I/O thread checks that the core process lives


class CoreClient:
    def __init__(self, address: str, alive: Callable[[], bool], *, index: int = 0,
                 on_fatal: Callable[[EngineFault], None] | None = None, exitcode: Callable[[], int | None] = None,
                 tokenizer_threads: int = 2, ready_timeout: float | None = None):
        """Connect to the core at ``address`` and wait until it is ready (its engine built).
        ``alive()``: whether the core process lives; ``index``: this API server's number (0
        leads the shutdown).  Raises the core's own error if it could not build its engine."""
        import zmq

        from inferscale_jax.request import RequestOutput

        self._RequestOutput = RequestOutput
        self.address, self.alive, self.index = address, alive, index
        self.exitcode = exitcode or (lambda: None)
        self.on_fatal = on_fatal
        self.fatal: EngineFault | None = None
        self.core_exited = False  # fatal because the core process ended (not a fault it reported)
        self._closing = False  # shutdown asked: the core's end is expected
        self.warming: tuple[int, int] | None = None
        self.meta: dict | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._streams: dict[str, StreamQueue] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._enc = engine_core.encoder()
        self._ctx = zmq.Context()
        self._wake = f"inproc://core-client-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._wake)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self._wake)
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._io, name=f"inferscale-core-io-{index}", daemon=True)
        self._thread.start()
        self._send(["hello", os.getpid(), index])
        if not self._ready.wait(ready_timeout):
            self.close()
            raise TimeoutError(f"the engine core did not become ready within {ready_timeout} s")
        if self._startup_error is not None:
            self.close()
            raise self._startup_error
        meta = self.meta
        self.core_pid = meta["pid"]
        self.engine = types.SimpleNamespace(cfg=meta["cfg"], tokenizer=meta["tokenizer"],
                                            bos_prefix=meta["bos_prefix"], max_batch=meta["max_batch"])
        if "num_pages" in meta:
            self.engine.pool = types.SimpleNamespace(num_pages=meta["num_pages"])
            self.engine.config = types.SimpleNamespace(page_size=meta["page_size"])
        tok = meta["tokenizer"]
        self._detok_tokenizer = _private_copy(tok) if tok is not None else None
        self._local = threading.local()
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="inferscale-tok")

    # -- the I/O thread -------------------------------------------------------------------
    def _send(self, msg: list) -> None:
        frame = self._enc.encode(msg)
        with self._push_lock:
            self._push.send(frame)

    def _io(self) -> None:
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        dealer.connect(self.address)
        dec = engine_core.decoder()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(LIVENESS_S * 1000)))
                if self._pull in events:
                    while True:
                        try:
                            dealer.send(self._pull.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if dealer in events:
                    while True:
                        try:
                            frame = dealer.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._on_message(dec.decode(frame))
                        except Exception:  # noqa: BLE001 - one bad message must not stop the thread
                            log.exception("bad message from the engine core")
                if self.fatal is None and not self._closing and not self.alive():
                    code = self.exitcode()
                    self._set_fatal(EngineFault(f"the engine core process exited (code {code}); the server "
                                                "stops serving"), lost=True)
        finally:
            dealer.close(linger=500)

    def _on_message(self, msg: list) -> None:
        kind = msg[0]
        if kind == "step":
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._on_step, msg[1])
        elif kind == "reply":
            fut = self._calls.pop(msg[1], None)
            if fut is not None and not fut.done():
                (fut.set_result if msg[2] else fut.set_exception)(msg[3])
        elif kind == "warming":
            self.warming = (msg[1], msg[2])
        elif kind == "warm":
            self.warming = None
        elif kind == "ready":
            self.meta = msg[1]
            self._ready.set()
        elif kind == "fatal":
            if not self._ready.is_set():
                self._startup_error = msg[1]
                self._ready.set()
            else:
                self._set_fatal(msg[1] if isinstance(msg[1], EngineFault) else EngineFault(str(msg[1])))
        elif kind == "closed":
            pass

    def _set_fatal(self, fault: EngineFault, lost: bool = False) -> None:
        if self.fatal is not None:
            return
        if not self._ready.is_set():
            self._startup_error = RuntimeError(f"the engine core process exited (code {self.exitcode()}) "
                                               "before it was ready; its error is above")
            self._ready.set()
            return
        self.fatal = fault
        self.warming = None
        if lost:
            self.core_exited = True
            log.critical("%s", fault)
        if self.on_fatal is not None:
            try:
                self.on_fatal(fault)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal callback failed")
        for call_id in list(self._calls):
            fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(fault)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all, fault)

    # -- on the event loop ----------------------------------------------------------------
    def _on_step(self, entries: list) -> None:
        """On the event loop: a step's entries onto their streams' queues, streams' first and last
        outputs before the step's middle tokens (``StreamQueue``)."""
        make = self._RequestOutput
        pairs = []
        for rid, new_ids, logprobs, prompt_tokens, finished, output, error in entries:
            q = self._streams.get(rid)
            if q is None:
                continue
            if finished:
                self._streams.pop(rid, None)
            pairs.append((q, error if error is not None else make(rid, new_ids, finished, output=output,
                                                                  logprobs=logprobs, prompt_tokens=prompt_tokens)))
        put_in_order(pairs)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(error)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
        return loop

    async def rpc(self, name: str, *args, **kwargs):
        """A named engine call (``inferscale_jax/engine_rpc.py``) run by the core between steps."""
        self._bind_loop()
        if self.fatal is not None:
            raise self.fatal
        call_id = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = fut
        self._send(["call", call_id, name, engine_core.ext((args, kwargs))])
        try:
            return await asyncio.wrap_future(fut)
        finally:
            self._calls.pop(call_id, None)

    async def call(self, fn, *args, **kwargs):
        raise TypeError("the engine runs in its own process: use rpc(name, ...) (inferscale_jax/engine_rpc.py)")

    def _encode(self, text: str) -> list[int]:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = _private_copy(self.engine.tokenizer)
        return encode_text(tok, text)

    async def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids (as the engine encodes it): a short text on the event loop, a long one on a
        tokenizer thread of this process (``INLINE_ENCODE_CHARS``)."""
        if not isinstance(text, str) or self.engine.tokenizer is None:
            raise ValueError("text needs a model with a tokenizer; pass token ids instead")
        if len(text) <= INLINE_ENCODE_CHARS:  # here, with the loop's own copy (tokenizer.py)
            return encode_text(self._detok_tokenizer, text)
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, self._encode, text)

    async def _pretokenized(self, request: dict, field: str, ids_field: str) -> dict:
        text = request.get(field)
        if not isinstance(text, str) or self.engine.tokenizer is None or request.get(ids_field) is not None:
            return request
        rest = {k: v for k, v in request.items() if k != field}
        return {**rest, ids_field: await self.tokenize(text)}

    async def stream(self, **request) -> AsyncIterator:
        """``AsyncEngine.stream``'s contract, over the core process (module docstring, 1-3)."""
        self._bind_loop()
        if self.fatal is not None:
            raise self.fatal
        request = await self._pretokenized(request, "prompt", "prompt_token_ids")
        rid = request.get("request_id") or f"req-{uuid.uuid4().hex}"
        request["request_id"] = rid
        sampling = request.get("sampling")
        detok = IncrementalDetokenizer(self._detok_tokenizer, getattr(sampling, "stop", None) or (), sampling)
        if rid in self._streams:  # the engine's own check; the open stream keeps its queue
            raise ValueError(f"request_id={rid!r} is already in use")
        q = StreamQueue()
        self._streams[rid] = q
        if self.fatal is not None:  # it may have been set while tokenizing
            self._streams.pop(rid, None)
            raise self.fatal
        self._send(["submit", engine_core.pack_submit(request)])
        deltas = Deltas(q, detok)
        try:
            async for item in deltas:
                yield item
        finally:
            if not deltas.done:
                self._streams.pop(rid, None)
                if self.fatal is None:
                    self._send(["abort", rid])

    async def generate(self, **request):
        out = None
        async for delta in self.stream(**request):
            out = delta.output
        return out

    async def register_segment(self, *args, **kwargs):
        kwargs = await self._pretokenized(kwargs, "text", "token_ids")
        return await self.rpc("register_segment", *args, **kwargs)

    async def update_segment(self, *args, **kwargs):
        kwargs = await self._pretokenized(kwargs, "text", "token_ids")
        return await self.rpc("update_segment", *args, **kwargs)

    async def append_segment(self, *args, **kwargs):
        kwargs = await self._pretokenized(kwargs, "text", "token_ids")
        return await self.rpc("append_segment", *args, **kwargs)

    async def stats(self) -> dict:
        return await self.rpc("stats")

    def start_warmup(self, first_runs: str = "idle") -> None:
        """``Engine.warmup`` in the core, first in line; ``warming`` holds its progress.
        ``first_runs``: as ``AsyncEngine.start_warmup``."""
        self.warming = (0, 0)
        self._send(["warmup", first_runs])

    # -- the end --------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """Whether the core process has ended."""
        return not self.alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """The leading API server's end: ask the core to shut down (final snapshot) and wait
        up to ``timeout`` s for its process to end (``stopped`` tells)."""
        import time

        self._closing = True
        if self.alive():
            self._send(["shutdown"])
            deadline = time.monotonic() + timeout
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.close()

    def close(self) -> None:
        """Say goodbye (when the core still lives) and stop the I/O thread."""
        if self._stop.is_set():
            return
        if self.alive():
            try:
                self._send(["bye"])
            except Exception:  # noqa: BLE001
                pass
        import time

        time.sleep(0.05)  # let the I/O thread forward the last frames
        self._stop.set()
        self._thread.join(5)
        pool = getattr(self, "_tok_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
