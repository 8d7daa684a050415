"""Write a Llama-3-8B-shaped (or ``--shape 70b``) HF checkpoint of random bf16 weights, for benchmarks that
load a model folder (``bench/serving/serve.py --model``): ``config.json``, sharded
``model-0000i-of-0000n.safetensors`` + index, and the embedded default model's tokenizer with
one vocabulary entry ``<tN>`` for every id past its own, so each id the model can sample decodes to
text (a streamed reply then has one text chunk per token, as a real model's has; without them
most ids decode to nothing and a client's time to first text is not the time to first token).
The text is gibberish either way; the shapes are real.

Weights are drawn with torch on the GPU when there is one (an 8B model in seconds), scaled like
the default model's (embeddings N(0, 1), projections N(0, 1/fan_in), norms 1), and written a
shard of ~4 GB at a time.  Not for git: 16 GB.

    python bench/tools/make_checkpoint.py /tmp/llama8b-random      # then: bench/serving/serve.py --model ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

from common import LLAMA3_70B, model_config, shape  # noqa: E402  (bench/lib/common.py: the shapes)
from inferscale_jax.default_model import HF_CONFIG, default_model_dir  # noqa: E402
from models.params import hf_split_sizes, param_specs  # noqa: E402

SHARD_BYTES = 4 << 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true", help="the tiny bench shape (CPU: the harness only)")
    ap.add_argument("--shape", choices=["8b", "70b"], default="8b", help="Llama-3 shape (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None,
                    help="fewer layers than the shape has (a load-time probe of a model too big for the disk)")
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    sh = shape(args.quick) if args.shape == "8b" or args.quick else dict(LLAMA3_70B)
    if args.layers:
        sh = dict(sh, layers=args.layers)
    cfg = model_config(sh)
    os.makedirs(args.out, exist_ok=True)
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast.from_pretrained(default_model_dir()).save_pretrained(args.out)
    # the vocabulary grows to the model's inside the BPE model, as a real Llama-3 tokenizer's 128k
    # entries are (its added tokens are ~256 specials): 128k *added* tokens took a serve start
    # ~17 s more to load (bench/NOTES.md, run AL)
    path = os.path.join(args.out, "tokenizer.json")
    with open(path) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    vocab.update({f"<t{i}>": i for i in range(max(vocab.values()) + 1, sh["vocab"])})
    with open(path, "w") as f:
        json.dump(tj, f, ensure_ascii=False)
    hf = dict(HF_CONFIG, vocab_size=sh["vocab"], hidden_size=sh["hidden"], intermediate_size=sh["inter"],
              num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"], num_key_value_heads=sh["kv"],
              head_dim=sh["head_dim"], max_position_embeddings=sh["max_pos"], rms_norm_eps=sh["eps"],
              rope_theta=sh["theta"], torch_dtype="bfloat16")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    shards, cur, cur_bytes = [], {}, 0

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            shards.append(cur)
            cur, cur_bytes = {}, 0

    tensors = []
    for s in param_specs(cfg):
        for name, size in zip(s.hf_names, hf_split_sizes(cfg, s)):
            shp = (size,) + s.shape[:-1][::-1] if s.transpose else s.shape[:-1] + (size,)
            tensors.append((name, shp, s.init, 1.0 if s.path == ("embed",) else s.shape[0] ** -0.5))
    names_per_shard, weight_map = [], {}
    for name, shp, init, std in tensors:
        nbytes = 2 * int(torch.tensor(shp).prod())
        if cur_bytes and cur_bytes + nbytes > SHARD_BYTES:
            names_per_shard.append(list(cur))
            flush()
        cur[name] = (shp, init, std)
        cur_bytes += nbytes
    names_per_shard.append(list(cur))
    flush()
    n = len(shards)
    total = 0
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        out = {}
        for name, (shp, init, std) in shard.items():
            if init == "ones":
                t = torch.ones(shp, dtype=torch.bfloat16, device=dev)
            else:
                t = (torch.randn(shp, generator=gen, device=dev, dtype=torch.float32) * std).to(torch.bfloat16)
            out[name] = t.cpu()
            weight_map[name] = fn
            total += out[name].numel() * 2
        save_file(out, os.path.join(args.out, fn), metadata={"format": "pt"})
        print(f"[{time.perf_counter() - t0:6.1f} s] wrote {fn}", flush=True)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print(f"{args.out}: {total / 1e9:.1f} GB in {n} shards, {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
