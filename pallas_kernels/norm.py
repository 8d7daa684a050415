"""The residual add and RMSNorm between a layer's matmuls, in one pass over the rows.

A decoder layer's glue around its norms is ``x = x + delta`` (the attention's or the MLP's output
projection) followed by ``h = rms_norm(x)``.  XLA runs these as a matmul epilogue (or an add
fusion) and a separate reduction fusion, each reading and writing the ``[N, H]`` activations;
:func:`add_rms_norm_pallas` reads ``x`` and ``delta`` once and writes the sum and the normalised
rows, one program per ``block_rows`` rows, a whole row (``H`` a power of two) in registers.

Numerics are the model's (``models/transformer.py``, as transformers): the sum rounded to
``x``'s dtype, the mean of squares and ``rsqrt`` in float32, the normalised row cast back to
``x``'s dtype and then multiplied by the weight (in the wider of the two dtypes).

Rows past ``N`` in the last block re-read and re-write row ``N - 1`` (the same values) instead
of masking, as ``pallas_kernels/kv_write.py`` does: exact on the GPU and in interpret mode.

:func:`add_rms_norm_ref` is the jnp reference: the model's own ``add_rms_norm``; ``bench/kernels/glue.py``
times both beside the matmuls they sit between (bench/NOTES.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.transformer import add_rms_norm as add_rms_norm_ref  # (x + delta, rms_norm(x + delta))
from pallas_kernels import common

__all__ = ["add_rms_norm_pallas", "add_rms_norm_ref", "check_norm_inputs"]


def check_norm_inputs(x, delta, weight) -> tuple[int, int]:
    """Validate; return (N, H) of the flattened rows."""
    if x.ndim < 1:
        common._fail("x.ndim", x.ndim, "at least 1: [..., H]")
    h = x.shape[-1]
    if weight.shape != (h,):
        common._fail("weight.shape", weight.shape, f"({h},) = [H] of x {x.shape}")
    if delta is not None:
        if delta.shape != x.shape:
            common._fail("delta.shape", delta.shape, f"the shape of x {x.shape}")
        common.check_dtype("delta", delta, x.dtype)
    if h & (h - 1):
        common._fail("H", h, "a power of two (a whole row in one Triton block); use add_rms_norm_ref")
    n = 1
    for s in x.shape[:-1]:
        n *= s
    return n, h


def _add_norm_kernel(*refs, n: int, block: int, eps: float, has_delta: bool):
    if has_delta:
        x_ref, d_ref, w_ref, sum_ref, out_ref = refs
    else:
        x_ref, w_ref, out_ref = refs
    h = x_ref.shape[-1]
    i = pl.program_id(0)
    r = jnp.minimum(i * block + jnp.arange(block, dtype=jnp.int32), n - 1)[:, None]  # [R, 1]
    col = jnp.arange(h, dtype=jnp.int32)[None, :]  # [1, H]
    s = x_ref[r, col]  # [R, H]
    if has_delta:
        s = (s.astype(jnp.float32) + d_ref[r, col].astype(jnp.float32)).astype(x_ref.dtype)
        sum_ref[r, col] = s
    s32 = s.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(s32 * s32, axis=-1, keepdims=True) * (1.0 / h) + eps)  # [R, 1]
    y = (s32 * inv).astype(x_ref.dtype).astype(jnp.float32)
    w = w_ref[col[0]].astype(jnp.float32)[None, :]  # [1, H]
    out_ref[r, col] = (w * y).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def add_rms_norm_pallas(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, *,
                        block_rows: int = 2, num_warps: int = 8,
                        interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """``add_rms_norm_ref``'s result from one Triton kernel: x / delta ``[..., H]``, weight ``[H]``.

    With ``delta`` None it is RMSNorm alone and returns ``(x, normed)`` (x untouched)."""
    n, h = check_norm_inputs(x, delta, weight)
    if interpret is None:
        interpret = common.default_interpret()
    out_dtype = jnp.result_type(weight.dtype, x.dtype)
    x2 = x.reshape(n, h)
    whole = pl.BlockSpec((n, h), lambda i: (0, 0))
    args = [x2] + ([delta.reshape(n, h)] if delta is not None else []) + [weight]
    out_shape = ([jax.ShapeDtypeStruct((n, h), x.dtype)] if delta is not None else []) + [
        jax.ShapeDtypeStruct((n, h), out_dtype)]
    outs = pl.pallas_call(
        functools.partial(_add_norm_kernel, n=n, block=block_rows, eps=eps, has_delta=delta is not None),
        grid=(pl.cdiv(n, block_rows),),
        in_specs=[whole] * (len(args) - 1) + [pl.BlockSpec((h,), lambda i: (0,))],
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        compiler_params=common.compiler_params(num_warps, 1),
        interpret=interpret,
        name=f"add_rms_norm_r{block_rows}" if delta is not None else f"rms_norm_r{block_rows}",
    )(*args)
    if delta is None:
        return x, outs[0].reshape(x.shape)
    return outs[0].reshape(x.shape), outs[1].reshape(x.shape)
