"""The engine core process: the ``Engine`` loop on its own, talking to API-server processes over ZMQ.

``inferscale serve`` runs the engine (scheduler, runner, tiers, snapshots) here and HTTP
(parsing, validation, tokenization, detokenization, SSE) in one or more API-server processes
(``serving/core_client.py``), so per-token HTTP work never shares a GIL with the engine loop
(docs/architecture.md, "Processes").  The in-process ``Engine`` / ``AsyncEngine`` stay the
Python API; this module is only the serving layout.

Transport: one ZMQ ROUTER socket here, bound on ``ipc://`` in a private temporary folder; each
API server connects a DEALER.  Frames are msgpack (msgspec): a list whose first item names the
message.  Python objects without a msgpack form (a final ``GenerationOutput``, an exception, an
RPC's arguments and result, chat chain items) travel inside as msgpack extension ``PICKLE_EXT``
(pickle; both ends are this package on this host, the folder is the user's own).

API -> core: ``["hello", pid, index]``, ``["submit", kwargs]`` (``Engine.submit``'s keyword
arguments; ``sampling`` as a map of ``SamplingParams`` fields), ``["abort", request_id]``,
``["call", call_id, name, Ext(args, kwargs)]`` (``engine_rpc.RPCS``), ``["warmup", first_runs]``,
``["shutdown"]``, ``["bye"]``.
Core -> API: ``["ready", Ext(meta)]`` (the model config, tokenizer, sizes and this pid),
``["warming", done, total]`` / ``["warm"]``, ``["reply", call_id, ok, Ext(result or error)]``,
``["step", entries]``, ``["fatal", Ext(EngineFault)]``, ``["closed"]``.

The life of a request:

1. The API server tokenizes the prompt, registers the request's stream under its request id
   and sends ``submit``.
2. The core's loop reads every waiting message between two steps and runs each: ``submit``
   calls ``Engine.submit``; a submit that fails (validation, unknown segment) becomes that
   request's final entry, so the API's stream raises it just as ``AsyncEngine.stream`` does.
3. While anything is unfinished the loop runs ``engine.step()``; after each step it sends each
   API server ONE ``step`` message holding an entry per stream of that server which moved:
   ``[request_id, new_token_ids, logprobs, prompt_tokens, finished, final, error]``.  Token ids
   travel; the API server's ``IncrementalDetokenizer`` makes the deltas' text.  ``final`` is the
   finished request's ``GenerationOutput`` exactly as the engine made it (its ``text`` is the
   engine's, stop strings cut there), so the deltas concatenate to it as in-process.
4. Leaving a stream early sends ``abort``: the pages are freed before the next step.
5. Named RPCs (segments, sessions, stats, prompt log-probs) run between steps, one at a time,
   each as one command (``engine_rpc.py``); their reply carries the result or the exception.

Failures: a step error that leaves the device sound fails the running requests (their entries
carry the error) and the loop goes on; a lost device (``engine.fault``) is sent as ``fatal``
to every API server, fails every stream and every later call, and the core waits for
``shutdown``.  If the core dies, each API server sees its process end (``core_client.py``):
``/health`` answers 503 and every open stream ends with an error.  If its parent (the first API
server) dies, the core takes the final snapshot and exits.

Shutdown: ``shutdown`` (sent by ``inferscale serve`` after uvicorn's graceful shutdown) or
SIGTERM to this process: stop the warm-up, stop accepting requests, finish the unfinished ones
(a SIGTERM alone drains them; after ``shutdown`` the API has already closed its streams), take
the final snapshot (``engine.close()``), send ``closed``, exit 0.  SIGINT is ignored here: a
terminal's Ctrl-C reaches the whole process group, and the API server leads the shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import time
from typing import Any, Callable

log = logging.getLogger("inferscale.core")
PICKLE_EXT = 1
IDLE_POLL_MS = 50  # how long the idle loop waits for a message (snapshots and parent checks between)


def ext(obj) -> Any:
    """``obj`` as a msgpack extension holding its pickle."""
    import msgspec

    return msgspec.msgpack.Ext(PICKLE_EXT, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: memoryview):
    if code == PICKLE_EXT:
        return pickle.loads(data)
    raise ValueError(f"unknown msgpack extension {code}")


def encoder():
    import msgspec

    return msgspec.msgpack.Encoder()


def decoder():
    import msgspec

    return msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def portable_error(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else an ``InferScaleError`` (or ``ValueError``) with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception whose constructor does not take its args back
        from inferscale_jax.errors import InferScaleError

        return (ValueError if isinstance(e, ValueError) else InferScaleError)(str(e))


def pack_submit(request: dict) -> dict:
    """``Engine.submit``'s keyword arguments as msgpack: ``sampling`` as a map of its fields,
    chain items that are not segment ids (literal token runs) as pickles."""
    out = dict(request)
    sampling = out.get("sampling")
    if sampling is not None:
        out["sampling"] = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)}
        if sampling.structured_outputs is not None:
            out["sampling"]["structured_outputs"] = dataclasses.asdict(sampling.structured_outputs)
    if out.get("segments"):
        out["segments"] = [s if isinstance(s, str) else ext(s) for s in out["segments"]]
    return out


def unpack_submit(request: dict) -> dict:
    from inferscale_jax.sampling import SamplingParams
    from inferscale_jax.structured import StructuredOutputs

    if isinstance(request.get("sampling"), dict):
        sp = request["sampling"]
        if sp.get("logit_bias") is not None:
            sp["logit_bias"] = {int(k): v for k, v in sp["logit_bias"].items()}
        if sp.get("structured_outputs") is not None:
            sp["structured_outputs"] = StructuredOutputs(**sp["structured_outputs"])
        request["sampling"] = SamplingParams(**sp)
    return request


class EngineCore:
    """The loop (module docstring).  ``engine``: an ``Engine``; ``sock``: a bound ROUTER."""

    def __init__(self, engine, sock, parent_pid: int | None = None):
        self.engine, self.sock, self.parent_pid = engine, sock, parent_pid
        self.enc, self.dec = encoder(), decoder()
        self.apis: dict[bytes, dict] = {}  # identity -> {"pid", "index"}
        self.owner: dict[str, bytes] = {}  # request id -> the API server streaming it
        self.out: dict[bytes, list] = {}  # entries to send after this round
        self.fatal = None
        self.stopping = False  # shutdown asked: leave the loop
        self.draining = False  # SIGTERM: no new requests, finish the running ones, then leave
        self.warm_backlog: list = []  # messages read while the warm-up ran

    # -- sending --------------------------------------------------------------------------
    def send(self, ident: bytes, msg: list) -> None:
        import zmq

        try:
            self.sock.send_multipart([ident, self.enc.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # an API server that went away: its messages are dropped
            log.debug("send to %r failed: %s", ident, e)

    def broadcast(self, msg: list) -> None:
        for ident in list(self.apis):
            self.send(ident, msg)

    def entry(self, rid: str, new_ids, finished: bool, *, logprobs=None, prompt_tokens: int = 0,
              output=None, error: BaseException | None = None) -> None:
        ident = self.owner.get(rid)
        if ident is None:
            return
        if finished or error is not None:
            self.owner.pop(rid, None)
        self.out.setdefault(ident, []).append(
            [rid, list(new_ids), logprobs, prompt_tokens, bool(finished or error is not None),
             None if output is None else ext(output), None if error is None else ext(portable_error(error))])

    def entries(self, outs) -> None:
        """``entry`` for each of a step's outputs; a stream's plain token (not its last, no
        log-probs) is appended inline, without the call: one per stream per step."""
        owner, out = self.owner, self.out
        for o in outs:
            if o.finished or o.error is not None or o.logprobs is not None:
                self.entry(o.request_id, o.new_token_ids, o.finished, logprobs=o.logprobs,
                           prompt_tokens=o.prompt_tokens, output=o.output, error=o.error)
                continue
            ident = owner.get(o.request_id)
            if ident is not None:
                batch = out.get(ident)
                if batch is None:
                    batch = out[ident] = []
                batch.append([o.request_id, o.new_token_ids, None, o.prompt_tokens, False, None, None])

    def flush(self) -> None:
        out, self.out = self.out, {}
        for ident, entries in out.items():
            self.send(ident, ["step", entries])

    # -- commands -------------------------------------------------------------------------
    def handle(self, ident: bytes, msg: list) -> None:
        kind = msg[0]
        if kind == "submit":
            self.submit(ident, unpack_submit(msg[1]))
        elif kind == "abort":
            if self.owner.pop(msg[1], None) is not None:
                self.engine.abort(msg[1])
        elif kind == "call":
            self.call(ident, msg[1], msg[2], msg[3])
        elif kind == "hello":
            self.apis[ident] = {"pid": msg[1], "index": msg[2]}
            self.send(ident, ["ready", ext(self.meta())])
            if self.fatal is not None:
                self.send(ident, ["fatal", ext(self.fatal)])
        elif kind == "bye":
            self.apis.pop(ident, None)
        elif kind == "warmup":
            self.warmup(*msg[1:2])  # (["warmup", first_runs]: "idle" or "now")
        elif kind == "shutdown":
            self.stopping = True
        else:
            log.warning("unknown message %r from an API server", kind)

    def submit(self, ident: bytes, request: dict) -> None:
        rid = request.get("request_id")
        if rid is None:
            return  # core_client always names its requests
        if rid in self.owner:  # (another API server's request): the open one keeps its route
            self.out.setdefault(ident, []).append(
                [rid, [], None, 0, True, None, ext(ValueError(f"request_id={rid!r} is already in use"))])
            return
        self.owner[rid] = ident
        try:
            if self.fatal is not None:
                raise self.fatal
            if self.draining:
                from inferscale_jax.errors import EngineFault

                raise EngineFault("the server is shutting down (SIGTERM): retry on another replica")
            self.engine.submit(**request)
        except Exception as e:  # noqa: BLE001 - the request's own error, raised by its stream
            self.entry(rid, [], True, error=e)

    def call(self, ident: bytes, call_id: int, name: str, payload) -> None:
        from inferscale_jax.engine_rpc import run_rpc

        args, kwargs = payload
        try:
            if self.fatal is not None and name != "ping":
                raise self.fatal
            result = run_rpc(self.engine, name, args, kwargs)
            if name == "stats":
                result = {**result, **self.process_info()}
            reply = ["reply", call_id, True, ext(result)]
        except Exception as e:  # noqa: BLE001 - handed to the caller
            reply = ["reply", call_id, False, ext(portable_error(e))]
        self.send(ident, reply)

    def process_info(self) -> dict:
        return {"engine_process": {"pid": os.getpid(), "in_process": False},
                "api_processes": sorted(self.apis.values(), key=lambda a: a["index"])}

    def meta(self) -> dict:
        e = self.engine
        meta = {"pid": os.getpid(), "cfg": getattr(e, "cfg", None), "bos_prefix": getattr(e, "bos_prefix", []),
                "max_batch": getattr(e, "max_batch", None), "tokenizer": None}
        try:
            meta["num_pages"], meta["page_size"] = e.pool.num_pages, e.config.page_size
        except AttributeError:
            pass
        try:
            pickle.dumps(e.tokenizer)
            meta["tokenizer"] = e.tokenizer
        except Exception:  # noqa: BLE001 - the API servers then have no tokenizer (token ids only)
            log.warning("the tokenizer cannot be sent to the API servers (not picklable)")
        return meta

    def warmup(self, first_runs: str = "idle") -> None:
        """``Engine.warmup`` (``first_runs``: "idle" leaves the buckets' first runs to the loop's idle
        time, "now" makes them before the API servers hear ``warm``), with its progress broadcast."""
        self.broadcast(["warming", 0, 0])

        def progress(done: int, total: int) -> None:
            self.broadcast(["warming", done, total])
            self.read_during_warmup()

        try:
            info = self.engine.warmup(progress=progress, first_runs=first_runs)
            log.info("warm-up done: %d step buckets in %.1f s", info["buckets"], info["seconds"])
        except Exception:  # noqa: BLE001 - serving goes on; the first requests compile
            log.exception("warm-up failed")
        finally:
            self.broadcast(["warm"])
        backlog, self.warm_backlog = self.warm_backlog, []
        for ident, msg in backlog:  # in their order, before anything read after them
            self.handle(ident, msg)

    def read_during_warmup(self) -> None:
        """Between warm-up buckets: answer hellos, keep the rest for after, stop on shutdown."""
        import zmq

        while True:
            try:
                ident, frame = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.dec.decode(frame)
            if msg[0] == "hello":
                self.handle(ident, msg)
                self.send(ident, ["warming", 0, 0])
            else:
                if msg[0] == "shutdown":
                    self.engine.stop_warmup()
                self.warm_backlog.append((ident, msg))

    def on_sigterm(self, *_) -> None:
        self.draining = True
        try:
            self.engine.stop_warmup()
        except Exception:  # noqa: BLE001
            pass

    # -- the loop -------------------------------------------------------------------------
    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopping:
            busy = self.fatal is None and self.engine.has_unfinished()
            # the warm-up's first runs left for idle time (Engine.warm_idle): one bucket, then messages
            idle_runs = not busy and not self.draining and self.engine.warm_idle()
            if poller.poll(0 if busy or idle_runs else IDLE_POLL_MS):
                while True:
                    try:
                        ident, frame = self.sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(ident, self.dec.decode(frame))
            self.flush()
            if self.parent_gone():
                log.warning("the API server (pid %d) is gone: shutting down", self.parent_pid)
                break
            if self.draining and not self.engine.has_unfinished():
                break
            try:
                self.engine.maybe_snapshot()
            except Exception:  # noqa: BLE001 - a failed snapshot must not stop serving
                log.exception("periodic snapshot failed")
            if self.fatal is None and self.engine.has_unfinished():
                try:
                    outs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - module docstring, "Failures"
                    self.on_step_error(e)
                else:
                    self.entries(outs)
                self.flush()

    def on_step_error(self, e: Exception) -> None:
        fault = getattr(self.engine, "fault", None)
        if fault is None:
            log.exception("engine step failed")
        else:
            log.critical("the engine stopped serving: %s", fault)
            self.fatal = fault
            self.broadcast(["fatal", ext(portable_error(fault))])
        for rid in list(self.owner):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step")
            self.entry(rid, [], True, error=fault or e)


def run(address: str, build: Callable, build_args: tuple, parent_pid: int | None = None) -> None:
    """The core process's body: ``engine = build(*build_args)``, then the loop until shutdown,
    then the final snapshot; exits 0, or 1 when the engine could not be built or closed."""
    import sys

    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server leads (module docstring)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.bind(address)
    core = None
    early_term = []
    signal.signal(signal.SIGTERM, lambda *_: early_term.append(1))
    try:
        engine = build(*build_args)
    except BaseException as e:  # noqa: BLE001 - told to the API servers that said hello
        log.debug("engine build failed", exc_info=True)
        err = portable_error(e)
        deadline = time.monotonic() + 2.0
        enc, dec = encoder(), decoder()
        while time.monotonic() < deadline:
            if sock.poll(100):
                ident, frame = sock.recv_multipart()
                if dec.decode(frame)[0] == "hello":
                    sock.send_multipart([ident, enc.encode(["fatal", ext(err)])])
                    break
        sock.close(linger=1000)
        ctx.term()
        sys.exit(1)
    code = 0
    try:
        core = EngineCore(engine, sock, parent_pid)
        signal.signal(signal.SIGTERM, core.on_sigterm)
        if early_term:
            core.on_sigterm()
        core.run()
    except BaseException:  # noqa: BLE001
        log.exception("the engine core loop failed")
        code = 1
    finally:
        try:
            engine.stop_warmup()
            engine.close()  # the final snapshot
        except Exception:  # noqa: BLE001
            log.exception("engine.close (the final snapshot) failed")
            code = 1
        if core is not None:
            core.broadcast(["closed"])
        sock.close(linger=1000)
        ctx.term()
    sys.exit(code)
