"""Load HF ``*.safetensors`` checkpoints straight into the parameter pytree (no torch).

Files: a single ``model.safetensors``, a sharded set listed by ``model.safetensors.index.json``
(its ``weight_map`` names the file of every tensor), or any ``*.safetensors`` in the folder.
Each tensor named by ``param_specs`` is read from its file with ``os.preadv`` straight into a
fresh array (``FileTensors``: the safetensors header gives each tensor's dtype, shape and byte
range; bf16 arrives as ``ml_dtypes.bfloat16``; a dtype numpy lacks goes through safetensors'
own reader).  The read releases the GIL, so the loader's threads read in parallel, where
safetensors' ``get_tensor`` holds it and several threads read no faster than one
(bench/NOTES.md, run AL and session 29).  Each tensor is checked against its expected shape,
moved to the device, then transposed and cast there (one jitted op per tensor, so large models
are not transposed on the host).  A missing tensor or a wrong shape raises ``CheckpointError``
naming the tensor.
``load_params_sharded`` reads a checkpoint straight into the tensor-parallel layout, each device
only its slices (``inferscale_jax/sharding.py``).
Tensors the model does not use (``rotary_emb.inv_freq``, a tied ``lm_head``) are ignored.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np
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


# safetensors dtype names -> numpy dtypes (the rest are read through safetensors itself)
_DTYPES = {"BF16": jnp.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
           "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
           "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


class FileTensors:
    """One ``*.safetensors`` file's tensors, each read straight into a fresh array.

    The file is an 8-byte little-endian header length, a JSON header (per tensor: ``dtype``,
    ``shape``, ``data_offsets`` into the data after the header) and the data.  ``get_tensor``
    reads a tensor's bytes with ``os.preadv`` into the array it returns (positional reads on one
    descriptor, so threads share it; the read releases the GIL)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            head = os.pread(self.fd, 8, 0)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            ok = 0 < n <= os.fstat(self.fd).st_size - 8  # (a garbage length is never read)
            raw = os.pread(self.fd, n, 8) if ok else b""
            if not ok or len(raw) != n:
                raise CheckpointError(f"{path}: not a safetensors file (its header is cut short); "
                                      "write the checkpoint again")
            self.header = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
        except BaseException:
            os.close(self.fd)
            raise
        self.base = 8 + n
        self.fallback = None

    def get_tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:  # (a dtype numpy has no name for here: safetensors reads it)
            if self.fallback is None:
                self.fallback = safe_open(self.path, framework="numpy").__enter__()
            return self.fallback.get_tensor(name)
        lo, hi = info["data_offsets"]
        out = np.empty(tuple(info["shape"]), dtype)
        if hi - lo != out.nbytes:
            raise CheckpointError(f"tensor {name!r} in {os.path.basename(self.path)}: {hi - lo} bytes for "
                                  f"{info['dtype']} {list(out.shape)}; the file is damaged")
        buf = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < out.nbytes:  # (one call reads at most ~2 GiB)
            got = os.preadv(self.fd, [buf[done:]], self.base + lo + done)
            if got <= 0:
                raise CheckpointError(f"tensor {name!r} in {os.path.basename(self.path)}: the file ends "
                                      f"{out.nbytes - done} bytes early; it is damaged")
            done += got
        return out

    def close(self) -> None:
        if self.fallback is not None:
            self.fallback.__exit__(None, None, None)
        os.close(self.fd)


@functools.partial(jax.jit, static_argnames=("transpose", "dtype"))
def _place(parts: list[jax.Array], *, transpose: bool, dtype) -> jax.Array:
    """HF tensors -> one leaf: concatenate along the output axis, transpose, cast (on device)."""
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0 if transpose else -1)
    x = x.T if transpose else x
    return x.astype(dtype)


IN_FLIGHT_BYTES = 2 << 30  # load_params: bytes of the leaves being read and placed at once, at most (one leaf beyond it)


def load_params(model_dir: str, cfg: ModelConfig, dtype=jnp.bfloat16, workers: int | None = None) -> dict:
    """Read the checkpoint in ``model_dir`` into the pytree of ``param_specs(cfg)``, ``workers``
    tensors at a time (default: the CPUs, at most 8; reading, the host-to-device copy and the
    device-side transpose of one tensor overlap the others'), with at most ``IN_FLIGHT_BYTES`` of
    them between the file and their placed leaf (a device's transient memory stays near the
    one-at-a-time load's, whatever the worker count)."""
    where = safetensors_files(model_dir)
    specs = param_specs(cfg)
    _check_present(specs, where, model_dir)
    workers = workers or min(8, os.cpu_count() or 1)
    handles = {}
    budget = threading.Condition()
    in_flight = [0]

    def leaf(s):
        names = list(zip(s.hf_names, hf_split_sizes(cfg, s)))
        need = int(np.prod(s.shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize  # (the placed leaf's bytes)
        with budget:  # (a tensor larger than the budget waits for an empty pipe, then goes alone)
            budget.wait_for(lambda: in_flight[0] == 0 or in_flight[0] + need <= IN_FLIGHT_BYTES)
            in_flight[0] += need
        try:
            parts = []
            for name, size in names:
                arr = handles[where[name]].get_tensor(name)
                _check_shape(s, name, size, arr.shape, where)
                parts.append(jnp.asarray(arr))
            return jax.block_until_ready(_place(parts, transpose=s.transpose, dtype=jnp.dtype(dtype)))
        finally:
            with budget:
                in_flight[0] -= need
                budget.notify_all()

    try:
        for path in sorted({where[n] for s in specs for n in s.hf_names}):
            handles[path] = FileTensors(path)
        if workers <= 1:
            leaves = {s.path: leaf(s) for s in specs}
        else:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="inferscale-load") as pool:
                futures = {s.path: pool.submit(leaf, s) for s in specs}
                leaves = {path: fut.result() for path, fut in futures.items()}  # (the first error raises)
    finally:
        for h in handles.values():
            h.close()
    return assemble(cfg, leaves)


def _read_leaf(handle_of, cfg: ModelConfig, s, n: int, idx: tuple, dtype, rep: int = 1) -> np.ndarray:
    """One device's slice ``idx`` of leaf ``s`` (a spec of the layout config ``cfg``) in the layout of
    ``n`` shard-major groups (``ModelConfig.fused_shards``), read from the HF tensors with
    safetensors' slicing (only the rows it needs of a row-major file).  ``rep`` > 1: the layout's kv
    heads repeat each real one ``rep`` times (``sharding.expand_kv``); a group then holds one head."""
    names, sizes = s.hf_names, hf_split_sizes(cfg, s)
    d = cfg.head_dim
    if len(names) == 1:
        sl = handle_of(names[0]).get_slice(names[0])
        x = sl[tuple(idx[::-1])].T if s.transpose else sl[tuple(idx)]
        return np.asarray(x).astype(dtype)
    total = s.shape[-1]
    o0, o1, _ = idx[-1].indices(total)
    lead = tuple(idx[:-1])
    per = total // n  # columns of one group: its share of every fused part
    pieces = []
    for g in range(o0 // per, -(-o1 // per)):
        off = g * per
        for part, (name, size) in enumerate(zip(names, sizes)):
            w = size // n
            lo, hi = max(o0, off), min(o1, off + w)
            if lo < hi:  # rows [r0, r1) of HF tensor `name` (its output axis)
                r0, r1 = g * w + lo - off, g * w + hi - off
                if rep > 1 and len(names) == 3 and part:  # k / v: layout head r0 // d is real head // rep
                    r0, r1 = (r0 // d // rep) * d + r0 % d, (r0 // d // rep) * d + r0 % d + (r1 - r0)
                sl = handle_of(name).get_slice(name)
                pieces.append(np.asarray(sl[(slice(r0, r1),) + lead[::-1]]).T if s.transpose
                              else np.asarray(sl[r0:r1]))
            off += w
    return np.concatenate(pieces, axis=-1).astype(dtype)


def load_params_sharded(model_dir: str, cfg: ModelConfig, mesh, dtype=jnp.bfloat16) -> tuple[ModelConfig, dict]:
    """The checkpoint straight into the tensor-parallel layout on ``mesh`` (inferscale_jax/sharding.py):
    each device reads only its slice of every weight from the files (``jax.make_array_from_callback``;
    no full copy of the model on one device or in host memory: one slice at a time on the host).
    Returns (the model config of that layout, the pytree), as ``sharding.shard_params`` does."""
    from inferscale_jax.sharding import AXIS, layout_config, param_shardings

    where = safetensors_files(model_dir)
    specs = param_specs(cfg)
    _check_present(specs, where, model_dir)
    n = mesh.shape[AXIS]
    lcfg = layout_config(cfg, n)
    rep = lcfg.num_kv_heads // cfg.num_kv_heads
    shardings = param_shardings(lcfg, mesh)
    np_dtype = jnp.dtype(dtype)
    handles = {}

    def handle_of(name):
        path = where[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="numpy").__enter__()
        return handles[path]

    try:
        for s in specs:  # shapes first: a wrong one is a clear error before any device work
            for name, size in zip(s.hf_names, hf_split_sizes(cfg, s)):
                _check_shape(s, name, size, handle_of(name).get_slice(name).get_shape(), where)
        leaves = {}
        for s in param_specs(lcfg):
            groups = n if len(s.hf_names) > 1 else 1
            leaves[s.path] = jax.make_array_from_callback(
                s.shape, shardings[s.path],
                lambda idx, s=s, groups=groups: _read_leaf(handle_of, lcfg, s, groups, idx, np_dtype, rep))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return lcfg, assemble(lcfg, leaves)


def _check_shape(s, name: str, size: int, got, where: dict) -> None:
    """The HF tensor ``name`` (``size`` rows of spec ``s``'s output) has the shape config.json implies."""
    want = (size,) + s.shape[:-1][::-1] if s.transpose else s.shape[:-1] + (size,)
    if tuple(got) != tuple(want):
        raise CheckpointError(f"tensor {name!r} in {os.path.basename(where[name])} has shape {tuple(got)}, "
                              f"expected {tuple(want)} from config.json")


def _check_present(specs, where: dict, model_dir: str) -> None:
    for s in specs:
        for name in s.hf_names:
            if name not in where:
                raise CheckpointError(
                    f"tensor {name!r} (for {'.'.join(map(str, s.path))} {s.shape}) is missing from "
                    f"the checkpoint in {model_dir}")


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
