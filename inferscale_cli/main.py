"""The ``inferscale`` command line.

Every command takes ``--model DIR`` (an HF checkpoint folder: config.json, *.safetensors,
tokenizer files); without it, the embedded default model is used (built locally on first use).

    inferscale init-default              build the default model and print its folder
    inferscale generate --prompt TEXT    generate a completion (dense KV cache)
    inferscale precompute CORPUS --snapshot-dir DIR   a corpus -> segments + snapshot (precompute.py)
    inferscale demo                      KV injection vs full prefill: TTFT and identical outputs
    inferscale serve [--port N] [--api-keys FILE] [--snapshot-dir DIR]   the HTTP server (serving/)
    inferscale bench serve [OPTIONS]     the serving benchmark (bench/serving/serve.py; a source checkout)
    inferscale --version                 the package version (inferscale_jax/_version.py)

What ``main`` does at the boundary, for every command:

- **Fast and light**: this module imports neither jax nor transformers (``-h`` and ``--version``
  answer at once; ``python -X importtime -m inferscale_cli -h`` shows it); each command imports
  what it needs when it runs.
- **Check before loading** (``validate``): ``--port`` must be 1-65535 and counts positive (parse
  time); then the paths: a ``--model`` that is no folder, a ``--snapshot-dir`` that is (or lies
  below) a file, a missing ``--api-keys`` file or corpus are one ``error:`` line before any model
  loads (and before ``precompute`` creates its snapshot folder).
- **Quiet third parties** before anything imports them: transformers' advisories ("PyTorch was
  not found": ``hide_torch`` keeps transformers from importing torch) and its info logs are off;
  absl/orbax INFO lines stay off whatever ``--log-level`` is (``serve``'s logging setup
  re-enables only ours).
- **Absolute paths**: every path the user gives (``--model``, ``--snapshot-dir``,
  ``--api-keys``, the corpus) is made absolute against the current folder before it reaches
  the engine (orbax refuses relative paths).
- **One dtype rule**: ``--dtype auto`` (the default of every command) is bfloat16 on a GPU or
  TPU and float32 on the CPU (``resolve_dtype``), so ``precompute`` and ``serve`` on the same
  machine agree and a snapshot one writes is restored by the other (a snapshot's fingerprint
  includes the dtype).
- **Compile cache**: engines keep JAX's persistent compilation cache on (``compile_cache.py``);
  ``generate``, which runs without an engine, switches it on itself.  Later runs load the
  compiles of the first.
- **A snapshot of another engine** (dtype, page size, model): the engine's warning ends with the
  flags of this command that match it (``SnapshotHint``).
- ``serve`` (binding first, startup lines, signals, warm-up): ``serve.py``.
- **One line per known failure**: the engine's exceptions (``inferscale_jax.errors``), invalid
  values (``ValueError``), a missing file or folder and an unreadable SQLite registry print
  ``error: <message>`` on stderr and exit 2 (usage: bad values, missing paths) or 1 (everything
  else).  ``--debug`` shows the traceback instead.  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("weights and KV dtype; auto = bfloat16 on a GPU/TPU, float32 on the CPU; precompute and serve "
              "must use the same one (default: %(default)s)")
USAGE_EXIT, FAILURE_EXIT = 2, 1


def resolve_dtype(name: str) -> str:
    """``inferscale_jax.config.resolve_dtype`` (imported when a command runs, not with this module)."""
    from inferscale_jax.config import resolve_dtype as resolve

    return resolve(name)


def package_version() -> str:
    """``inferscale_jax.__version__``, read from ``inferscale_jax/_version.py`` alone: importing the
    package would import jax."""
    import importlib.util

    folder = importlib.util.find_spec("inferscale_jax").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("inferscale_version", os.path.join(folder, "_version.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.__version__


def port(text: str) -> int:
    """argparse type: a TCP port, 1-65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: give an integer 1-65535") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: a port is 1-65535")
    return value


def positive(kind=int, most=None):
    """argparse type: a number > 0 (and <= ``most``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text} must be <= {most}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def hide_torch() -> None:
    """Nothing here uses PyTorch, but transformers imports it whenever it is installed: about 2 s
    of every start, for the tokenizer alone.  Marked absent in this process, it is not imported
    (transformers then works with tokenizers only, which is all the engine asks of it)."""
    sys.modules.setdefault("torch", None)


def quiet_third_party() -> None:
    """Turn off transformers' advisory warnings and info logs; call before it is imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def validate(args) -> None:
    """Resolve every user path against the current folder and check it, before anything loads:
    ``--model`` a folder, ``--snapshot-dir`` a folder or creatable as one, ``--api-keys`` a file,
    the corpus a file or folder."""
    for field in ("model", "snapshot_dir", "api_keys", "corpus"):
        if getattr(args, field, None) is not None:
            setattr(args, field, absolute(getattr(args, field)))
    if getattr(args, "model", None) is not None and not os.path.isdir(args.model):
        kind = NotADirectoryError if os.path.exists(args.model) else FileNotFoundError
        what = "is not a folder" if os.path.exists(args.model) else "does not exist"
        raise kind(f"--model {args.model} {what}: give a local HF checkpoint folder (config.json, "
                   f"*.safetensors, tokenizer files), or leave --model out to use the embedded default model")
    if getattr(args, "snapshot_dir", None) is not None:
        check_folder(args.snapshot_dir, "--snapshot-dir")
    if getattr(args, "api_keys", None) is not None and not os.path.isfile(args.api_keys):
        what = "is a folder" if os.path.isdir(args.api_keys) else "does not exist"
        raise FileNotFoundError(f"--api-keys {args.api_keys} {what}: give a JSON or TOML file mapping each key "
                                'to its tenant, e.g. {"sk-acme-1": "acme"} (docs/architecture.md)')
    if getattr(args, "corpus", None) is not None and not os.path.exists(args.corpus):
        raise FileNotFoundError(f"corpus {args.corpus} does not exist: give a JSONL file (one "
                                '{"id", "text"} object per line) or a folder of .txt/.md files')


def check_folder(path: str, flag: str) -> None:
    """``path`` is a folder, or can become one: its nearest existing ancestor is a folder."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise NotADirectoryError(f"{flag} {path} is a file, not a folder: give a folder (created if missing), "
                                 "e.g. ./kv")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise NotADirectoryError(f"{flag} {path} lies below {parent}, which is a file, not a folder: give a "
                                 "folder path (created if missing)")


def snapshot_fix(message: str) -> str | None:
    """For a snapshot or registry of another engine (``registry.Identity.mismatch``'s words): the
    flags of this command that match it, or None."""
    import re

    if m := re.search(r"dtype (\S+) differs from this engine's", message):
        dtype, _, kv = m.group(1).partition("/kv=")
        return f"--dtype {dtype}" + (f" --kv-dtype {kv}" if kv else "")
    if m := re.search(r"page size (\d+) differs from this engine's", message):
        return f"--page-size {m.group(1)}"
    if "model fingerprint" in message:
        return "--model <the checkpoint that wrote it>"
    return None


class SnapshotHint:
    """A logging filter for ``inferscale.snapshot``: the warning about a snapshot of another
    engine ends with the fix in this command's terms."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        if "another engine" in message and (flags := snapshot_fix(message)):
            record.msg, record.args = (f"{message}.  Fix: run with {flags} (as the command that wrote it), or "
                                       "give another --snapshot-dir"), ()
        return True


def describe_error(err: BaseException, args) -> tuple[int, str] | None:
    """(exit code, one-line message) for a known failure; ``None`` for anything else (a bug)."""
    import sqlite3

    errors = sys.modules.get("inferscale_jax.errors")  # (not imported yet: err cannot be one of them)
    if errors is not None and isinstance(err, errors.InferScaleError):
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
    """Load the engine (restoring the snapshot), count the new or changed documents, warm up only
    if there are any, compute them, snapshot only if something was computed."""
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.engine import Engine
    from inferscale_jax.precompute import pending, precompute

    config = EngineConfig(dtype=resolve_dtype(args.dtype), page_size=args.page_size,
                          snapshot_dir=args.snapshot_dir, max_batch=args.batch, tensor_parallel=args.tensor_parallel,
                          kv_dtype=args.kv_dtype)
    with Engine.from_pretrained(_model_dir(args), config) as engine:
        todo = pending(engine, args.corpus, tenant=args.tenant, public=args.public)
        if todo:
            w = engine.warmup(serving=False)  # the batch job's step buckets, several compiling at once
            print(f"warm-up: {w['buckets']} step shapes ready in {w['seconds']:.1f} s", file=sys.stderr)
        res = precompute(engine, args.corpus, tenant=args.tenant, public=args.public, batch=args.batch,
                         progress=bool(todo))
    print(res.summary())
    if not res.computed:
        print(f"nothing to compute: no document is new or changed in {args.snapshot_dir}; no snapshot written",
              file=sys.stderr)
    if args.tenant != "default" and not args.public:
        print(f"note: these segments belong to tenant '{args.tenant}': a server reaches them only through an API "
              f"key of that tenant: inferscale serve --snapshot-dir {args.snapshot_dir} --api-keys keys.json, "
              f'keys.json holding {{"<a secret key>": "{args.tenant}"}}', file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from inferscale_cli.serve import cmd_serve as serve

    return serve(args)


def cmd_bench(args) -> int:
    """``bench NAME ...``: ``bench/serving/NAME.py`` of the source tree, its ``main`` given the remaining
    arguments.  bench/ is no installed package: it is found beside this package's folder."""
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "bench", "serving", f"{args.benchmark}.py")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script} is missing: the benchmarks live in the bench/ folder of the source "
                                "tree, which an installed package does not include; run this command from a "
                                f"checkout of the repository (or run bench/serving/{args.benchmark}.py there)")
    return runpy.run_path(script, run_name="inferscale_bench")["main"](args.args)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line like every other error (exit 2)."""

    def error(self, message):
        self.exit(USAGE_EXIT, f"error: {self.prog}: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="inferscale", description="InferScale-JAX: serving by KV injection. "
                                "Relative paths are resolved against the current folder.")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error "
                        "(default: one 'error: ...' line)")

    def add(name: str, help: str):
        return sub.add_parser(name, help=help, description=help, parents=[common])

    s = add("init-default", help="build the embedded default model and print its folder")
    s.set_defaults(fn=cmd_init_default)

    s = add("demo", help="KV injection vs full prefill side by side (TTFT, identical outputs)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--max-tokens", type=positive(), default=24,
                   help="tokens generated per answer (default: %(default)s)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.set_defaults(fn=cmd_demo)

    s = add("generate", help="generate a completion for a prompt (a plain dense-cache run, no engine)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--prompt", required=True, help="the prompt text")
    s.add_argument("--max-tokens", type=positive(), default=32, help="tokens to generate (default: %(default)s)")
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
    s.add_argument("--batch", type=positive(), default=64,
                   help="documents computed per device step (default: %(default)s)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64],
                   help="KV page size; must match the server's (default: %(default)s)")
    s.add_argument("--tensor-parallel", type=positive(), default=1, metavar="N",
                   help="split the model and its KV pool over N devices of this host (default: %(default)s)")
    s.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                   help="compressed KV pages, a float32 scale per token and head (default: the model's dtype)")
    s.set_defaults(fn=cmd_precompute)

    s = add("serve", help="OpenAI-compatible HTTP server with segments, tenants, streaming, metrics")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model ids clients may send and /v1/models lists, the first shown in responses "
                        "(default: the --model folder's name; the embedded default model: inferscale-default "
                        "inferscale)")
    s.add_argument("--model-name", help=argparse.SUPPRESS)  # deprecated: one --served-model-name
    s.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template text) replacing the tokenizer's")
    s.add_argument("--tool-call-parser", choices=["llama3_json", "hermes", "mistral"],
                   help="how chat tool calls are read from the model's output with tool_choice auto (default: by "
                        "the model's architecture: Llama llama3_json, Mistral mistral, others hermes)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    s.add_argument("--port", type=port, default=8000, help="1-65535, bound before the model loads "
                   "(default: %(default)s)")
    s.add_argument("--api-keys", metavar="FILE", help="JSON/TOML mapping key -> tenant or "
                   "{tenant, admin}; without it: one tenant 'default', no auth")
    s.add_argument("--snapshot-dir", help="durable segments + KV snapshots (restored at startup)")
    s.add_argument("--strict-restore", action="store_true",
                   help="refuse to start on a snapshot of another model/dtype/page size (default: start empty)")
    s.add_argument("--snapshot-interval", type=positive(float), default=300.0,
                   help="seconds between periodic snapshots with --snapshot-dir (default: %(default)s)")
    s.add_argument("--repair", action="store_true",
                   help="with --snapshot-dir: when the segment registry lost acknowledged writes that neither its "
                        "journal nor the newest snapshot can redo, or fails its check, rebuild it from the snapshot "
                        "and the journal and log each lost write by id (default: refuse to start, naming them)")
    s.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    s.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64],
                   help="KV page size; must match the one precompute used (default: %(default)s)")
    s.add_argument("--hbm-pages", type=positive(), help="KV pool pages (default: sized from free device memory)")
    s.add_argument("--host-pages", type=positive(), help="host-memory KV tier capacity in pages; past it segments "
                   "go to the disk tier under --snapshot-dir (default: 4x the pool, at most 1/4 of RAM)")
    s.add_argument("--tensor-parallel", type=positive(), default=1, metavar="N",
                   help="split the model and its KV pool over N devices of this host (default: %(default)s)")
    s.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                   help="compressed KV pages, a float32 scale per token and head (default: the model's dtype)")
    s.add_argument("--max-batch", type=positive(), default=None,
                   help="sequences per device step (default: 256 on a GPU/TPU, 64 on the CPU, fewer when the KV "
                        "pool holds less than 1024 tokens per sequence: the CPU's 64 MiB pool gives the embedded "
                        "default model 15; /v1/stats shows it)")
    s.add_argument("--max-num-batched-tokens", type=positive(), default=None,
                   help="new tokens per device step, prefill chunks and decode rows together "
                        "(default: max(max-batch, 2048))")
    s.add_argument("--decode-steps", type=positive(int, 64), default=1, metavar="N",
                   help="multi-step decode (vLLM's --num-scheduler-steps): a step of decode rows only runs N decode "
                        "steps in one device loop, stops checked on the device (default: %(default)s; at most 64)")
    s.add_argument("--session-ttl", type=positive(float), default=3600.0, metavar="SECONDS",
                   help="chat sessions (conversation memory) expire this long after their last turn "
                        "(default: %(default)s)")
    s.add_argument("--max-sessions-per-tenant", type=positive(), default=100,
                   help="a tenant's sessions at most; one more deletes its least recently used (default: %(default)s)")
    s.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several processes (hosts), one mesh: process 0's address for jax.distributed; process 0 "
                        "serves HTTP, the others follow it (docs/architecture.md)")
    s.add_argument("--num-processes", type=int, default=None, help="processes of the mesh (with --coordinator)")
    s.add_argument("--process-id", type=int, default=None, help="this process's index, 0 serves (with --coordinator)")
    s.add_argument("--api-server-count", type=positive(), default=1,
                   help="HTTP processes (parsing, tokenization, SSE) over the one engine core process "
                        "(inferscale_jax/engine_core.py); they share the port (default: %(default)s)")
    s.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the HTTP process instead of in its own core process "
                        "(the single-process layout; always so with --coordinator)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up (compiling the step buckets: on the CPU the small set, on a GPU/TPU "
                        "every one) at startup; the first requests then compile")
    s.add_argument("--first-runs", choices=("idle", "now"), default="idle",  # (Engine.warmup's FIRST_RUNS)
                   help="on a GPU/TPU each step bucket's first run sets up what later runs reuse (~80 ms a bucket "
                        "for an 8B model): 'idle' makes them after /health turns 200, while no request is "
                        "running (the fastest start; a bucket first met under load pays its run inside that step, "
                        "stalling its streams once), 'now' in the warm-up (a start ~0.1 s a bucket longer; no "
                        "stall later: for replicas that get traffic as soon as they are ready) (default: "
                        "%(default)s)")
    s.add_argument("--max-waiting", type=positive(), default=None,
                   help="queued requests beyond which new ones get 503 + Retry-After (default: from the KV pool "
                        "and max-batch: serving/app.py, auto_max_waiting)")
    s.add_argument("--max-waiting-per-tenant", type=positive(), default=None,
                   help="one tenant's queued requests beyond which its new ones get 429 + Retry-After while other "
                        "tenants are served (default: half of --max-waiting when the key file names several "
                        "tenants with non-admin keys, else all of it; per API-server process)")
    s.add_argument("--tenant-reserve", type=float, default=None, metavar="FRACTION",
                   help="share of --max-batch's rows no single tenant may hold, kept so another tenant's request "
                        "starts at the next step while one floods (default: 0.125 when the key file names several "
                        "tenants with non-admin keys, else 0)")
    s.add_argument("--max-body-bytes", type=positive(), default=2 << 20,
                   help="request body limit (default: %(default)s)")
    s.add_argument("--body-timeout", type=positive(float), default=30.0,
                   help="seconds a request body may take to arrive, then 408 (default: %(default)s)")
    s.add_argument("--head-timeout", type=positive(float), default=10.0, metavar="SECONDS",
                   help="a connection's request line and headers must arrive within this, else it is closed "
                        "(slow clients holding connections; serving/connections.py) (default: %(default)s)")
    s.add_argument("--max-connections-per-client", type=positive(), default=1024, metavar="N",
                   help="open connections one client address may hold (per API-server process); behind a reverse "
                        "proxy raise it to the proxy's connection count (default: %(default)s)")
    s.add_argument("--default-max-tokens", type=positive(), default=256,
                   help="max_tokens of a chat request that sets none (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="level of the server's own log lines (default: %(default)s)")
    s.add_argument("--log-requests", action="store_true",
                   help="log one JSON line per HTTP request (logger inferscale.server; /health and /metrics "
                        "never); default: off")
    s.set_defaults(fn=cmd_serve)

    s = add("bench", help="run a benchmark of the source tree's bench/ folder (serve: the HTTP server under "
                          "load, bench/serving/serve.py; results as bench/NOTES.md describes)")
    s.add_argument("benchmark", choices=["serve"], help="which benchmark")
    s.add_argument("args", nargs=argparse.REMAINDER, help="its options (inferscale bench serve --help)")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    quiet_third_party()
    args = build_parser().parse_args(argv)
    if argv is None and args.command != "bench":  # the process's own command (not a caller's), no benchmark
        hide_torch()
    logging.getLogger("inferscale.snapshot").addFilter(SnapshotHint())
    try:
        validate(args)
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
