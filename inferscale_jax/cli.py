"""The ``inferscale`` command line.

Every command takes ``--model DIR`` (an HF checkpoint folder: config.json, *.safetensors,
tokenizer files); without it, the embedded default model is used (built locally on first use).

    inferscale init-default              build the default model and print its folder
    inferscale generate --prompt TEXT    generate a completion (dense KV cache)
    inferscale precompute CORPUS --snapshot-dir DIR   a corpus -> segments + snapshot (precompute.py)
    inferscale demo                      KV injection vs full prefill: TTFT and identical outputs
    inferscale serve [--port N] [--api-keys FILE] [--snapshot-dir DIR]   the HTTP server (serving/)
"""

from __future__ import annotations

import argparse
import sys


def _model_dir(args) -> str:
    from inferscale_jax.default_model import default_model_dir

    return args.model or default_model_dir()


def cmd_init_default(args) -> int:
    from inferscale_jax.default_model import default_model_dir

    print(default_model_dir())
    return 0


def cmd_generate(args) -> int:
    import jax.numpy as jnp

    from inferscale_jax.dense_generate import generate_dense
    from inferscale_jax.sampling import SamplingParams
    from inferscale_jax.tokenizer import load_tokenizer
    from models import ModelConfig, load_params

    model_dir = _model_dir(args)
    cfg = ModelConfig.from_pretrained(model_dir)
    dtype = jnp.dtype(args.dtype)
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

    return 0 if run_demo(args.model, max_tokens=args.max_tokens) else 1


def cmd_precompute(args) -> int:
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.engine import Engine
    from inferscale_jax.precompute import precompute

    config = EngineConfig(dtype=args.dtype, page_size=args.page_size, snapshot_dir=args.snapshot_dir,
                          max_batch=args.batch)
    with Engine.from_pretrained(_model_dir(args), config) as engine:
        res = precompute(engine, args.corpus, tenant=args.tenant, public=args.public, batch=args.batch)
    print(res.summary())
    return 0


def cmd_serve(args) -> int:
    """The HTTP server (``serving/``) over one engine, with uvicorn; a final snapshot on shutdown."""
    import logging
    import os

    import uvicorn

    from inferscale_jax.async_engine import AsyncEngine
    from inferscale_jax.config import EngineConfig
    from inferscale_jax.engine import Engine
    from serving import create_app, load_api_keys

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s", force=True)
    logging.getLogger("jax").setLevel(logging.WARNING)
    keys = load_api_keys(args.api_keys) if args.api_keys else None  # fail before loading the model
    if keys is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without --api-keys: anyone who can reach it is tenant 'default'",
              file=sys.stderr)
    extra = {}
    if args.snapshot_dir:
        extra = dict(snapshot_dir=args.snapshot_dir, strict_restore=args.strict_restore,
                     snapshot_interval_s=args.snapshot_interval)
    config = EngineConfig(dtype=args.dtype, page_size=args.page_size, hbm_pages=args.hbm_pages,
                          max_batch=args.max_batch, **extra)
    engine = Engine.from_pretrained(args.model, config)
    name = args.model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else "inferscale-default")
    async_engine = AsyncEngine(engine)
    try:
        app = create_app(async_engine, api_keys=keys, max_body_bytes=args.max_body_bytes,
                         max_waiting=args.max_waiting, model_name=name)
        print(f"serving {name} on http://{args.host}:{args.port} "
              f"({len(keys) if keys else 'no'} API keys)", file=sys.stderr, flush=True)
        # log_config=None: uvicorn keeps the logging set up above (its own dictConfig would drop
        # the root handler that prints the per-request lines of ``inferscale.server``)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    log_config=None)
    finally:
        async_engine.shutdown()
        engine.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferscale", description="InferScale-JAX: serving by KV injection")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-default", help="build the embedded default model and print its folder")
    s.set_defaults(fn=cmd_init_default)

    s = sub.add_parser("demo", help="KV injection vs full prefill side by side (TTFT, identical outputs)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--max-tokens", type=int, default=24)
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("generate", help="generate a completion for a prompt")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("precompute", help="store every document of a corpus as a segment (batched prefill), "
                                          "then snapshot")
    s.add_argument("corpus", help="JSONL file (one {\"id\", \"text\"} object per line) or a folder of .txt/.md "
                                  "files (id = relative path)")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--snapshot-dir", required=True, help="where segments and KV snapshots are kept (serve reads it)")
    s.add_argument("--tenant", default="default", help="namespace of the segments (default: %(default)s)")
    s.add_argument("--public", action="store_true", help="register public segments (readable by every tenant)")
    s.add_argument("--batch", type=int, default=64, help="documents computed per device step (default: %(default)s)")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="KV dtype; must match the server's (default: %(default)s)")
    s.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64],
                   help="KV page size; must match the server's (default: %(default)s)")
    s.set_defaults(fn=cmd_precompute)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with segments, tenants, streaming, metrics")
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded default model)")
    s.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: folder name)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-keys", metavar="FILE", help="JSON/TOML mapping key -> tenant or "
                   "{tenant, admin}; without it: one tenant 'default', no auth")
    s.add_argument("--snapshot-dir", help="durable segments + KV snapshots (restored at startup)")
    s.add_argument("--strict-restore", action="store_true",
                   help="refuse to start on a snapshot of another model/dtype/page size (default: start empty)")
    s.add_argument("--snapshot-interval", type=float, default=300.0,
                   help="seconds between periodic snapshots with --snapshot-dir (default: %(default)s)")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    s.add_argument("--page-size", type=int, default=16, choices=[8, 16, 32, 64])
    s.add_argument("--hbm-pages", type=int, help="KV pool pages (default: sized from free device memory)")
    s.add_argument("--max-batch", type=int, default=64, help="sequences per device step (default: %(default)s)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond which new ones get 503 + Retry-After (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=2 << 20, help="request body limit (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(fn=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
