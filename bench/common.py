"""What the benchmarks share: the model shapes they run, the model config built from a shape,
and the read-only bandwidth ceiling.

``LLAMA3_8B`` is the shape every GPU headline uses (random bf16 weights); each benchmark's
``--quick`` mode uses a tiny shape of the same architecture to check its harness on the CPU.
A shape is a plain dict (``vocab``, ``hidden``, ``inter``, ``layers``, ``heads``, ``kv``,
``head_dim``, ``theta``, ``max_pos``, ``eps``); ``model_config`` turns it into the engine's
``ModelConfig``; ``shape(quick, **over)`` picks one and overrides fields (a benchmark that needs a
larger tiny vocabulary, say).

``read_bandwidth``: bytes/s of a device reduction over a large array - read-only traffic, the
ceiling for kernels that only read (decode attention, a decode step's weight reads).  A copy
(read + write) is a different ceiling; reports name which one they use.
"""

from __future__ import annotations

import time

LLAMA3_8B = dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv=8, head_dim=128,
                 theta=500000.0, max_pos=32768, eps=1e-5)
TINY = dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16,
            theta=500000.0, max_pos=2048, eps=1e-5)


def shape(quick: bool, **over) -> dict:
    """The tiny shape for ``--quick`` runs, else Llama-3-8B; ``over`` replaces fields."""
    return dict(TINY if quick else LLAMA3_8B, **over)


def model_config(sh: dict):
    from models import ModelConfig, RopeConfig

    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=sh["vocab"], hidden_size=sh["hidden"],
                       intermediate_size=sh["inter"], num_layers=sh["layers"], num_heads=sh["heads"],
                       num_kv_heads=sh["kv"], head_dim=sh["head_dim"], rms_norm_eps=sh.get("eps", 1e-5),
                       rope=RopeConfig(theta=sh.get("theta", 500000.0)), max_position_embeddings=sh["max_pos"])


def read_bandwidth(num_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s of a jitted float32-accumulating sum over ``num_bytes`` of bf16 (median of ``reps``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    del x
    return num_bytes / float(np.median(times))
