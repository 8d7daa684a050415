"""q, k and v out of the fused qkv projection, RoPE on q and k, in one pass over the projection's output.

The model's form (``models/transformer.py``'s ``project_qkv``, ``models/rope.py``'s ``apply_rope``) slices
``qkv [N, (Hq + 2 Hkv) * D]`` into heads and rotates q and k by cos / sin tables gathered by position, which XLA
runs as one or two loop fusions that read and write each element a little more than once.
:func:`qkv_rope_pallas` is one Triton program per ``block_tokens`` tokens and head (grid
``(cdiv(N, T), Hq + 2 Hkv)``): it loads the head's two halves, computes the angles from the tokens' positions and
the ``[D/2]`` frequencies (``models/rope.py``'s ``inv_freq``: every RoPE variant), and stores the rotated halves
(v heads are copied).

Numerics are the model's: cos / sin in float32, cast to the activations' dtype, then ``x * cos + rotate_half(x)
* sin`` with each product and the sum rounded to that dtype, as transformers computes it (XLA's fused form on a
GPU may skip the products' rounding: within one rounding step of this).  Tokens past ``N`` in the last block redo token ``N - 1`` (same values), as ``pallas_kernels/kv_write.py``.
Only the plain ``[q | k | v]`` layout (``ModelConfig.fused_shards == 1``).

:func:`qkv_rope_ref` is the jnp reference (the model's form); ``bench/kernels/glue.py`` times both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def qkv_rope_ref(qkv: jax.Array, positions: jax.Array, freq: jax.Array, num_heads: int,
                 num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [N, (Hq + 2 Hkv) D], positions [N], freq [D/2] float32 -> q [N, Hq, D], k / v [N, Hkv, D]."""
    from models.rope import apply_rope, rope_cos_sin
    n = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    cos, sin = rope_cos_sin(positions[None], freq)  # [1, N, D]
    q = qkv[:, :num_heads * d].reshape(1, n, num_heads, d)
    k = qkv[:, num_heads * d:(num_heads + num_kv_heads) * d].reshape(1, n, num_kv_heads, d)
    v = qkv[:, (num_heads + num_kv_heads) * d:].reshape(n, num_kv_heads, d)
    return apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0], v


def check_rope_inputs(qkv, positions, freq, num_heads, num_kv_heads) -> tuple[int, int]:
    """Validate; return (N, D)."""
    heads = num_heads + 2 * num_kv_heads
    if qkv.ndim != 2 or qkv.shape[1] % heads:
        common._fail("qkv.shape", qkv.shape, f"[N, (Hq + 2 Hkv) * D] with Hq + 2 Hkv = {heads}")
    n, d = qkv.shape[0], qkv.shape[1] // heads
    if d % 2 or d & (d - 1):
        common._fail("head_dim", d, "an even power of two")
    common.check_int_vector("positions", positions, n)
    if freq.shape != (d // 2,):
        common._fail("freq.shape", freq.shape, f"({d // 2},) = [D/2]")
    return n, d


def _rope_kernel(pos_ref, freq_ref, qkv_ref, q_ref, k_ref, v_ref, *, n: int, block: int, hq: int, hkv: int):
    i, h = pl.program_id(0), pl.program_id(1)
    d2 = freq_ref.shape[0]
    d = 2 * d2
    r = jnp.minimum(i * block + jnp.arange(block, dtype=jnp.int32), n - 1)[:, None]  # [T, 1]
    col = jnp.arange(d2, dtype=jnp.int32)[None, :]  # [1, D/2]
    base = h * d
    x1 = qkv_ref[r, base + col]  # [T, D/2]
    x2 = qkv_ref[r, base + d2 + col]
    dtype = x1.dtype

    def rotated():
        ang = pos_ref[r[:, 0]].astype(jnp.float32)[:, None] * freq_ref[col[0]][None, :]  # [T, D/2]
        c = jnp.cos(ang).astype(dtype).astype(jnp.float32)
        s = jnp.sin(ang).astype(dtype).astype(jnp.float32)
        a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
        rnd = lambda t: t.astype(dtype).astype(jnp.float32)  # noqa: E731 (each product rounded, as transformers)
        return (rnd(a * c) - rnd(b * s)).astype(dtype), (rnd(b * c) + rnd(a * s)).astype(dtype)

    @pl.when(h < hq)
    def _():
        o1, o2 = rotated()
        q_ref[r, h, col] = o1
        q_ref[r, h, d2 + col] = o2

    @pl.when((h >= hq) & (h < hq + hkv))
    def _():
        o1, o2 = rotated()
        k_ref[r, h - hq, col] = o1
        k_ref[r, h - hq, d2 + col] = o2

    @pl.when(h >= hq + hkv)
    def _():
        v_ref[r, h - hq - hkv, col] = x1
        v_ref[r, h - hq - hkv, d2 + col] = x2


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "block_tokens", "num_warps",
                                             "interpret"))
def qkv_rope_pallas(qkv: jax.Array, positions: jax.Array, freq: jax.Array, num_heads: int, num_kv_heads: int, *,
                    block_tokens: int = 8, num_warps: int = 4,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``qkv_rope_ref``'s result from one Triton kernel.  The default block (8 tokens, 4 warps) was the fastest at
    every row count of run AY (bench/NOTES.md): 2.6 / 6.9 us at 64 / 512 rows against XLA's 6.5 / 12.9 on an
    H100."""
    n, d = check_rope_inputs(qkv, positions, freq, num_heads, num_kv_heads)
    if interpret is None:
        interpret = common.default_interpret()
    heads = num_heads + 2 * num_kv_heads
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_rope_kernel, n=n, block=block_tokens, hq=num_heads, hkv=num_kv_heads),
        grid=(pl.cdiv(n, block_tokens), heads),
        in_specs=[whole((n,)), whole((d // 2,)), whole((n, heads * d))],
        out_specs=[whole((n, num_heads, d)), whole((n, num_kv_heads, d)), whole((n, num_kv_heads, d))],
        out_shape=[jax.ShapeDtypeStruct((n, num_heads, d), qkv.dtype),
                   jax.ShapeDtypeStruct((n, num_kv_heads, d), qkv.dtype),
                   jax.ShapeDtypeStruct((n, num_kv_heads, d), qkv.dtype)],
        compiler_params=common.compiler_params(num_warps, 1),
        interpret=interpret,
        name=f"qkv_rope_t{block_tokens}",
    )(positions.astype(jnp.int32), freq.astype(jnp.float32), qkv)
