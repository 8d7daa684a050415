"""Load HF ``*.safetensors`` checkpoints straight into the parameter pytree (no torch).

Files: a single ``model.safetensors``, a sharded set listed by ``model.safetensors.index.json``
(its ``weight_map`` names the file of every tensor), or any ``*.safetensors`` in the folder.
Each tensor named by ``param_specs`` is read with safetensors' numpy API (bf16 arrives as
``ml_dtypes.bfloat16``), checked against its expected shape, moved to the device, then
transposed and cast there (one jitted op per tensor, so large models are not transposed on
the host).  A missing tensor or a wrong shape raises ``CheckpointError`` naming the tensor.
Tensors the model does not use (``rotary_emb.inv_freq``, a tied ``lm_head``) are ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
from safetensors import safe_open

from models.config import ModelConfig
from models.params import assemble, hf_split_sizes, param_specs


class CheckpointError(ValueError):
    """A checkpoint file is missing a tensor or holds one of the wrong shape."""


def safetensors_files(model_dir: str) -> dict[str, str]:
    """Map every tensor name to the file that holds it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, fn) for name, fn in weight_map.items()}
    files = sorted(fn for fn in os.listdir(model_dir) if fn.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {model_dir}")
    out = {}
    for fn in files:
        path = os.path.join(model_dir, fn)
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                out[name] = path
    return out


@functools.partial(jax.jit, static_argnames=("transpose", "dtype"))
def _place(parts: list[jax.Array], *, transpose: bool, dtype) -> jax.Array:
    """HF tensors -> one leaf: concatenate along the output axis, transpose, cast (on device)."""
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0 if transpose else -1)
    x = x.T if transpose else x
    return x.astype(dtype)


def load_params(model_dir: str, cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Read the checkpoint in ``model_dir`` into the pytree of ``param_specs(cfg)``."""
    where = safetensors_files(model_dir)
    specs = param_specs(cfg)
    for s in specs:
        for name in s.hf_names:
            if name not in where:
                raise CheckpointError(
                    f"tensor {name!r} (for {'.'.join(map(str, s.path))} {s.shape}) is missing from "
                    f"the checkpoint in {model_dir}")
    handles = {}
    try:
        for path in sorted({where[n] for s in specs for n in s.hf_names}):
            handles[path] = safe_open(path, framework="numpy").__enter__()
        leaves = {}
        for s in specs:
            parts = []
            for name, size in zip(s.hf_names, hf_split_sizes(cfg, s)):
                arr = handles[where[name]].get_tensor(name)
                want = (size,) + s.shape[:-1][::-1] if s.transpose else s.shape[:-1] + (size,)
                if tuple(arr.shape) != tuple(want):
                    raise CheckpointError(
                        f"tensor {name!r} in {os.path.basename(where[name])} has shape {tuple(arr.shape)}, "
                        f"expected {tuple(want)} from config.json")
                parts.append(jnp.asarray(arr))
            leaves[s.path] = _place(parts, transpose=s.transpose, dtype=jnp.dtype(dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return assemble(cfg, leaves)


def weights_digest(model_dir: str) -> str:
    """A SHA-256 over every safetensors file's header (names, dtypes, shapes, offsets) and a
    sample of its bytes: distinguishes checkpoints without hashing many GB at startup."""
    h = hashlib.sha256()
    for path in sorted(set(safetensors_files(model_dir).values())):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(n))
            h.update(size.to_bytes(8, "little"))
            for frac in (0.25, 0.5, 0.75, 1.0):  # 64 KiB samples spread over the data
                f.seek(max(8 + n, int(size * frac) - 65536))
                h.update(f.read(65536))
    return h.hexdigest()


def config_digest(cfg: ModelConfig) -> str:
    return hashlib.sha256(repr(cfg).encode()).hexdigest()
