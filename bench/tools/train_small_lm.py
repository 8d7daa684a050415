"""Train a small Llama-architecture language model on English text every machine has offline, for
quality measurements that random weights cannot give (compressed KV, compose / blend).

Usage (from the repository root)::

    python bench/tools/train_small_lm.py /tmp/small-lm                  # H200: 8 layers, hidden 512, ~5 min
    python bench/tools/train_small_lm.py /tmp/small-lm-q --quick        # CPU: a tiny model, a few steps
    python bench/tools/train_small_lm.py /tmp/small-lm --seq 2048 --batch 16 --steps 900 --max-seconds 150
                                                                  # H200, 2048-token windows, inside a time limit
    python bench/kernels/kv_dtype.py --model /tmp/small-lm --sections b   # then: quality with a trained model

Text: Python's own documentation that ships with the interpreter - ``pydoc_data.topics`` (the
language reference topics) and the docstrings of every importable standard-library module and
installed package (``pydoc``-style walk), several MB of English; 2% of the documents held out.
Tokenizer: a byte-level BPE trained on that text (``tokenizers``; vocab ``--vocab``, default 8192).
Model: ``--layers`` 8, ``--hidden`` 512, 8 q / 4 kv heads of 64, MLP 1408, RoPE theta 10000; trained
with AdamW (optax; warm-up then cosine decay) on ``--seq``-token windows (default 512), bf16 matmuls,
fp32 master weights, ``models.forward`` with a dense KV cache (the model the engine serves).
Writes an HF checkpoint (``config.json``, ``model.safetensors``, the tokenizer) to the output folder
(keep it out of git) and prints the held-out perplexity, also written to ``train.md`` there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]  # the engine's packages; bench/lib/ (report, common)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def corpus(limit_bytes: int) -> list[str]:
    """Documents: pydoc_data's topics, then module / class / function docstrings."""
    from pydoc_data.topics import topics

    docs = [t for t in topics.values() if len(t) > 200]
    seen = set()
    total = sum(map(len, docs))
    names = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if total >= limit_bytes:
                break
            if name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo") or name in seen:
                continue
            seen.add(name)
            try:
                mod = importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - anything may fail to import; skip it
                continue
            for obj in [mod, *vars(mod).values()]:
                doc = getattr(obj, "__doc__", None)
                if isinstance(doc, str) and len(doc) > 200 and doc not in docs[-50:]:
                    docs.append(doc)
                    total += len(doc)
    return docs


def train_tokenizer(docs: list[str], vocab: int, out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|pad|>", "<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(out)
    return fast


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps (CPU)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--corpus-mb", type=float, default=24.0)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop training after this many seconds of steps, then evaluate and save (a time-limited "
                         "device call keeps a model; the summary says how many steps ran)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.hidden, args.vocab, args.seq, args.batch, args.steps, args.corpus_mb = 2, 64, 512, 64, 8, 30, 1.0
    import optax
    from safetensors.numpy import save_file

    from models import DenseKVCache, ModelConfig, forward, init_params
    from models.params import to_hf_tensors

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    docs = corpus(int(args.corpus_mb * 2**20))
    rng = np.random.default_rng(0)
    rng.shuffle(docs)
    n_held = max(1, len(docs) // 50)
    tok = train_tokenizer(docs, args.vocab, out)
    eos = tok.eos_token_id

    def stream(ds):
        ids = []
        for d in ds:
            ids.extend(tok(d).input_ids + [eos])
        return np.asarray(ids, np.int32)

    held, train = stream(docs[:n_held]), stream(docs[n_held:])
    print(f"corpus: {len(docs)} documents, {len(train) / 1e6:.2f}M train / {len(held) / 1e3:.0f}k held-out tokens, "
          f"{time.time() - t0:.0f} s", flush=True)
    heads = max(2, args.hidden // 64)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tok),
          "hidden_size": args.hidden, "intermediate_size": int(args.hidden * 2.75) // 64 * 64,
          "num_hidden_layers": args.layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
          "head_dim": args.hidden // heads, "hidden_act": "silu", "max_position_embeddings": 8192,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
          "mlp_bias": False, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": tok.pad_token_id,
          "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_hf_dict(hf)
    params = init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.float32, scale=0.02)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 20), args.steps, args.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))
    state = opt.init(params)

    def loss_fn(p, x):
        b, t = x.shape
        pb = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), p)
        cache = DenseKVCache.create(cfg, b, t, jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _ = forward(pb, cfg, x[:, :-1], pos[:, :-1], cache)
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(lp, x[:, 1:, None], -1))

    @jax.jit
    def step(p, s, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    eval_loss = jax.jit(loss_fn)

    def batch(data, n, r):
        starts = r.integers(0, len(data) - args.seq - 1, n)
        return jnp.asarray(np.stack([data[i:i + args.seq + 1] for i in starts]))

    t1 = time.time()
    done = 0
    for i in range(args.steps):
        params, state, loss = step(params, state, batch(train, args.batch, rng))
        done = i + 1
        if i % max(1, args.steps // 20) == 0 or i == args.steps - 1:
            print(f"step {i:5d}  loss {float(loss):.3f}  {time.time() - t1:.0f} s", flush=True)
        if args.max_seconds is not None and time.time() - t1 > args.max_seconds:
            print(f"stopped after step {i} of {args.steps}: --max-seconds {args.max_seconds:g}", flush=True)
            break
    er = np.random.default_rng(1)
    held_loss = float(np.mean([float(eval_loss(params, batch(held, args.batch, er))) for _ in range(8)]))
    ppl = float(np.exp(held_loss))
    tensors = {k: np.asarray(v, np.float32).astype(jnp.bfloat16) for k, v in to_hf_tensors(cfg, params).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    summary = (f"# Small LM\n\n- {n_params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}, vocab "
               f"{len(tok)}), {done} steps of {args.batch} x {args.seq} tokens (of {args.steps} planned), "
               f"{time.time() - t1:.0f} s on "
               f"{jax.devices()[0].device_kind}\n- held-out loss {held_loss:.3f}, perplexity {ppl:.1f}\n")
    with open(os.path.join(out, "train.md"), "w") as f:
        f.write(summary)
    print(summary + f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
