"""Tiny random HF checkpoints for the reference tests, built locally (no network)."""

from __future__ import annotations

import os

import torch
import transformers

BASE = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, model class, overrides)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, rope_theta=1e6)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3_qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
    "tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "gqa_1to1": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "gqa_4to1": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),
    "head_dim_ne": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=24)),
    # tensor parallelism: 8 q / 4 kv heads of 16 and an MLP of 96 split over 1, 2 or 4 devices, a
    # vocab of 256 split too (test_tensor_parallel.py)
    "tp": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=256, num_attention_heads=8, num_key_value_heads=4,
                                                   head_dim=16)),
}


def build_hf_model(name: str, out_dir: str, dtype=torch.float32, seed: int = 0,
                   max_shard_size: str | None = None):
    """Create a tiny random model of variant ``name``, save it to ``out_dir``; return the model."""
    cfg_cls, model_cls, overrides = VARIANTS[name]
    kwargs = {**BASE, **overrides}
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missing one is caught
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(out_dir, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    return model
