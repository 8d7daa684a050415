"""The embedded default model: a small Llama checkpoint made locally, offline, deterministically.

``default_model_dir()`` returns a checkpoint folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``), building it on first use in the user cache
(``$INFERSCALE_CACHE`` or ``~/.cache/inferscale``).  Everything in it is a pure function of
this file and ``data/corpus.txt``:

- the tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the shipped
  corpus (so any text round-trips), with special tokens for padding, end of text and the chat
  roles, and a chat template;
- the weights are seeded NumPy normal draws (float32; projections scaled by 1/sqrt(fan_in) so
  activations and logits stay O(1) and greedy output varies with the context), written with
  safetensors.

Building twice gives byte-identical files, so the model's fingerprint (and every prefix-cache
key derived from it) is the same on every machine.  The folder is written to a temporary
sibling and renamed into place, so a crash never leaves half a model behind.  The weights are
random: the model's text is gibberish, but every code path (tokenize, prefill, inject, decode)
is real.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources

import numpy as np

from models.config import ModelConfig
from models.params import hf_split_sizes, param_specs

VERSION = "v2"
SEED = 20261130
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": None,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def cache_root() -> str:
    return os.environ.get("INFERSCALE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "inferscale")


def default_model_dir(root: str | None = None) -> str:
    """The default model's folder, built on first use."""
    path = os.path.join(root or cache_root(), f"default-model-{VERSION}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        build_default_model(path)
    return path


def build_default_model(path: str) -> str:
    """Write the default checkpoint to ``path`` (atomically: temp folder, then rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".default-model-", dir=parent)
    try:
        _write_tokenizer(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(HF_CONFIG, f, indent=2, sort_keys=True)
        _write_weights(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first: keep theirs (identical bytes)
            if not os.path.exists(os.path.join(path, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _corpus_lines() -> list[str]:
    text = resources.files("inferscale_jax").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _write_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=HF_CONFIG["vocab_size"], special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE, model_max_length=HF_CONFIG["max_position_embeddings"])
    fast.save_pretrained(out)


def _write_weights(out: str) -> None:
    from safetensors.numpy import save_file

    cfg = ModelConfig.from_hf_dict(HF_CONFIG)
    rng = np.random.default_rng(SEED)
    tensors = {}
    for s in param_specs(cfg):
        for name, size in zip(s.hf_names, hf_split_sizes(cfg, s)):
            shape = (size,) + s.shape[:-1][::-1] if s.transpose else s.shape[:-1] + (size,)
            if s.init == "ones":
                tensors[name] = np.ones(shape, np.float32)
            else:  # unit-variance activations: embeddings N(0, 1), projections N(0, 1/fan_in)
                std = 1.0 if s.path == ("embed",) else s.shape[0] ** -0.5
                tensors[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
