"""KV splice with a RoPE shift on a TPU (Mosaic): copy cached tokens to new slots, re-rotating K.

Same contract as :func:`pallas_kernels.splice.splice_kv` (and its reference
:func:`~pallas_kernels.splice.splice_kv_ref`, and validator): ``K[dst[i]] = rope(K[src[i]],
shift[i])`` (HF ``rotate_half`` layout, fp32 math, stored in the page dtype; ``shift == 0`` a
bit-exact copy), ``V[dst[i]] = V[src[i]]``, for every kv head (and layer of a stacked
``[L, Hkv, P, S, D]`` cache); destinations distinct and disjoint from the sources; entries with
``dst < 0`` are padding, skipped.

Kernel: the pages are viewed as ``[L * Hkv, P, S, D]`` and stay in HBM (``memory_space=ANY``, the
outputs aliasing the inputs); the slots are scalar prefetch (SMEM).  Grid ``(L * Hkv, cdiv(N, T))``:
a program takes ``T`` entries of one head.  It starts one DMA per entry gathering the K row into a
``[T, D]`` VMEM tile and one HBM -> HBM DMA per entry copying the V row straight to its
destination, waits for the K rows, rotates the tile at once - ``x * cos + roll(x, D/2) * sin'``
with ``sin' = [-sin, sin]`` (``roll`` by half the lanes swaps the halves, so this is
``rotate_half``; ``pltpu.roll`` is a lane rotation on the XLU) - and scatters the rows back with
one DMA each.  ``cos`` / ``sin'`` ``[N, D]`` and the keep flags (``shift == 0``) are computed by the
wrapper in XLA (N x D values, negligible) and arrive as VMEM tiles through the BlockSpec pipeline;
a kept row is stored from the loaded bits, so -0.0 and NaN payloads survive.
``T`` is a multiple of the sublane tile (8 fp32, 16 bf16), at most 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.splice import check_splice_inputs, splice_kv_ref
from pallas_kernels.tpu import common as tpu_common

__all__ = ["splice_kv_tpu", "splice_kv_ref"]


def _splice_kernel(src_ref, dst_ref, cos_ref, sin_ref, keep_ref, k_in, v_in, k_out, v_out, k_buf, o_buf, sem, *,
                   block: int, page_size: int, num_slots: int):
    """src_ref / dst_ref [N'] (SMEM); cos_ref / sin_ref [T, D] fp32, keep_ref [T, 1] int32 (VMEM, this
    block); pages [L*Hkv, P, S, D] (HBM, out aliases in); k_buf / o_buf [T, D] VMEM; sem: 2 DMA sems."""
    lh = pl.program_id(0)
    first = pl.program_id(1) * block

    def entry(i):  # (active, src page, src offset, dst page, dst offset)
        src, dst = src_ref[first + i], dst_ref[first + i]
        active = (dst >= 0) & (dst < num_slots)  # traced bad destinations: skipped
        src = jnp.where((src >= 0) & (src < num_slots), src, 0)  # never read out of bounds
        dst = jnp.where(active, dst, 0)
        return active, src // page_size, src % page_size, dst // page_size, dst % page_size

    def k_gather(i):  # K row -> row i of the VMEM tile
        _, sp, so, _, _ = entry(i)
        return pltpu.make_async_copy(k_in.at[lh, sp, pl.ds(so, 1)], k_buf.at[pl.ds(i, 1)], sem.at[0])

    def v_copy(i):  # V row -> its destination, HBM to HBM
        _, sp, so, dp, do = entry(i)
        return pltpu.make_async_copy(v_in.at[lh, sp, pl.ds(so, 1)], v_out.at[lh, dp, pl.ds(do, 1)], sem.at[1])

    def scatter(i):
        _, _, _, dp, do = entry(i)
        return pltpu.make_async_copy(o_buf.at[pl.ds(i, 1)], k_out.at[lh, dp, pl.ds(do, 1)], sem.at[0])

    def each(fn):  # run fn(i) for the active entries of the block
        def body(i, carry):
            @pl.when(entry(i)[0])
            def _():
                fn(i)
            return carry
        lax.fori_loop(0, block, body, 0)

    each(lambda i: (k_gather(i).start(), v_copy(i).start()))
    each(lambda i: k_gather(i).wait())
    x = k_buf[...]
    xf = x.astype(jnp.float32)
    rotated = xf * cos_ref[...] + pltpu.roll(xf, xf.shape[1] // 2, 1) * sin_ref[...]
    o_buf[...] = jnp.where(keep_ref[...] != 0, x, rotated.astype(x.dtype))
    each(lambda i: scatter(i).start())
    each(lambda i: scatter(i).wait())
    each(lambda i: v_copy(i).wait())


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def _splice_call(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq, *, block, interpret):
    shape = k_pages.shape
    *_, p, s, d = shape
    k4, v4 = k_pages.reshape(-1, p, s, d), v_pages.reshape(-1, p, s, d)  # [L*Hkv, P, S, D]
    n = src_slots.shape[0]
    pad = tpu_common.round_up(n, block) - n
    src = jnp.pad(src_slots.astype(jnp.int32), (0, pad))
    dst = jnp.pad(dst_slots.astype(jnp.int32), (0, pad), constant_values=-1)
    sh = jnp.pad(shift.astype(jnp.int32), (0, pad))
    angle = sh.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [N', D/2], as splice_kv_ref
    cos = jnp.concatenate([jnp.cos(angle)] * 2, axis=1)
    sin = jnp.concatenate([-jnp.sin(angle), jnp.sin(angle)], axis=1)
    keep = (sh == 0).astype(jnp.int32)[:, None]
    hbm = pl.BlockSpec(memory_space=tpu_common.ANY)
    rows = pl.BlockSpec((block, d), lambda lh, i, *_: (i, 0))
    k_out, v_out = pl.pallas_call(
        functools.partial(_splice_kernel, block=block, page_size=s, num_slots=p * s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(k4.shape[0], (n + pad) // block),
            in_specs=[rows, rows, pl.BlockSpec((block, 1), lambda lh, i, *_: (i, 0)), hbm, hbm],
            out_specs=[hbm, hbm],
            scratch_shapes=[pltpu.VMEM((block, d), k4.dtype), pltpu.VMEM((block, d), k4.dtype),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(k4.shape, k4.dtype), jax.ShapeDtypeStruct(v4.shape, v4.dtype)],
        input_output_aliases={5: 0, 6: 1},  # (operand indices count the scalar-prefetch slots)
        compiler_params=tpu_common.compiler_params(pltpu.PARALLEL, pltpu.ARBITRARY),
        interpret=interpret,
        name=f"splice_kv_tpu_t{block}",
    )(src, dst, cos, sin, keep, k4, v4)
    return k_out.reshape(shape), v_out.reshape(shape)


def splice_kv_tpu(
    k_pages: jax.Array,  # [Hkv, P, S, D] or [L, Hkv, P, S, D]
    v_pages: jax.Array,  # same shape and dtype
    src_slots: jax.Array,  # [N] int32
    dst_slots: jax.Array,  # [N] int32, distinct, disjoint from src_slots; < 0 = padding
    shift: jax.Array,  # [N] int32 positions to rotate K by (new_pos - old_pos)
    inv_freq: jax.Array,  # [D/2] float32 RoPE inverse frequencies
    *,
    block_tokens: int | None = None,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:  # (k_pages, v_pages), updated in place when donated
    """TPU variant of :func:`pallas_kernels.splice.splice_kv` (same contract; see module doc)."""
    _, _, _, s, d, n = check_splice_inputs(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq)
    tpu_common.check_tiling(d, s, k_pages.dtype)
    if n == 0:
        return k_pages, v_pages
    sub = tpu_common.sublanes(k_pages.dtype)
    block = block_tokens or min(64, tpu_common.round_up(n, sub))
    if block % sub:
        common._fail("block_tokens", block, f"a multiple of {sub} (the {k_pages.dtype} sublane tile)")
    return _splice_call(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq, block=block,
                        interpret=tpu_common.interpret_params(interpret))
