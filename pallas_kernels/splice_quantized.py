"""KV splice with a RoPE shift on compressed pages (int8 / float8_e4m3fn + a float32 scale per row).

The same move as ``splice.py`` (``K[dst] = rope(K[src], shift)``, ``V[dst] = V[src]``, same slot
contract) on pages whose rows are 1-byte codes with a scale per (token, kv head)
(``pallas_kernels/quant.py``).  A key that moves by a nonzero shift is dequantized, rotated in fp32 and
quantized again with a fresh scale, in registers, in one kernel: its added error is the second
rounding (``bench/kernels/kv_dtype.py`` section s measures it).  A zero shift and every V row copy the codes and
scales bit for bit.

Kernel: as ``splice._splice_kernel`` - grid ``(cdiv(N, T), 1, Hkv / heads_per_program)``, a program
takes ``T`` entries, computes their ``cos`` / ``sin`` once and loops over its heads - plus the scale
arrays ``[Hkv, P*S]`` gathered and scattered beside the rows.  The four outputs alias the inputs, so
inside a jit that donates the pages only ``N`` rows per head move.  ``splice_kv_quantized_ref`` is the
jnp form (gather, dequantize, rotate, quantize, scatter): V rows, zero shifts and their scales equal it
bit for bit; a rotated key may differ by an fp32 ulp (contraction into FMAs), hence its scale by one
rounding and a code by one step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.quant import codes, dequantize_kv, quantize_kv, scale_for
from pallas_kernels.splice import check_splice_inputs, entry_block, launch_knobs, rope_rotate_ref


def _check_scales(k_pages, k_scale, v_scale):
    quantized = common.check_scales(k_pages, k_scale, v_scale)
    if not quantized:
        common._fail("k_pages.dtype", k_pages.dtype, "int8 or float8_e4m3fn with k_scale / v_scale "
                     "(bf16 / fp32 pages: pallas_kernels.splice.splice_kv)")


def _splice_quantized_kernel(
    src_ref, dst_ref, shift_ref,  # [N] int32 (whole)
    inv_freq_ref,  # [D/2] fp32
    k_in_ref, v_in_ref,  # [Hkv, P*S, D] 1-byte codes
    ks_in_ref, vs_in_ref,  # [Hkv, P*S] fp32 scales
    k_out_ref, v_out_ref, ks_out_ref, vs_out_ref,  # alias the four inputs
    *,
    n: int,
    block: int,
    heads_per_program: int,
):
    hg = pl.program_id(2)
    e = entry_block(src_ref, dst_ref, shift_ref, inv_freq_ref, k_in_ref.shape[1], n=n, block=block)
    s_, d_, mask = e.src[:, None], e.dst[:, None], e.active[:, None]  # [T, 1]

    def head(j, carry):
        h = hg * heads_per_program + j
        x1, x2 = k_in_ref[h, s_, e.lo], k_in_ref[h, s_, e.hi]  # [T, D/2] codes
        sc = ks_in_ref[h, e.src]  # [T]
        f1 = x1.astype(jnp.float32) * sc[:, None]
        f2 = x2.astype(jnp.float32) * sc[:, None]
        y1, y2 = f1 * e.cos - f2 * e.sin, f2 * e.cos + f1 * e.sin  # rotated, fp32
        amax = jnp.maximum(jnp.max(jnp.abs(y1), axis=1), jnp.max(jnp.abs(y2), axis=1))  # [T]
        new = scale_for(amax, x1.dtype)
        q1, q2 = codes(y1 / new[:, None], x1.dtype), codes(y2 / new[:, None], x1.dtype)
        keep = e.keep[:, None]
        plt.store(k_out_ref.at[h, d_, e.lo], jnp.where(keep, x1, q1), mask=mask)
        plt.store(k_out_ref.at[h, d_, e.hi], jnp.where(keep, x2, q2), mask=mask)
        plt.store(ks_out_ref.at[h, e.dst], jnp.where(e.keep, sc, new), mask=e.active)
        plt.store(v_out_ref.at[h, d_, e.full], v_in_ref[h, s_, e.full], mask=mask)
        plt.store(vs_out_ref.at[h, e.dst], vs_in_ref[h, e.src], mask=e.active)
        return carry

    lax.fori_loop(0, heads_per_program, head, 0)


@functools.partial(jax.jit, static_argnames=("block", "heads_per_program", "num_warps", "num_stages",
                                             "interpret"))
def _call(k_pages, v_pages, k_scale, v_scale, src_slots, dst_slots, shift, inv_freq, *, block,
          heads_per_program, num_warps, num_stages, interpret):
    hkv, p, s, d = k_pages.shape
    n = src_slots.shape[0]
    k3, v3 = k_pages.reshape(hkv, p * s, d), v_pages.reshape(hkv, p * s, d)
    ks2, vs2 = k_scale.reshape(hkv, p * s), v_scale.reshape(hkv, p * s)
    page_spec = pl.BlockSpec((hkv, p * s, d), lambda i, l, g: (0, 0, 0))
    scale_spec = pl.BlockSpec((hkv, p * s), lambda i, l, g: (0, 0))
    vec = pl.BlockSpec((n,), lambda i, l, g: (0,))
    k_out, v_out, ks_out, vs_out = pl.pallas_call(
        functools.partial(_splice_quantized_kernel, n=n, block=block, heads_per_program=heads_per_program),
        grid=(pl.cdiv(n, block), 1, hkv // heads_per_program),
        in_specs=[vec, vec, vec, pl.BlockSpec((d // 2,), lambda i, l, g: (0,)), page_spec, page_spec,
                  scale_spec, scale_spec],
        out_specs=[page_spec, page_spec, scale_spec, scale_spec],
        out_shape=[jax.ShapeDtypeStruct(k3.shape, k3.dtype), jax.ShapeDtypeStruct(v3.shape, v3.dtype),
                   jax.ShapeDtypeStruct(ks2.shape, jnp.float32), jax.ShapeDtypeStruct(vs2.shape, jnp.float32)],
        input_output_aliases={4: 0, 5: 1, 6: 2, 7: 3},
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"splice_kv_quantized_t{block}_h{heads_per_program}",
    )(src_slots.astype(jnp.int32), dst_slots.astype(jnp.int32), shift.astype(jnp.int32), inv_freq,
      k3, v3, ks2, vs2)
    return (k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape), ks_out.reshape(k_scale.shape),
            vs_out.reshape(v_scale.shape))


def splice_kv_quantized(
    k_pages: jax.Array,  # [Hkv, P, S, D] int8 / float8_e4m3fn
    v_pages: jax.Array,
    k_scale: jax.Array,  # [Hkv, P, S] float32
    v_scale: jax.Array,
    src_slots: jax.Array,  # [N] int32
    dst_slots: jax.Array,  # [N] int32, distinct, disjoint from src_slots; < 0 = padding
    shift: jax.Array,  # [N] int32
    inv_freq: jax.Array,  # [D/2] float32
    *,
    block_tokens: int | None = None,
    heads_per_program: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # (k, v, k_scale, v_scale), in place when donated
    """Copy K/V rows and their scales from ``src_slots`` to ``dst_slots``, re-rotating and requantizing
    the keys whose ``shift`` is nonzero (see module doc).  One layer's pages."""
    _, hkv, _, _, d, n = check_splice_inputs(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq)
    if k_pages.ndim != 4:
        common._fail("k_pages.shape", k_pages.shape, "[Hkv, P, S, D] (one layer)")
    _check_scales(k_pages, k_scale, v_scale)
    if n == 0:
        return k_pages, v_pages, k_scale, v_scale
    block_tokens, heads_per_program, interpret = launch_knobs(n, 1, hkv, d, block_tokens, heads_per_program,
                                                              interpret)
    return _call(k_pages, v_pages, k_scale, v_scale, src_slots, dst_slots, shift, inv_freq,
                 block=block_tokens, heads_per_program=heads_per_program, num_warps=num_warps,
                 num_stages=num_stages, interpret=interpret)


def splice_kv_quantized_ref(k_pages, v_pages, k_scale, v_scale, src_slots, dst_slots, shift, inv_freq):
    """jnp form of :func:`splice_kv_quantized` (same contract): a token whose K moves by a nonzero shift
    is dequantized, re-rotated and quantized again (its added error is the second rounding); a zero
    shift and every V copy the bytes and scales exactly."""
    hkv, p, s, d = k_pages.shape
    k, v = k_pages.reshape(hkv, p * s, d), v_pages.reshape(hkv, p * s, d)
    ks, vs = k_scale.reshape(hkv, p * s), v_scale.reshape(hkv, p * s)
    active = dst_slots >= 0
    src = jnp.where(active, src_slots, 0)
    dst = jnp.where(active, dst_slots, p * s)  # out of bounds: dropped by the scatter
    kq, kss = k[:, src], ks[:, src]  # [Hkv, N, D], [Hkv, N]
    rq, rs = quantize_kv(rope_rotate_ref(dequantize_kv(kq, kss, jnp.float32), shift, inv_freq), k.dtype)
    keep = (shift == 0)[None, :]
    kq = jnp.where(keep[..., None], kq, rq)
    kss = jnp.where(keep, kss, rs)
    k = k.at[:, dst].set(kq, mode="drop")
    ks = ks.at[:, dst].set(kss, mode="drop")
    v = v.at[:, dst].set(v[:, src], mode="drop")
    vs = vs.at[:, dst].set(vs[:, src], mode="drop")
    return (k.reshape(k_pages.shape), v.reshape(v_pages.shape), ks.reshape(k_scale.shape),
            vs.reshape(v_scale.shape))
