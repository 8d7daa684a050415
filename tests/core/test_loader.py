"""Checkpoint loading: sharded files, dtype conversion, and clear errors."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tests.support.hf_tiny import build_hf_model
from models import CheckpointError, ModelConfig, UnsupportedModelError, load_params, to_hf_tensors



def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    build_hf_model("qwen2_bias", single)
    build_hf_model("qwen2_bias", sharded, max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    cfg = ModelConfig.from_pretrained(single)
    a = to_hf_tensors(cfg, load_params(single, cfg, jnp.float32))
    b = to_hf_tensors(cfg, load_params(sharded, cfg, jnp.float32))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_params_equal_file_tensors(tmp_path):
    build_hf_model("llama", str(tmp_path))
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = to_hf_tensors(cfg, load_params(str(tmp_path), cfg, jnp.float32))
    ref = load_file(str(tmp_path / "model.safetensors"))
    for k, v in ours.items():
        np.testing.assert_array_equal(v, ref[k], err_msg=k)


@pytest.mark.parametrize("workers,budget", [(1, None), (4, None), (4, 1)])
def test_tensors_read_several_at_a_time_equal_the_files(tmp_path, monkeypatch, workers, budget):
    """``load_params(workers=...)``: one tensor at a time or four on a thread pool, every leaf
    equals the file's tensor (a sharded checkpoint: tensors of several files at once); with an
    in-flight budget smaller than any tensor, each goes alone and the load still completes."""
    import models.loader

    if budget is not None:
        monkeypatch.setattr(models.loader, "IN_FLIGHT_BYTES", budget)
    build_hf_model("llama", str(tmp_path), max_shard_size="100KB")
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = to_hf_tensors(cfg, load_params(str(tmp_path), cfg, jnp.float32, workers=workers))
    ref = {}
    for f in sorted(os.listdir(tmp_path)):
        if f.endswith(".safetensors"):
            ref.update(load_file(str(tmp_path / f)))
    assert ours.keys() <= ref.keys()
    for k, v in ours.items():
        np.testing.assert_array_equal(v, ref[k], err_msg=k)


@pytest.mark.parametrize("stored,wanted", [(torch.bfloat16, jnp.float32), (torch.float32, jnp.bfloat16)])
def test_dtype_conversion(tmp_path, stored, wanted):
    build_hf_model("llama", str(tmp_path), dtype=stored)
    cfg = ModelConfig.from_pretrained(tmp_path)
    params = load_params(str(tmp_path), cfg, wanted)
    assert {x.dtype for x in jax_leaves(params)} == {jnp.dtype(wanted)}
    ref = load_file(str(tmp_path / "model.safetensors"))
    ours = to_hf_tensors(cfg, params)
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        np.testing.assert_allclose(ours[k].astype(np.float32), ref[k].astype(np.float32), rtol=1e-2, atol=1e-3)


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


def test_missing_tensor_is_named(tmp_path):
    build_hf_model("llama", str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_params(str(tmp_path), cfg)


def test_wrong_shape_is_named(tmp_path):
    build_hf_model("llama", str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((5, 64), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*\(5, 64\).*expected"):
        load_params(str(tmp_path), cfg)


def test_unsupported_architecture_and_rope_are_named(tmp_path):
    build_hf_model("llama", str(tmp_path))
    d = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({**d, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "int32", "int64", "bool",
                                   "float8_e4m3fn", "float8_e5m2"])
def test_the_file_reader_equals_safetensors(tmp_path, dtype):
    """``FileTensors`` (the loader's reader: positional reads of the file into fresh arrays) gives
    every tensor exactly as written and as safetensors' own reader does, empty and scalar ones
    included."""
    from safetensors import safe_open

    from models.loader import FileTensors

    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    tensors = {f"t{i}": rng.normal(size=shape).astype(np.float32).astype(dt) if dt != np.bool_
               else np.asarray(rng.random(shape) < 0.5)
               for i, shape in enumerate([(3, 5), (7,), (0, 4), (), (2, 3, 4)])}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    ours = FileTensors(path)
    with safe_open(path, framework="numpy") as ref:
        for name, src in tensors.items():
            got = ours.get_tensor(name)
            assert got.dtype == src.dtype and got.shape == src.shape and got.tobytes() == src.tobytes(), name
            assert got.base is None and got.flags.writeable, name  # (a fresh array of its own)
            if not dtype.startswith("float8"):  # (safetensors' numpy reader has no name for them)
                want = ref.get_tensor(name)
                assert want.dtype == got.dtype and want.tobytes() == got.tobytes(), name
    ours.close()


def test_a_tensor_whose_byte_range_disagrees_with_its_shape_is_named(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file({"w": np.zeros((4, 4), np.float32)}, path)
    raw = bytearray(open(path, "rb").read())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"shape":[4,4]', b'"shape":[4,5]')
    assert len(header) == n
    open(path, "wb").write(bytes(raw[:8] + header + raw[8 + n:]))
    from models.loader import FileTensors

    with pytest.raises(CheckpointError, match=r"'w' in m.safetensors: 64 bytes for F32 \[4, 5\]"):
        FileTensors(path).get_tensor("w")


def test_a_file_cut_short_is_named(tmp_path):
    from models.loader import FileTensors

    path = str(tmp_path / "m.safetensors")
    save_file({"w": np.ones((64, 64), np.float32)}, path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"'w' in m.safetensors: the file ends 100 bytes early"):
        FileTensors(path).get_tensor("w")
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        FileTensors(path)
    with open(path, "wb") as f:  # a header length past the file's end (garbage bytes)
        f.write((1 << 60).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        FileTensors(path)
