"""The ``inferscale`` command line.

Every command takes ``--model DIR`` (an HF checkpoint folder: config.json, *.safetensors,
tokenizer files); without it, the embedded default model is used (built locally on first use).

    inferscale init-default              build the default model and print its folder
    inferscale generate --prompt TEXT    generate a completion (dense KV cache)
    inferscale precompute CORPUS --snapshot-dir DIR   a corpus -> segments + snapshot (precompute.py)
    inferscale demo                      KV injection vs full prefill: TTFT and identical outputs
    inferscale serve [--port N] [--api-keys FILE] [--snapshot-dir DIR]   the HTTP server (serving/)
    inferscale bench serve [OPTIONS]     the serving benchmark (bench/serve.py; a source checkout)

What ``main`` does at the boundary, for every command:

- **Quiet third parties** before anything imports them: transformers' advisories ("PyTorch was
  not found" on a machine without torch) and its info logs are off; absl/orbax INFO lines
  stay off whatever ``--log-level`` is (``serve``'s logging setup re-enables only ours).
- **Absolute paths**: every path the user gives (``--model``, ``--snapshot-dir``,
  ``--api-keys``, the corpus) is made absolute against the current folder before it reaches
  the engine (orbax refuses relative paths), and a ``--model`` that is not a folder is refused
  before anything loads.
- **One dtype rule**: ``--dtype auto`` (the default of every command) is bfloat16 on a GPU or
  TPU and float32 on the CPU (``resolve_dtype``), so ``precompute`` and ``serve`` on the same
  machine agree and a snapshot one writes is restored by the other (a snapshot's fingerprint
  includes the dtype).
- **Compile cache**: engines keep JAX's persistent compilation cache on (``compile_cache.py``);
  ``generate``, which runs without an engine, switches it on itself.  Later runs load the
  compiles of the first.
- **Signals**: ``serve`` stops on SIGTERM or Ctrl-C after uvicorn's graceful shutdown, then
  takes the final snapshot and exits 0 (uvicorn would re-raise the signal and kill the
  process before the snapshot).
- **One line per known failure**: the engine's exceptions (``inferscale_jax.errors``), invalid
  values (``ValueError``), a missing file or folder and an unreadable SQLite registry print
  ``error: <message>`` on stderr and exit 2 (usage: bad values, missing paths) or 1 (everything
  else).  ``--debug`` shows the traceback instead.  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from inferscale_jax.config import resolve_dtype

SHUTDOWN_WAIT_S = 300.0  # serve: how long the engine thread may take to finish its step at shutdown

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("weights and KV dtype; auto = bfloat16 on a GPU/TPU, float32 on the CPU; precompute and serve "
              "must use the same one (default: %(default)s)")
USAGE_EXIT, FAILURE_EXIT = 2, 1


def quiet_third_party() -> None:
    """Turn off transformers' advisory warnings and info logs; call before it is imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def quiet_loggers() -> None:
    """absl (orbax logs through it) and jax stay at WARNING, whatever level the root logger has."""
    import logging

    for name in ("absl", "jax", "orbax"):
        logging.getLogger(name).setLevel(logging.WARNING)


def absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def make_paths_absolute(args) -> None:
    """Resolve every user path against the current folder; refuse a ``--model`` that is no folder."""
    for field in ("model", "snapshot_dir", "api_keys", "corpus"):
        if getattr(args, field, None) is not None:
            setattr(args, field, absolute(getattr(args, field)))
    if getattr(args, "model", None) is not None and not os.path.isdir(args.model):
        kind = NotADirectoryError if os.path.exists(args.model) else FileNotFoundError
        what = "is not a folder" if os.path.exists(args.model) else "does not exist"
        raise kind(f"--model {args.model} {what}: give a local HF checkpoint folder (config.json, "
                   f"*.safetensors, tokenizer files), or leave --model out to use the embedded default model")


def describe_error(err: BaseException, args) -> tuple[int, str] | None:
    """(exit code, one-line message) for a known failure; ``None`` for anything else (a bug)."""
    import sqlite3

    from inferscale_jax.errors import InferScaleError

    if isinstance(err, InferScaleError):
        return FAILURE_EXIT, str(err)
    if isinstance(err, sqlite3.DatabaseError):
        where = getattr(args, "snapshot_dir", None)
        where = f"the segment registry in {where}" if where else "a SQLite file"
        return FAILURE_EXIT, (f"{where} is unreadable (sqlite3: {err}): move that folder aside or delete it "
                              "to start with an empty registry")
    if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return USAGE_EXIT, str(err)
    if isinstance(err, ValueError):
        return USAGE_EXIT, str(err)
    if isinstance(err, OSError):
        return FAILURE_EXIT, str(err)
    return None


def _model_dir(args) -> str:
    from inferscale_jax.default_model import default_model_dir

    return args.model or default_model_dir()


def cmd_init_default(args) -> int:
    from inferscale_jax.default_model import default_model_dir

    print(default_model_dir())
    return 0


def cmd_generate(args) -> int:
    import jax.numpy as jnp

    from inferscale_jax import compile_cache
    from inferscale_jax.dense_generate import generate_dense
    from inferscale_jax.sampling import SamplingParams
    from inferscale_jax.tokenizer import load_tokenizer
    from models import ModelConfig, load_params

    compile_cache.enable(None)
    model_dir = _model_dir(args)
    cfg = ModelConfig.from_pretrained(model_dir)
    dtype = jnp.dtype(resolve_dtype(args.dtype))
    params = load_params(model_dir, cfg, dtype)
    tok = load_tokenizer(model_dir)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    ids = tok.encode(args.prompt, add_special_tokens=True)
    out, timings = generate_dense(params, cfg, ids, sampling, dtype)
    print(tok.decode(out, skip_special_tokens=True))
    print(f"[{timings['prompt_tokens']} prompt tokens, {timings['generated_tokens']} generated, "
          f"ttft {timings['ttft_s'] * 1000:.1f} ms (includes compile), total {timings['total_s']:.2f} s]",
          file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from inferscale_jax.demo import run_demo

    return 0 if run_demo(args.model, max_tokens=args.max_tokens, dtype=args.dtype) else 1


def cmd_precompute(args) -> int:
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.engine import Engine
    from inferscale_jax.precompute import precompute

    config = EngineConfig(dtype=resolve_dtype(args.dtype), page_size=args.page_size,
                          snapshot_dir=args.snapshot_dir, max_batch=args.batch, tensor_parallel=args.tensor_parallel,
                          kv_dtype=args.kv_dtype)
    with Engine.from_pretrained(_model_dir(args), config) as engine:
        w = engine.warmup(serving=False)  # the batch job's step buckets, several compiling at once
        print(f"warm-up: {w['buckets']} step shapes ready in {w['seconds']:.1f} s", file=sys.stderr)
        res = precompute(engine, args.corpus, tenant=args.tenant, public=args.public, batch=args.batch)
    print(res.summary())
    return 0


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


def cmd_serve(args) -> int:
    """The HTTP server (``serving/``) over one engine, with uvicorn; a final snapshot on shutdown."""
    import logging

    import uvicorn

    from inferscale_jax.async_engine import AsyncEngine
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.engine import Engine
    from serving import UVICORN_OPTIONS, create_app, load_api_keys

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s", force=True)
    quiet_loggers()
    lockstep = None
    if args.coordinator or args.num_processes or args.process_id is not None:
        # several processes (hosts), one mesh: before any other JAX call (inferscale_jax/distributed.py)
        from inferscale_jax import distributed as lockstep
        lockstep.initialize(args.coordinator, args.num_processes, args.process_id)
    from inferscale_jax import tracing
    if tracing.configure_from_env():  # OTEL_* environment, 'inferscale-jax[tracing]' installed
        print("tracing: exporting spans over OTLP", file=sys.stderr)
    keys = load_api_keys(args.api_keys) if args.api_keys else None  # fail before loading the model
    if keys is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without --api-keys: anyone who can reach it is tenant 'default'",
              file=sys.stderr)
    extra = {}
    if args.snapshot_dir:
        extra = dict(snapshot_dir=args.snapshot_dir, strict_restore=args.strict_restore,
                     snapshot_interval_s=args.snapshot_interval)
    config = EngineConfig(dtype=resolve_dtype(args.dtype), page_size=args.page_size, hbm_pages=args.hbm_pages,
                          max_batch=args.max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
                          tensor_parallel=args.tensor_parallel, kv_dtype=args.kv_dtype,
                          session_ttl_s=args.session_ttl, max_sessions_per_tenant=args.max_sessions_per_tenant,
                          **extra)
    if lockstep is not None:
        config = lockstep.lockstep_config(config)
        engine = lockstep.LockstepEngine.from_pretrained(args.model, config)
        if not lockstep.is_leader():  # a follower: the leader's calls, until it closes the engine
            print(f"process {args.process_id}: following process 0", file=sys.stderr, flush=True)
            lockstep.follow(engine)
            return 0
    else:
        engine = Engine.from_pretrained(args.model, config)
    name = args.model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else "inferscale-default")
    server: uvicorn.Server | None = None

    def on_fatal(fault) -> None:  # the engine lost its device: stop serving rather than half-serve
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(engine, on_fatal=on_fatal)
    if args.warmup:
        async_engine.start_warmup()  # /health answers 503 "warming up" until every step bucket is compiled
    try:
        app = create_app(async_engine, api_keys=keys, max_body_bytes=args.max_body_bytes,
                         max_waiting=args.max_waiting, model_name=name, body_timeout_s=args.body_timeout,
                         default_max_tokens=args.default_max_tokens)
        print(f"serving {name} on http://{args.host}:{args.port} "
              f"({len(keys) if keys else 'no'} API keys)", file=sys.stderr, flush=True)
        # log_config=None: uvicorn keeps the logging set up above (its own dictConfig would drop
        # the root handler that prints the per-request lines of ``inferscale.server``)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               access_log=False, log_config=None, **UVICORN_OPTIONS))
        with _stop_signals_return():
            server.run()
    finally:
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


def cmd_bench(args) -> int:
    """``bench NAME ...``: ``bench/NAME.py`` of the source tree, its ``main`` given the remaining
    arguments.  bench/ is no installed package: it is found beside this package's folder."""
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "bench", f"{args.benchmark}.py")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script} is missing: the benchmarks live in the bench/ folder of the source "
                                "tree, which an installed package does not include; run this command from a "
                                f"checkout of the repository (or run bench/{args.benchmark}.py there)")
    return runpy.run_path(script, run_name="inferscale_bench")["main"](args.args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferscale", description="InferScale-JAX: serving by KV injection. "
                                "Relative paths are resolved against the current folder.")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error "
                        "(default: one 'error: ...' line)")

    def add(name: str, help: str):
        return sub.add_parser(name, help=help, description=help, parents=[common])

    s = add("init-default", help="build the embedded default model and print its folder")
    s.set_defaults(fn=cmd_init_default)

    s = add("demo", help="KV injection vs full prefill side by side (TTFT, identical outputs)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--max-tokens", type=int, default=24, help="tokens generated per answer (default: %(default)s)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.set_defaults(fn=cmd_demo)

    s = add("generate", help="generate a completion for a prompt (a plain dense-cache run, no engine)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--prompt", required=True, help="the prompt text")
    s.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.set_defaults(fn=cmd_generate)

    s = add("precompute", help="store every document of a corpus as a segment (batched prefill), "
                                          "then snapshot")
    s.add_argument("corpus", help="JSONL file (one {\"id\", \"text\"} object per line) or a folder of .txt/.md "
                                  "files (id = relative path)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--snapshot-dir", required=True, help="where segments and KV snapshots are kept (serve reads it)")
    s.add_argument("--tenant", default="default", help="namespace of the segments (default: %(default)s)")
    s.add_argument("--public", action="store_true", help="register public segments (readable by every tenant)")
    s.add_argument("--batch", type=int, default=64, help="documents computed per device step (default: %(default)s)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64],
                   help="KV page size; must match the server's (default: %(default)s)")
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model and its KV pool over N devices of this host (default: %(default)s)")
    s.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                   help="compressed KV pages, a float32 scale per token and head (default: the model's dtype)")
    s.set_defaults(fn=cmd_precompute)

    s = add("serve", help="OpenAI-compatible HTTP server with segments, tenants, streaming, metrics")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: folder name)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument("--api-keys", metavar="FILE", help="JSON/TOML mapping key -> tenant or "
                   "{tenant, admin}; without it: one tenant 'default', no auth")
    s.add_argument("--snapshot-dir", help="durable segments + KV snapshots (restored at startup)")
    s.add_argument("--strict-restore", action="store_true",
                   help="refuse to start on a snapshot of another model/dtype/page size (default: start empty)")
    s.add_argument("--snapshot-interval", type=float, default=300.0,
                   help="seconds between periodic snapshots with --snapshot-dir (default: %(default)s)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64],
                   help="KV page size; must match the one precompute used (default: %(default)s)")
    s.add_argument("--hbm-pages", type=int, help="KV pool pages (default: sized from free device memory)")
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model and its KV pool over N devices of this host (default: %(default)s)")
    s.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                   help="compressed KV pages, a float32 scale per token and head (default: the model's dtype)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="sequences per device step (default: from the machine: 256 on a GPU, 64 on the CPU)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="new tokens per device step, prefill chunks and decode rows together "
                        "(default: max(max-batch, 2048))")
    s.add_argument("--session-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="chat sessions (conversation memory) expire this long after their last turn "
                        "(default: %(default)s)")
    s.add_argument("--max-sessions-per-tenant", type=int, default=100,
                   help="a tenant's sessions at most; one more deletes its least recently used (default: %(default)s)")
    s.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several processes (hosts), one mesh: process 0's address for jax.distributed; process 0 "
                        "serves HTTP, the others follow it (docs/architecture.md)")
    s.add_argument("--num-processes", type=int, default=None, help="processes of the mesh (with --coordinator)")
    s.add_argument("--process-id", type=int, default=None, help="this process's index, 0 serves (with --coordinator)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip compiling every step bucket at startup (the first requests then compile)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond which new ones get 503 + Retry-After (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=2 << 20, help="request body limit (default: %(default)s)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive, then 408 (default: %(default)s)")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that sets none (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="level of the server's own log lines (default: %(default)s)")
    s.set_defaults(fn=cmd_serve)

    s = add("bench", help="run a benchmark of the source tree's bench/ folder (serve: the HTTP server under "
                          "load, bench/serve.py; results as bench/NOTES.md describes)")
    s.add_argument("benchmark", choices=["serve"], help="which benchmark")
    s.add_argument("args", nargs=argparse.REMAINDER, help="its options (inferscale bench serve --help)")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    quiet_third_party()
    args = build_parser().parse_args(argv)
    try:
        make_paths_absolute(args)
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        known = None if args.debug else describe_error(err, args)
        if known is None:
            raise
        code, message = known
        print("error: " + " ".join(message.split()), file=sys.stderr)  # one line, whatever the message
        return code


if __name__ == "__main__":
    sys.exit(main())
