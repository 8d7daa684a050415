"""Shared conventions of the Mosaic TPU kernels: tiling rules, interpret mode, memory spaces.

The TPU kernels read the same page layout as the GPU ones (:mod:`pallas_kernels.common`):
``k_pages``/``v_pages [Hkv, P, S, D]`` per layer.  On a TPU the last two dims of an array are
tiled ``(sublanes, 128 lanes)``: one page of one head is an ``[S, D]`` tile with the head dim on
lanes and the page's token slots on sublanes, which is what a page DMA moves and what the MXU
reads, so no other layout is needed.

Tiling rules (:func:`tiling_problem`), checked by every kernel and by the engine's dispatch
(``inferscale_jax/kv_cache.py``, which falls back to the jnp references with a logged reason):

* dtype float32 or bfloat16 (compressed int8 / float8 pages stay on the references);
* ``page_size`` a multiple of the sublane count of the dtype: 8 for 32-bit, 16 for bf16, so a
  page fills whole ``(sublanes, 128)`` tiles and pages stack into one KV block without relayout;
* ``head_dim`` a multiple of 128 (whole lane tiles), or 64 (half the lanes: legal, as the block's
  last dim is the array's, at half the vector efficiency).

Interpret mode: off a TPU the kernels run under ``pltpu.InterpretParams()``, JAX's TPU interpret
mode, which executes the Mosaic kernel on the CPU and simulates its DMAs, semaphores and scalar
prefetch (``uninitialized_memory="nan"``: an unwritten buffer reads NaN, so a missed write shows).

This package imports nothing from the engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import _fail

LANES = 128
# Memory space of a ref the kernel DMAs itself (pages stay in HBM): ``pl.ANY`` (jax 0.10 / 0.11;
# older releases had it as pltpu.ANY).
ANY = getattr(pl, "ANY", None) or getattr(pltpu, "ANY")
TPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def interpret_params(interpret=None):
    """The ``interpret`` argument of ``pallas_call``: False (compile with Mosaic) on a TPU, JAX's TPU
    interpret mode elsewhere; an explicit True means interpret mode, an InterpretParams is kept."""
    if interpret is None:
        interpret = not on_tpu()
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def sublanes(dtype) -> int:
    """Rows of one ``(sublanes, 128)`` vreg tile: 8 for 32-bit values, 16 for 16-bit (packed)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def tiling_problem(head_dim: int, page_size: int, dtype) -> str | None:
    """Why pages of this shape cannot run the TPU kernels (None when they can)."""
    dtype = jnp.dtype(dtype)
    if dtype not in TPU_DTYPES:
        return (f"dtype {dtype.name} is not float32 / bfloat16 (compressed pages run the jnp references; "
                "use kv_dtype=None)")
    sub = sublanes(dtype)
    if page_size % sub:
        return (f"page_size {page_size} is not a multiple of {sub} (the {dtype.name} sublane tile); "
                f"use page_size={round_up(page_size, sub)}")
    if head_dim % LANES and head_dim != 64:
        return f"head_dim {head_dim} is not 64 or a multiple of {LANES} (the TPU lane width)"
    return None


def check_tiling(head_dim: int, page_size: int, dtype) -> None:
    problem = tiling_problem(head_dim, page_size, dtype)
    if problem:
        _fail("pages", f"[.., S={page_size}, D={head_dim}] {jnp.dtype(dtype).name}",
              f"TPU-tileable pages: {problem}")


def compiler_params(*semantics: str) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics)
