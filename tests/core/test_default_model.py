"""The embedded default model: deterministic, offline, usable from the CLI."""

import filecmp
import os
import subprocess
import sys

import jax.numpy as jnp

from inferscale_jax.default_model import build_default_model, default_model_dir
from inferscale_jax.tokenizer import load_tokenizer
from models import ModelConfig, load_params


def test_builds_byte_identical_and_loads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = build_default_model(str(tmp_path / "a"))
    b = build_default_model(str(tmp_path / "b"))
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == [], f"files differ between builds: {mismatch + errors}"

    cfg = ModelConfig.from_pretrained(a)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_kv_heads < cfg.num_heads
    params = load_params(a, cfg, jnp.float32)
    assert params["embed"].shape == (cfg.vocab_size, cfg.hidden_size)
    tok = load_tokenizer(a)
    text = "Q: How long is the warranty? Ünïcödé ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < cfg.vocab_size
    assert tok.decode(ids) == text  # byte-level BPE round-trips any text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi<|endoftext|><|assistant|>"


def test_cli_generate_uses_default_model(tmp_path):
    env = {**os.environ, "INFERSCALE_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    run = lambda: subprocess.run(
        [sys.executable, "-m", "inferscale_cli", "generate", "--prompt", "How long is the warranty?",
         "--max-tokens", "8"], env=env, capture_output=True, text=True, timeout=300)
    first, second = run(), run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip(), "generate printed no completion"
    assert "prompt tokens" in first.stderr and "generated" in first.stderr
    assert first.stdout == second.stdout  # greedy and deterministic
    assert os.path.isdir(default_model_dir(str(tmp_path)))
