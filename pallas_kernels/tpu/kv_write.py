"""Write new tokens' K/V into their cache slots on a TPU (Mosaic): one DMA per token, all heads.

Same contract as :func:`pallas_kernels.kv_write.write_kv` (and its reference
:func:`~pallas_kernels.kv_write.write_kv_ref`, and validator): ``k_new``/``v_new [N, Hkv, D]`` go to
``slots [N]`` (``page * S + offset``) of ``k_pages``/``v_pages [Hkv, P, S, D]``; padding tokens carry
a null-page slot; a slot outside ``[0, P*S)`` (not checkable when traced) is sent to the null page's
slot 0, never out of bounds.

Kernel: the wrapper lays the new rows out heads-major, ``[Hkv, N, D]`` (a small XLA transpose), so
token ``t``'s rows of every head are one strided ``[Hkv, 1, D]`` window, the same shape as its slot's
window ``[:, page, offset]`` of the pages.  Everything stays in HBM (``memory_space=ANY``); the slots
are scalar prefetch (SMEM).  Grid ``(cdiv(N, T),)``: a program starts the HBM -> HBM DMAs of its
``T`` tokens (K and V, one semaphore) and then waits for all of them, so up to ``2 T`` copies are in
flight.  The page outputs alias the inputs (``input_output_aliases``): inside a jit that donates the
pages only the N rows move.  Tokens past N in the last block start nothing.

Two tokens with one slot (padding in the null page) race; whichever lands is irrelevant, as in the
GPU kernel.  A first real-TPU run should time this against the XLA scatter (``write_kv``), which
is the better choice if the per-token DMAs' issue cost dominates (bench/kernels/kernels.py times both).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.kv_write import check_write_inputs, write_kv_ref
from pallas_kernels.tpu import common as tpu_common

__all__ = ["write_kv_tpu", "write_kv_ref"]


def _write_kernel(slots_ref, k_new, v_new, k_in, v_in, k_out, v_out, sem, *, n: int, block: int, page_size: int,
                  num_slots: int):
    """slots_ref [N] (SMEM); k_new / v_new [Hkv, N, D], pages [Hkv, P, S, D] (all HBM; out aliases in)."""
    del k_in, v_in  # aliased with the outputs; untouched rows keep their values
    first = pl.program_id(0) * block

    def copies(i):
        tok = first + i
        slot = slots_ref[jnp.minimum(tok, n - 1)]
        slot = jnp.where((slot >= 0) & (slot < num_slots), slot, 0)  # bad slot -> the null page
        page, off = slot // page_size, slot % page_size
        return [pltpu.make_async_copy(new.at[:, pl.ds(tok, 1)], out.at[:, page, pl.ds(off, 1)], sem.at[0])
                for new, out in ((k_new, k_out), (v_new, v_out))]

    def start(i, carry):
        @pl.when(first + i < n)
        def _():
            for c in copies(i):
                c.start()
        return carry

    def wait(i, carry):
        @pl.when(first + i < n)
        def _():
            for c in copies(i):
                c.wait()
        return carry

    lax.fori_loop(0, block, start, 0)
    lax.fori_loop(0, block, wait, 0)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
def _write_call(k_pages, v_pages, k_new, v_new, slots, *, block_tokens, interpret):
    hkv, p, s, _ = k_pages.shape
    n = k_new.shape[0]
    hbm = pl.BlockSpec(memory_space=tpu_common.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, n=n, block=block_tokens, page_size=s, num_slots=p * s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(pl.cdiv(n, block_tokens),), in_specs=[hbm] * 4, out_specs=[hbm] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},  # (operand indices count the scalar-prefetch slots)
        compiler_params=tpu_common.compiler_params(pltpu.ARBITRARY),
        interpret=interpret,
        name=f"write_kv_tpu_t{block_tokens}",
    )(slots.astype(jnp.int32), jnp.swapaxes(k_new, 0, 1), jnp.swapaxes(v_new, 0, 1), k_pages, v_pages)


def write_kv_tpu(
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    k_new: jax.Array,  # [N, Hkv, D]
    v_new: jax.Array,  # [N, Hkv, D]
    slots: jax.Array,  # [N] int32, page * S + offset (padding: a null-page slot)
    *,
    block_tokens: int = 64,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """TPU variant of :func:`pallas_kernels.kv_write.write_kv` (same contract; see module doc)."""
    _, _, s, d, n = check_write_inputs(k_pages, v_pages, k_new, v_new, slots)
    tpu_common.check_tiling(d, s, k_pages.dtype)
    if block_tokens < 1:
        common._fail("block_tokens", block_tokens, ">= 1 (tokens per program)")
    if n == 0:
        return k_pages, v_pages
    return _write_call(k_pages, v_pages, k_new, v_new, slots, block_tokens=min(block_tokens, n),
                       interpret=tpu_common.interpret_params(interpret))
