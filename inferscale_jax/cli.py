"""The ``inferscale`` command line.

Every command takes ``--model DIR`` (an HF checkpoint folder: config.json, *.safetensors,
tokenizer files); without it, the embedded default model is used (built locally on first use).

    inferscale init-default              build the default model and print its folder
    inferscale generate --prompt TEXT    generate a completion (dense KV cache)
    inferscale demo                      KV injection vs full prefill: TTFT and identical outputs
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
