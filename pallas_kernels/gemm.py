"""Skinny matmuls: a few rows of activations times a layer's whole weight, streamed once.

In a decode step (1-128 rows) every projection reads its ``[K, N]`` weight once and does little
arithmetic on it, so its floor is the weight's bytes at the read ceiling.  XLA's Triton GEMMs
for these shapes reach ~2.0-2.6 TB/s on an H100 for qkv and o, and ~2.6-3.1 for the MLP
(bench/NOTES.md, run AQ's profile: qkv 1.39x and o 1.43x of their read floors at 64 rows).
:func:`matmul_pallas` is one Triton program per ``block_n`` output columns (and per
``block_m`` rows, and per ``split_k`` share of ``K``): it keeps its ``[block_m, block_n]``
float32 accumulator in registers and walks ``K`` in ``block_k`` steps, each loading the
activations' ``[block_m, block_k]`` tile (from L2 after the first program) and the weight's
``[block_k, block_n]`` tile, software-pipelined ``num_stages`` deep.  With ``split_k > 1``
each share writes float32 partials ``[split_k, M, N]`` that one XLA reduction adds and rounds.

Numerics: products accumulated in float32 and rounded once to the activations' dtype, as
XLA's dot; the order of the sums differs, so bf16 results may differ from XLA's by one
rounding step.  Rows past ``M`` in the last row block redo row ``M - 1`` (same values), as
``pallas_kernels/kv_write.py``.

:func:`matmul_ref` is the jnp reference (XLA's dot); ``bench/kernels/skinny_gemm.py`` times both at the
model's projection shapes.  ``default_blocks`` picks the knobs from the shape (bench/NOTES.md,
run AZ: at 64 rows the kernel took the 8B's qkv, o and down projections 24.3 / 21.0 / 50.3 -> 20.2 / 16.0 /
43.6 us on an H100; its gate_up (already at 1.03x of its read floor) and single rows it does not speed up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

__all__ = ["matmul_pallas", "matmul_ref", "check_matmul_inputs", "default_blocks", "MAX_BLOCK_M"]

MAX_BLOCK_M = 128  # rows a program holds; more rows take more row blocks
_PREC = lax.Precision.HIGHEST  # fp32: IEEE matmul on Triton (DEFAULT = TF32); no-op for bf16


def matmul_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, float32 accumulation (XLA's dot)."""
    return jnp.einsum("mk,kn->mn", x, w, precision=_PREC if x.dtype == jnp.float32 else None,
                      preferred_element_type=jnp.float32).astype(x.dtype)


def check_matmul_inputs(x, w, block_n: int, block_k: int, split_k: int) -> tuple[int, int, int]:
    """Validate; return (M, K, N)."""
    if x.ndim != 2 or w.ndim != 2:
        common._fail("x.ndim, w.ndim", (x.ndim, w.ndim), "(2, 2): x [M, K], w [K, N]")
    m, k = x.shape
    if w.shape[0] != k:
        common._fail("w.shape", w.shape, f"[K, N] with K = {k} (x {x.shape})")
    common.check_dtype("w", w, x.dtype)
    n = w.shape[1]
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < common.MIN_DOT_DIM or value & (value - 1):
            common._fail(name, value, f"a power of two >= {common.MIN_DOT_DIM}")
    if split_k < 1:
        common._fail("split_k", split_k, ">= 1")
    if n % block_n:
        common._fail("N", n, f"a multiple of block_n = {block_n} (w {w.shape}); use matmul_ref")
    if k % (block_k * split_k):
        common._fail("K", k, f"a multiple of block_k x split_k = {block_k * split_k} (x {x.shape}); use matmul_ref")
    return m, k, n


def default_blocks(m: int, k: int, n: int, itemsize: int = 2) -> dict:
    """Knobs for ``matmul_pallas`` from the shape, as run AZ's sweep on an H100 found them at 64 and 128 rows
    (``bench/kernels/skinny_gemm.py``; bench/NOTES.md): 64-column blocks, 128-deep K steps, 4 stages, 4 warps, and
    K split in two where the column blocks alone are fewer than 96 programs (the 8B's o and down projections:
    64 column blocks; its qkv's 96 ran best unsplit).  Smaller blocks where the shape needs them; K steps half as
    deep for 4-byte elements (``itemsize``: the same shared memory a stage)."""
    block_n = next((b for b in (64, 32, 16) if n % b == 0), 16)
    block_k = 128 * 2 // max(2, itemsize)
    while k % block_k and block_k > common.MIN_DOT_DIM:
        block_k //= 2
    split_k = 2 if n // block_n < 96 and k % (2 * block_k) == 0 else 1
    return dict(block_n=block_n, block_k=block_k, num_warps=4, num_stages=4, split_k=split_k)


def _matmul_kernel(x_ref, w_ref, o_ref, *, m: int, block_m: int, block_n: int, block_k: int, steps: int):
    j, s, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = jnp.minimum(i * block_m + jnp.arange(block_m, dtype=jnp.int32), m - 1)  # [BM]
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
    k0 = s * steps * block_k

    def body(t, acc):
        ks = k0 + t * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        a = x_ref[rows[:, None], ks[None, :]]  # [BM, BK]
        b = w_ref[ks[:, None], cols[None, :]]  # [BK, BN]
        return acc + lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_PREC,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[(s * m + rows)[:, None], cols[None, :]] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "split_k",
                                             "interpret"))
def matmul_pallas(x: jax.Array, w: jax.Array, *, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
                  interpret: bool | None = None) -> jax.Array:
    """``matmul_ref(x, w)`` from one Triton kernel: x ``[M, K]``, w ``[K, N]`` -> ``[M, N]`` in x's dtype.
    Knobs left None come from :func:`default_blocks`."""
    if x.ndim != 2 or w.ndim != 2:
        common._fail("x.ndim, w.ndim", (x.ndim, w.ndim), "(2, 2): x [M, K], w [K, N]")
    picked = default_blocks(*x.shape, w.shape[1], x.dtype.itemsize)
    block_n = picked["block_n"] if block_n is None else block_n
    block_k = picked["block_k"] if block_k is None else block_k
    num_warps = picked["num_warps"] if num_warps is None else num_warps
    num_stages = picked["num_stages"] if num_stages is None else num_stages
    split_k = picked["split_k"] if split_k is None else split_k
    m, k, n = check_matmul_inputs(x, w, block_n, block_k, split_k)
    if interpret is None:
        interpret = common.default_interpret()
    block_m = min(MAX_BLOCK_M, max(16, 1 << max(0, m - 1).bit_length()))
    out_dtype = x.dtype if split_k == 1 else jnp.float32
    steps = k // (block_k * split_k)
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, m=m, block_m=block_m, block_n=block_n, block_k=block_k, steps=steps),
        grid=(n // block_n, split_k, pl.cdiv(m, block_m)),
        in_specs=[pl.BlockSpec((m, k), lambda *_: (0, 0)), pl.BlockSpec((k, n), lambda *_: (0, 0))],
        out_specs=pl.BlockSpec((split_k * m, n), lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((split_k * m, n), out_dtype),
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"matmul_n{block_n}_k{block_k}" + (f"_s{split_k}" if split_k > 1 else ""),
    )(x, w)
    if split_k == 1:
        return out
    return out.reshape(split_k, m, n).sum(axis=0).astype(x.dtype)
