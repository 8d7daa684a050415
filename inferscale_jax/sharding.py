"""Tensor parallelism: a one-axis mesh ("tp") over N devices, Megatron-style shardings from the
logical axes ``models/params.py`` declares, and the KV pool sharded over kv heads.

The forward stays one function: the weights are placed with ``NamedSharding``s and XLA (GSPMD)
inserts the collectives - the column-parallel projections (q/k/v, gate/up) need none, the
row-parallel ones (o, down) end in an all-reduce, the vocab-parallel embedding gather and LM head
in one each.  Attention and the KV write run per shard inside ``shard_map``
(``PagedKVCache.attend``), so the Pallas kernels see one device's heads.

``LOGICAL_RULES`` maps a ``ParamSpec`` axis to the mesh axis: ``qkv_heads`` and ``mlp2`` (the
fused q/k/v and gate/up outputs: column-parallel), ``q_heads`` and ``mlp`` (the inputs of o and down:
row-parallel) and ``vocab`` (embedding rows, LM head columns) are split over "tp"; everything else
is replicated.  A vocab that N does not divide stays replicated (logged).

Fused matrices: ``wqkv``'s columns are ``[q | k | v]`` and ``w_gate_up``'s ``[gate | up]``; split
as they are, device 0 would hold only q columns.  ``interleave`` reorders them shard-major -
``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, device i holding q heads ``i*Hq/N ..`` and kv heads
``i*Hkv/N ..`` (GQA maps q head h to kv head ``h // G``, so each device's q heads read only its own
kv heads) - and the model splits the fused output per group (``ModelConfig.fused_shards``).

The KV pool's ``[Hkv, P, S, D]`` layer arrays are split on kv heads.  When N exceeds the kv heads
(N a multiple of them), each kv head is replicated ``N / Hkv`` times, as vLLM does: the layout model
(``layout_config``) has N kv heads whose k/v projections repeat the real ones (``expand_kv``), so
device i holds kv head ``i // (N / Hkv)`` - the one its q heads read - and attention is unchanged.
The pool then holds N / Hkv copies of each head (one per device); the tiers and snapshots keep the
real heads only (``kv_cache.gather_pages`` takes one copy, ``scatter_pages`` repeats it), so their
layout does not depend on N.  Page tables, slots and every per-step input are replicated.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.params import assemble, param_specs

log = logging.getLogger("inferscale.sharding")

AXIS = "tp"
LOGICAL_RULES = {"qkv_heads": AXIS, "mlp2": AXIS, "q_heads": AXIS, "mlp": AXIS, "vocab": AXIS}
KV_SPEC = P(AXIS)  # a layer's [Hkv, P, S, D] pages, split on kv heads


def check_tensor_parallel(cfg: ModelConfig, tp: int, num_devices: int) -> None:
    """A clear error when ``tp`` cannot shard this model on these devices."""
    def bad(why: str):
        raise ValueError(f"EngineConfig.tensor_parallel={tp} is invalid: {why}")

    if tp < 1:
        bad("must be >= 1")
    if tp > num_devices:
        bad(f"only {num_devices} device(s) are visible; use at most {num_devices} (or start the process "
            "with more devices)")
    for name, value in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            bad(f"it must divide the model's {name} ({value}); choose a divisor of {value}")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        bad(f"it must divide the model's num_kv_heads ({kv}) or be a multiple of it (each kv head then "
            f"replicated); choose a divisor or a multiple of {kv}")


def layout_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model config of the tensor-parallel layout: fused matrices in ``tp`` groups, and ``tp`` kv
    heads when the model has fewer (each replicated ``tp / Hkv`` times)."""
    kv = tp if cfg.num_kv_heads < tp else cfg.num_kv_heads
    return dataclasses.replace(cfg, num_kv_heads=kv, fused_shards=tp)


def expand_kv(cfg: ModelConfig, params: dict, rep: int) -> dict:
    """Each kv head's k and v projection columns (and biases) repeated ``rep`` times, in place."""
    if rep == 1:
        return params
    qd, kvd, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim

    def grow(w):
        lead = w.shape[:-1]
        q, k, v = w[..., :qd], w[..., qd:qd + kvd], w[..., qd + kvd:]
        heads = lambda x: jnp.repeat(x.reshape(*lead, cfg.num_kv_heads, d), rep, axis=-2).reshape(*lead, -1)  # noqa: E731
        return jnp.concatenate([q, heads(k), heads(v)], axis=-1)

    layers = []
    for p in params["layers"]:
        p = dict(p)
        for name in ("wqkv", "bqkv"):
            if name in p:
                p[name] = grow(p[name])
        layers.append(p)
    return dict(params, layers=layers)


def make_mesh(tp: int, devices=None) -> Mesh:
    """A one-axis mesh over the first ``tp`` devices (or ``devices``)."""
    devs = list(devices) if devices is not None else jax.devices()[:tp]
    return Mesh(np.array(devs), (AXIS,))


def param_spec(axes: tuple[str, ...], shape: tuple[int, ...], tp: int) -> P:
    """The PartitionSpec of one weight from its logical axes (replicated where tp does not divide)."""
    parts = []
    for ax, dim in zip(axes, shape):
        mesh_ax = LOGICAL_RULES.get(ax)
        parts.append(mesh_ax if mesh_ax is not None and dim % tp == 0 else None)
    return P(*parts)


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """{ParamSpec.path: NamedSharding} for every weight."""
    tp = mesh.shape[AXIS]
    out = {}
    for s in param_specs(cfg):
        spec = param_spec(s.axes, s.shape, tp)
        if "vocab" in s.axes and AXIS not in spec:
            log.warning("vocab %d is not divisible by tensor_parallel=%d: %s stays replicated",
                        cfg.vocab_size, tp, "/".join(map(str, s.path)))
        out[s.path] = NamedSharding(mesh, spec)
    return out


def _interleave_cols(w: jax.Array, sizes: list[int], n: int) -> jax.Array:
    """Columns ``[a | b | ...]`` (sizes) -> shard-major ``[a_0 b_0 .. | a_1 b_1 .. | ...]``."""
    lead = w.shape[:-1]
    parts, start = [], 0
    for size in sizes:
        parts.append(w[..., start:start + size].reshape(*lead, n, size // n))
        start += size
    return jnp.concatenate(parts, axis=-1).reshape(*lead, -1)


def interleave(cfg: ModelConfig, params: dict, n: int) -> dict:
    """The fused q/k/v and gate/up weights (and biases) in ``n`` shard-major groups."""
    if n == 1:
        return params
    d = cfg.head_dim
    qkv = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    gu = [cfg.intermediate_size] * 2
    layers = []
    for p in params["layers"]:
        p = dict(p)
        for name, sizes in (("wqkv", qkv), ("bqkv", qkv), ("w_gate_up", gu), ("b_gate_up", gu)):
            if name in p:
                p[name] = _interleave_cols(p[name], sizes, n)
        layers.append(p)
    return dict(params, layers=layers)


def to_layout(cfg: ModelConfig, lcfg: ModelConfig, params: dict) -> dict:
    """Weights of ``cfg`` in the layout of ``lcfg`` (``layout_config``): kv heads repeated, fused
    matrices shard-major."""
    return interleave(lcfg, expand_kv(cfg, params, lcfg.num_kv_heads // cfg.num_kv_heads), lcfg.fused_shards)


def shard_params(cfg: ModelConfig, params: dict, mesh: Mesh) -> tuple[ModelConfig, dict]:
    """(the model config of the sharded layout, the weights in that layout placed on the mesh)."""
    lcfg = layout_config(cfg, mesh.shape[AXIS])
    return lcfg, jax.device_put(to_layout(cfg, lcfg, params), assemble(lcfg, param_shardings(lcfg, mesh)))


def init_params_sharded(cfg: ModelConfig, mesh: Mesh, key: jax.Array, dtype=jnp.bfloat16,
                        scale: float = 0.02) -> tuple[ModelConfig, dict]:
    """Random weights (``models.init_params``'s values) generated in the tensor-parallel layout on the
    mesh, each device computing its own shards (benchmarks of models too large for one device)."""
    from models import init_params

    lcfg = layout_config(cfg, mesh.shape[AXIS])
    make = jax.jit(lambda k: to_layout(cfg, lcfg, init_params(cfg, k, dtype=dtype, scale=scale)),
                   out_shardings=assemble(lcfg, param_shardings(lcfg, mesh)))
    return lcfg, make(key)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a layer's pages (kv heads first)."""
    return NamedSharding(mesh, KV_SPEC)


def mesh_stats(mesh: Mesh | None, device) -> dict:
    """``stats()``'s view of the placement: the mesh and each device's memory in use."""
    devs = list(mesh.devices.flat) if mesh is not None else [device]
    mem = []
    for d in devs:  # another process's devices: this process cannot read their memory (None)
        st = (d.memory_stats() or {}) if d.process_index == jax.process_index() else {}
        mem.append({"device": str(d), "process": d.process_index, "bytes_in_use": st.get("bytes_in_use"),
                    "bytes_limit": st.get("bytes_limit")})
    return {"tensor_parallel": len(devs), "mesh_axes": {AXIS: len(devs)} if mesh is not None else {},
            "processes": jax.process_count(), "devices": mem}
