"""Our functional model against the HF PyTorch model on the same tiny random weights (fp32)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.support.hf_tiny import VARIANTS, build_hf_model
from inferscale_jax.dense_generate import generate_dense
from inferscale_jax.sampling import SamplingParams
from models import DenseKVCache, ModelConfig, forward, load_params


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    hf = build_hf_model(request.param, d)
    cfg = ModelConfig.from_pretrained(d)
    return request.param, hf, cfg, load_params(d, cfg, jnp.float32)


def test_logits_match_hf(variant, record_property):
    name, hf, cfg, params = variant
    rng = np.random.default_rng(1)
    toks = rng.integers(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        ref = hf(torch.tensor(toks)).logits.numpy()
    pos = np.broadcast_to(np.arange(37), (2, 37))
    logits, _ = forward(params, cfg, jnp.asarray(toks), jnp.asarray(pos),
                        DenseKVCache.create(cfg, 2, 64, jnp.float32))
    err = float(np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max())
    record_property("max_rel_logit_err", err)
    print(f"\n{name}: max|ours-hf|/max|hf| = {err:.3e}")
    assert logits.shape == ref.shape
    assert err < 1e-4, f"{name}: logits differ from HF by {err:.3e} (limit 1e-4)"


def test_greedy_tokens_match_hf(variant):
    name, hf, cfg, params = variant
    prompt = list(np.random.default_rng(2).integers(3, cfg.vocab_size, 11))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    ours, _ = generate_dense(params, cfg, prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert ours == ids[len(prompt):], f"{name}: greedy tokens differ from HF"


def test_config_accepts_legacy_and_v5_rope_spellings(tmp_path):
    build_hf_model("llama3_rope", str(tmp_path))
    d = json.loads((tmp_path / "config.json").read_text())
    v5 = ModelConfig.from_hf_dict(d)
    legacy = dict(d)
    rp = legacy.pop("rope_parameters", None) or {}
    legacy["rope_theta"] = rp.pop("rope_theta", 500000.0)
    legacy["rope_scaling"] = {**rp, "type": rp.pop("rope_type", "llama3")}
    old = ModelConfig.from_hf_dict(legacy)
    assert old == v5
    assert v5.rope.type == "llama3" and v5.rope.factor == 8.0 and v5.rope.theta == 500000.0
