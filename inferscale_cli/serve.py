"""``inferscale serve``: the HTTP server (``serving/``) over one engine, with uvicorn.

Startup does the cheap, failing-fast work first and says what it does:

1. **Before the model loads**: every path and value is checked (``main.validate``), the chat
   template read, and the listening socket is bound and listening (``bind``).  A taken port is
   one ``error:`` line and exit 1 within a second, never after a model load; ``--port`` must be
   1-65535 (parse time).  Connections that arrive meanwhile wait in the socket's backlog.
2. **The model loads** (``Engine.from_pretrained``; ``--snapshot-dir`` restores segments and KV)
   in the engine core process (``inferscale_jax/engine_core.py``, spawned here first, before this
   process imports the engine package, FastAPI and uvicorn, so those imports overlap its start;
   ``build_engine`` runs there), while this process parses the API key file (a bad one is one
   ``error:`` line, the starting core stopped, exit 2) and waits for the core to say ready; with
   ``--engine-in-process`` (and always with ``--coordinator``) here, on an ``AsyncEngine``
   thread.  ``--api-server-count N`` then spawns N - 1 more API-server processes on the bound
   socket (``api_server``).
   Without ``--api-keys`` every request is tenant ``default``: the tenants the restored snapshot
   holds besides it are printed with the key file that reaches them (``tenant_hint``).
3. **The app** (``serving.create_app``): a chat template that cannot render is one ``error:``
   line here, before any compile.
4. **Warm-up** on the engine thread (``Engine.warmup``: the small bucket set on the CPU, every
   bucket on a GPU/TPU; a progress bar on stderr; ``/health`` answers 503 ``warming up`` until
   it is done) while uvicorn serves the bound socket.
5. **Shutdown** (SIGTERM / Ctrl-C): uvicorn's graceful shutdown (and the other API servers'),
   then the warm-up is stopped (``Engine.stop_warmup``: no new compile starts), the engine loop
   (core process or thread) finishes its step, the final snapshot is written, exit 0.  If the
   engine fails (a lost device, or the core process dying) the server stops serving and exits
   1: in the core layout ``FAULT_EXIT_DELAY_S`` later, ``/health`` answering 503 meanwhile.
   uvicorn re-raises the signal it caught on the way out; ``_stop_signals_return`` keeps that
   from killing the process before the snapshot.

Logging: ``--log-level`` sets our loggers; uvicorn's startup lines and access log stay off.  One
JSON line per HTTP request with ``--log-requests`` (``serving/middleware.py``); the engine's own
per-request line (``inferscale.request``, ``tracing.py``) is then redundant and stays off unless
``--log-level debug``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys

SHUTDOWN_WAIT_S = 300.0  # how long the engine thread may take to finish its step at shutdown
FAULT_EXIT_DELAY_S = 10.0  # core layout: after the engine fails, /health answers 503 this long, then exit
DEFAULT_NAMES = ["inferscale-default", "inferscale"]  # the embedded default model's served names
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_TENANT_RESERVE = 0.125  # --tenant-reserve with several serving tenants (EngineConfig.tenant_reserve)
CORE_PROCESS_NAME = "inferscale-engine-core"  # the spawned engine core's multiprocessing name


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on ``host:port``, one per address the name resolves to (as asyncio's
    ``create_server``, which uvicorn would call, binds them: ``localhost`` is 127.0.0.1 and ::1),
    made here so a taken port fails before the model loads; ``OSError`` naming the address and
    the fix."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"--host {host}: cannot resolve it ({err.strerror}); give an IP address or a known "
                      "host name, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio: a restart reuses TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(2048)
    except OSError as err:
        for sock in socks:
            sock.close()
        hint = ("another process listens there (an earlier inferscale serve?): stop it or pick another --port"
                if err.errno == 98 else "pick another --host / --port")
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror} ({hint})") from None
    return socks


def served_names(args) -> list[str]:
    """``--served-model-name`` (several allowed, the first is shown in responses), else the
    deprecated ``--model-name``, else the ``--model`` folder's name or, for the embedded default
    model, ``inferscale-default`` and ``inferscale`` (the name the docs' examples use)."""
    if args.served_model_name:
        return list(dict.fromkeys(args.served_model_name))
    if args.model_name:
        print("warning: --model-name is deprecated; use --served-model-name NAME [NAME ...]", file=sys.stderr)
        return [args.model_name]
    return [os.path.basename(os.path.normpath(args.model))] if args.model else list(DEFAULT_NAMES)


def chat_template(value: str | None) -> str | None:
    """``--chat-template FILE|STRING``: an existing file's text, else the value itself when it is a
    Jinja template; anything else (a missing file) is a ``FileNotFoundError`` naming it."""
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template {path} is neither a file nor a Jinja template (no '{{{{' or "
                            "'{%'): give the template file's path or the template text")


def tenant_hint(engine) -> str | None:
    """Without ``--api-keys``: the tenants other than ``default`` whose segments the engine holds,
    and the key file that reaches them (None when there are none)."""
    from inferscale_jax.prefix_cache import PUBLIC_TENANT
    from inferscale_jax.sessions import is_session_id

    counts: dict[str, int] = {}
    for seg in engine.store.all_segments():
        if seg.namespace not in ("default", PUBLIC_TENANT) and not is_session_id(seg.info.id):
            counts[seg.namespace] = counts.get(seg.namespace, 0) + 1
    if not counts:
        return None
    listed = ", ".join(f"'{t}' ({n} segment{'s' * (n != 1)})" for t, n in sorted(counts.items()))
    example = json.dumps({f"<a secret key for {t}>": t for t in sorted(counts)})
    return (f"note: the snapshot also holds segments of tenant {listed}; without --api-keys every request is "
            f"tenant 'default' and cannot see them.  To reach them, restart with --api-keys keys.json, "
            f"keys.json mapping a key to each tenant: {example} (clients send it as 'Authorization: Bearer <key>')")


@contextlib.contextmanager
def _stop_signals_return():
    """While uvicorn runs: SIGTERM / SIGINT handlers that do nothing.  uvicorn installs its own
    during ``run`` (graceful shutdown) and, on the way out, restores these and re-raises the
    signal it caught: with the default handlers that would kill the process (SIGTERM) or raise
    KeyboardInterrupt (SIGINT) before the engine's final snapshot.  Restored afterwards."""
    saved = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s", force=True)
    quiet = [("absl", logging.WARNING), ("jax", logging.WARNING), ("orbax", logging.WARNING)]
    if level != "debug":  # the middleware's line (--log-requests) is the one line per request
        quiet.append(("inferscale.request", logging.WARNING))
    for name, lvl in quiet:
        logging.getLogger(name).setLevel(lvl)


def _create_app(create_app, async_engine, keys, args, names: list[str], template: str | None):
    return create_app(async_engine, api_keys=keys, max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting,
                      body_timeout_s=args.body_timeout, default_max_tokens=args.default_max_tokens,
                      model_names=names, log_requests=args.log_requests, chat_template=template,
                      max_waiting_per_tenant=args.max_waiting_per_tenant,
                      tool_call_parser=getattr(args, "tool_call_parser", None))


def cmd_serve(args) -> int:
    """Steps 1-5 of the module docstring."""
    from inferscale_cli.main import resolve_dtype

    _configure_logging(args.log_level)
    template = chat_template(args.chat_template)
    names = served_names(args)
    follower = bool(args.coordinator) and args.process_id not in (None, 0)
    socks = [] if follower else bind(args.host, args.port)
    urls = []
    for sock in socks:
        host, port = sock.getsockname()[:2]
        urls.append(f"http://{'[' + host + ']' if ':' in host else host}:{port}")
    if socks:
        print(f"listening on {' and '.join(urls)}; loading {args.model or 'the embedded default model'} "
              f"(requests wait until it is up)", file=sys.stderr, flush=True)
    try:
        return _serve(args, socks, " and ".join(urls), names, template, resolve_dtype)
    finally:
        for sock in socks:
            sock.close()


def _engine_config(args, resolve_dtype):
    from inferscale_jax.config import EngineConfig

    extra = {}
    if args.snapshot_dir:
        extra = dict(snapshot_dir=args.snapshot_dir, strict_restore=args.strict_restore,
                     snapshot_interval_s=args.snapshot_interval, repair_registry=args.repair)
    reserve = args.tenant_reserve
    if reserve is None:  # several serving tenants in the key file: 1/8 of the rows kept from any one of them
        from serving import load_api_keys

        several = args.api_keys and len(load_api_keys(args.api_keys).serving_tenants()) > 1
        reserve = DEFAULT_TENANT_RESERVE if several else 0.0
    extra["tenant_reserve"] = reserve
    config = EngineConfig(dtype=resolve_dtype(args.dtype), page_size=args.page_size, hbm_pages=args.hbm_pages,
                          host_pages=args.host_pages,
                          max_batch=args.max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
                          decode_steps=args.decode_steps,
                          tensor_parallel=args.tensor_parallel, kv_dtype=args.kv_dtype,
                          session_ttl_s=args.session_ttl, max_sessions_per_tenant=args.max_sessions_per_tenant,
                          **extra)
    return config


def build_engine(args):
    """The engine core process's engine (``inferscale_jax/engine_core.py`` calls it there):
    logging and tracing set up as in the API server, the engine loaded, the tenant hint printed."""
    from inferscale_cli.main import hide_torch, resolve_dtype

    # a spawned process does not inherit the parent's mark: without it a tokenizer loaded through
    # AutoTokenizer imports PyTorch here, beside the weights' load (bench/NOTES.md, run AM)
    hide_torch()
    from inferscale_jax import tracing
    from inferscale_jax.engine import Engine

    _configure_logging(args.log_level)
    tracing.configure_from_env()
    engine = Engine.from_pretrained(args.model, _engine_config(args, resolve_dtype))
    if not args.api_keys and (hint := tenant_hint(engine)):
        print(hint, file=sys.stderr, flush=True)
    return engine


def _serve(args, socks: list, url: str, names: list[str], template: str | None, resolve_dtype) -> int:
    lockstep = None
    if args.coordinator or args.num_processes or args.process_id is not None:
        # several processes (hosts), one mesh: before any other JAX call (inferscale_jax/distributed.py)
        from inferscale_jax import distributed as lockstep
        lockstep.initialize(args.coordinator, args.num_processes, args.process_id)
    # the core layout spawns the engine core first: its imports and the model's load then overlap
    # this process's own imports (~2-3 s of the engine package, FastAPI and uvicorn; module docstring, 2)
    core = _start_core(args) if lockstep is None and not getattr(args, "engine_in_process", False) else None
    try:
        import uvicorn

        from inferscale_jax import tracing
        from serving import create_app, load_api_keys

        keys = load_api_keys(args.api_keys) if args.api_keys else None  # (a bad file stops the core at once)
        if tracing.configure_from_env():  # OTEL_* environment, 'inferscale-jax[tracing]' installed
            print("tracing: exporting spans over OTLP", file=sys.stderr)
    except BaseException:
        if core is not None:
            _stop_core(*core)
        raise
    if keys is None and args.host not in LOCAL_HOSTS:
        print(f"warning: serving on {args.host} without --api-keys: anyone who can reach it is tenant 'default'",
              file=sys.stderr)
    if core is not None:
        return _serve_with_core(args, socks, url, names, template, keys, *core)
    from inferscale_jax.async_engine import AsyncEngine
    from inferscale_jax.engine import Engine

    config = _engine_config(args, resolve_dtype)
    if lockstep is not None:
        config = lockstep.lockstep_config(config)
        engine = lockstep.LockstepEngine.from_pretrained(args.model, config)
        if not lockstep.is_leader():  # a follower: the leader's calls, until it closes the engine
            print(f"process {args.process_id}: following process 0", file=sys.stderr, flush=True)
            lockstep.follow(engine)
            return 0
    else:
        engine = Engine.from_pretrained(args.model, config)
    server: uvicorn.Server | None = None

    def on_fatal(fault) -> None:  # the engine lost its device: stop serving rather than half-serve
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(engine, on_fatal=on_fatal)
    try:
        app = _create_app(create_app, async_engine, keys, args, names, template)
        if keys is None and (hint := tenant_hint(engine)):
            print(hint, file=sys.stderr)
        also = f" (also answers to {', '.join(names[1:])})" if len(names) > 1 else ""
        print(f"serving {names[0]}{also} on {url}, {len(keys) if keys else 'no'} API keys; "
              + ("warming up: /health answers 503 until it is done" if args.warmup else "no warm-up"),
              file=sys.stderr, flush=True)
        if args.warmup:
            async_engine.start_warmup(args.first_runs)
        server = _uvicorn_server(app, args)
        with _stop_signals_return():
            server.run(sockets=socks)
    finally:
        engine.stop_warmup()  # a warm-up still compiling starts nothing more
        async_engine.shutdown(timeout=SHUTDOWN_WAIT_S)  # a step (or a compile) in flight finishes first
        if async_engine.stopped:
            engine.close()  # the final snapshot, with the engine thread gone
        else:
            print(f"error: the engine thread did not stop within {SHUTDOWN_WAIT_S:.0f} s; no final snapshot "
                  "(the last periodic one and the registry stand)", file=sys.stderr)
    if async_engine.fatal is not None:
        print(f"error: {async_engine.fatal}", file=sys.stderr)
        return 1
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _uvicorn_server(app, args):
    import uvicorn

    from serving import UVICORN_OPTIONS
    from serving.connections import ConnectionGuard

    ConnectionGuard.head_timeout_s = args.head_timeout  # (the protocol classes uvicorn builds per connection)
    ConnectionGuard.max_per_client = args.max_connections_per_client
    # log_config=None: uvicorn keeps the logging set up above (its own dictConfig would drop
    # the root handler that prints the per-request lines of ``inferscale.server``)
    quiet = "debug" if args.log_level == "debug" else "warning"  # uvicorn's own startup lines: debug only
    return uvicorn.Server(uvicorn.Config(app, log_level=quiet, access_log=False, log_config=None,
                                         **UVICORN_OPTIONS))


def _exit_later(server_ref: list, delay: float):
    """``on_fatal`` for the core layout: stop serving ``delay`` s from now (``/health`` answers
    503 meanwhile, so a load balancer sees the failure before the port closes)."""
    import threading

    def on_fatal(fault) -> None:
        def stop():
            if server_ref:
                server_ref[0].should_exit = True
        timer = threading.Timer(delay, stop)
        timer.daemon = True
        timer.start()
    return on_fatal


def _host_only() -> None:
    """An API-server process never computes: JAX here stays on the CPU, so it never initializes
    the accelerator (whose memory - on a GPU, a preallocated share of it - is the core's)."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def api_server(socks: list, address: str, args, names: list[str], template: str | None, index: int, core_pid: int) -> None:
    """An extra API-server process (``--api-server-count`` > 1): the same app on the same
    listening socket, over the same engine core; ends on SIGTERM (sent by the first API server)."""
    from inferscale_cli.main import hide_torch

    hide_torch()  # (spawned, as the core: the tokenizer it unpickles needs no PyTorch)
    from serving import create_app, load_api_keys
    from serving.core_client import CoreClient

    _host_only()
    _configure_logging(args.log_level)
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    server_ref: list = []
    client = CoreClient(address, lambda: _pid_alive(core_pid), index=index,
                        on_fatal=_exit_later(server_ref, FAULT_EXIT_DELAY_S))
    try:
        app = _create_app(create_app, client, keys, args, names, template)
        server = _uvicorn_server(app, args)
        server_ref.append(server)
        with _stop_signals_return():
            server.run(sockets=socks)
    finally:
        client.close()
    sys.exit(1 if client.fatal is not None else 0)


def _start_core(args) -> tuple:
    """Spawn the engine core process (``core_main``) on a fresh IPC address; returns (the
    process, its address, the address's folder).  Called before this process imports the engine
    package, FastAPI or uvicorn, so the core's start does not wait for them."""
    import multiprocessing
    import tempfile

    mp = multiprocessing.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="inferscale-core-")
    address = f"ipc://{folder}/core.sock"
    # (``build_engine`` looked up now: the benchmarks put a model-free engine's builder in its place)
    core = mp.Process(target=core_main, args=(address, build_engine, args, os.getpid()), name=CORE_PROCESS_NAME)
    core.start()
    _host_only()  # (after the spawn: the core's JAX keeps the default platforms)
    return core, address, folder


def core_main(address: str, build, args, parent_pid: int) -> None:
    """The engine core process's body (``inferscale_jax/engine_core.py``'s ``run`` over ``build``:
    ``build_engine``); it imports the engine itself, so spawning it needs no import of the engine
    here."""
    from inferscale_jax import engine_core

    engine_core.run(address, build, (args,), parent_pid)


def _stop_core(core, address: str, folder: str) -> None:
    """This process failed before serving (a bad API key file): the starting core goes at once."""
    import shutil

    core.kill()
    core.join()
    shutil.rmtree(folder, ignore_errors=True)


def _serve_with_core(args, socks: list, url: str, names: list[str], template: str | None, keys, core,
                     address: str, folder: str) -> int:
    """The default layout (``inferscale_jax/engine_core.py``): the engine in a core process
    (``core``, started by ``_start_core``), HTTP here and in ``--api-server-count`` - 1 more
    API-server processes."""
    import multiprocessing
    import shutil

    from serving import create_app
    from serving.core_client import CoreClient

    mp = multiprocessing.get_context("spawn")
    print(f"engine core process: pid {core.pid}; API server process: pid {os.getpid()}", file=sys.stderr, flush=True)
    server_ref: list = []
    apis: list = []
    client = None
    try:
        client = CoreClient(address, core.is_alive, index=0, exitcode=lambda: core.exitcode,
                            on_fatal=_exit_later(server_ref, FAULT_EXIT_DELAY_S))
        app = _create_app(create_app, client, keys, args, names, template)
        for i in range(1, getattr(args, "api_server_count", 1) or 1):
            p = mp.Process(target=api_server, args=(socks, address, args, names, template, i, core.pid),
                           name=f"inferscale-api-{i}")
            p.start()
            apis.append(p)
        also = f" (also answers to {', '.join(names[1:])})" if len(names) > 1 else ""
        print(f"serving {names[0]}{also} on {url}, {len(keys) if keys else 'no'} API keys, "
              f"{1 + len(apis)} API server process{'es' if apis else ''}; "
              + ("warming up: /health answers 503 until it is done" if args.warmup else "no warm-up"),
              file=sys.stderr, flush=True)
        if args.warmup:
            client.start_warmup(args.first_runs)
        server = _uvicorn_server(app, args)
        server_ref.append(server)
        with _stop_signals_return():
            server.run(sockets=socks)
    finally:
        for p in apis:  # the other API servers' graceful shutdown first: their streams end
            if p.is_alive():
                p.terminate()  # SIGTERM
        for p in apis:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        if client is not None:
            client.shutdown(timeout=SHUTDOWN_WAIT_S)  # the core drains, takes the final snapshot, exits
        else:
            core.join(SHUTDOWN_WAIT_S)
        if core.is_alive():
            print(f"error: the engine core process did not stop within {SHUTDOWN_WAIT_S:.0f} s; no final snapshot "
                  "(the last periodic one and the registry stand)", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
    if client.fatal is not None and not (client.core_exited and core.exitcode == 0):
        print(f"error: {client.fatal}", file=sys.stderr)
        return 1
    if core.exitcode != 0:
        print(f"error: the engine core process exited with code {core.exitcode}", file=sys.stderr)
        return 1
    return 0
