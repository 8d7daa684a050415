"""Write new tokens' K/V into their cache slots (the paged-cache update of every forward step).

``k_new``/``v_new [N, Hkv, D]`` are the projected keys (already RoPE-rotated) and values of
``N`` tokens; ``slots [N]`` gives each token's slot ``page * S + offset`` (see ``common``).
Padding tokens carry a slot in the null page 0; several may share one, and whichever value
lands there is irrelevant because the null page is never read unmasked.  Slots outside
``[0, P*S)`` (not checkable on traced values) are dropped by the XLA scatter and sent to the
null page by the kernel: never written out of bounds.

Two implementations with one contract:

* :func:`write_kv` - an XLA scatter on the ``[Hkv, P*S, D]`` view (the default: one fused
  kernel, in place when the pages are donated).
* :func:`write_kv_pallas` - a Triton-style kernel, grid ``(cdiv(N, T), Hkv)``: a program
  gathers ``T`` rows of head ``h`` from ``k_new``/``v_new`` and scatters them to their slots.
  The tail of the last block re-writes token ``N - 1`` (same slot, same value) instead of
  masking, which is exact both on the GPU and in interpret mode.  Outputs alias the pages.

``bench/kernels/kernels.py`` times both; keep whichever is faster as the engine's choice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.quant import quantize_kv


def check_write_inputs(k_pages, v_pages, k_new, v_new, slots) -> tuple[int, int, int, int, int]:
    """Validate; return (Hkv, P, S, D, N)."""
    hkv, p, s, d = common.check_pages(k_pages, v_pages)
    if k_new.ndim != 3 or k_new.shape[1:] != (hkv, d):
        common._fail("k_new.shape", k_new.shape, f"[N, {hkv}, {d}] = [N, Hkv, D] of the pages")
    if v_new.shape != k_new.shape:
        common._fail("v_new.shape", v_new.shape, f"the shape of k_new {k_new.shape}")
    common.check_dtype("k_new", k_new, k_pages.dtype)
    common.check_dtype("v_new", v_new, k_pages.dtype)
    n = k_new.shape[0]
    common.check_int_vector("slots", slots, n)
    return hkv, p, s, d, n


@jax.jit
def write_kv(
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    k_new: jax.Array,  # [N, Hkv, D]
    v_new: jax.Array,  # [N, Hkv, D]
    slots: jax.Array,  # [N] int32, page * S + offset (padding: a null-page slot)
) -> tuple[jax.Array, jax.Array]:
    """Scatter ``k_new``/``v_new`` into their slots (XLA scatter; in place when donated)."""
    hkv, p, s, d, _ = check_write_inputs(k_pages, v_pages, k_new, v_new, slots)

    def put(pages, new):
        flat = pages.reshape(hkv, p * s, d)  # [Hkv, P*S, D]
        return flat.at[:, slots].set(jnp.swapaxes(new, 0, 1), mode="drop").reshape(pages.shape)

    return put(k_pages, k_new), put(v_pages, v_new)


def _write_kernel(slots_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref,
                  *, n: int, block: int):
    # slots_ref [N]; k_new_ref/v_new_ref [N, Hkv, D] (whole); k/v refs [P*S, D] (head h)
    del k_in_ref, v_in_ref  # aliased with the outputs; untouched rows keep their values
    i, h = pl.program_id(0), pl.program_id(1)
    d = k_new_ref.shape[-1]
    r = jnp.minimum(i * block + jnp.arange(block, dtype=jnp.int32), n - 1)  # [T]
    slot = slots_ref[r]  # [T]
    num_slots = k_out_ref.shape[0]
    slot = jnp.where((slot >= 0) & (slot < num_slots), slot, 0)[:, None]  # bad slot -> null page
    col = jnp.arange(d, dtype=jnp.int32)[None, :]  # [1, D]
    k_out_ref[slot, col] = k_new_ref[r[:, None], h, col]  # [T, D]
    v_out_ref[slot, col] = v_new_ref[r[:, None], h, col]


@functools.partial(jax.jit, static_argnames=("block_tokens", "num_warps", "interpret"))
def write_kv_pallas(
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    k_new: jax.Array,  # [N, Hkv, D]
    v_new: jax.Array,  # [N, Hkv, D]
    slots: jax.Array,  # [N] int32
    *,
    block_tokens: int = 64,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas variant of :func:`write_kv` (same contract)."""
    hkv, p, s, d, n = check_write_inputs(k_pages, v_pages, k_new, v_new, slots)
    common.check_power_of_two("block_tokens", block_tokens)
    common.check_power_of_two("head_dim", d)
    if n == 0:
        return k_pages, v_pages
    if interpret is None:
        interpret = common.default_interpret()
    k3 = k_pages.reshape(hkv, p * s, d)  # [Hkv, P*S, D]
    v3 = v_pages.reshape(hkv, p * s, d)
    page_spec = pl.BlockSpec((None, p * s, d), lambda i, h: (h, 0, 0))
    new_spec = pl.BlockSpec((n, hkv, d), lambda i, h: (0, 0, 0))
    k_out, v_out = pl.pallas_call(
        functools.partial(_write_kernel, n=n, block=block_tokens),
        grid=(pl.cdiv(n, block_tokens), hkv),
        in_specs=[pl.BlockSpec((n,), lambda i, h: (0,)), new_spec, new_spec, page_spec,
                  page_spec],
        out_specs=[page_spec, page_spec],
        out_shape=[jax.ShapeDtypeStruct(k3.shape, k3.dtype),
                   jax.ShapeDtypeStruct(v3.shape, v3.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=common.compiler_params(num_warps, 1),
        interpret=interpret,
        name=f"write_kv_t{block_tokens}",
    )(slots.astype(jnp.int32), k_new, v_new, k3, v3)
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


def write_kv_ref(k_pages, v_pages, k_new, v_new, slots):
    """Reference: per-token (page, offset) update of the 4-D page arrays."""
    check_write_inputs(k_pages, v_pages, k_new, v_new, slots)
    s = k_pages.shape[2]
    page, off = slots // s, slots % s  # [N]
    k = k_pages.at[:, page, off].set(jnp.swapaxes(k_new, 0, 1))
    v = v_pages.at[:, page, off].set(jnp.swapaxes(v_new, 0, 1))
    return k, v


@jax.jit
def write_kv_quantized(
    k_pages: jax.Array,  # [Hkv, P, S, D] int8 / float8_e4m3fn
    v_pages: jax.Array,
    k_scale: jax.Array,  # [Hkv, P, S] float32: one scale per (token, head) (pallas_kernels/quant.py)
    v_scale: jax.Array,
    k_new: jax.Array,  # [N, Hkv, D] the model's dtype
    v_new: jax.Array,
    slots: jax.Array,  # [N] int32
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantize the new tokens (per token and head) and scatter values and scales into their slots."""
    hkv, p, s, d = k_pages.shape

    def put(pages, scales, new):
        q, sc = quantize_kv(new, pages.dtype)  # [N, Hkv, D], [N, Hkv]
        flat = pages.reshape(hkv, p * s, d).at[:, slots].set(jnp.swapaxes(q, 0, 1), mode="drop")
        sflat = scales.reshape(hkv, p * s).at[:, slots].set(sc.T, mode="drop")
        return flat.reshape(pages.shape), sflat.reshape(scales.shape)

    kp, ks = put(k_pages, k_scale, k_new)
    vp, vs = put(v_pages, v_scale, v_new)
    return kp, vp, ks, vs


def _write_quant_kernel(slots_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, ks_in_ref, vs_in_ref,
                        k_out_ref, v_out_ref, ks_out_ref, vs_out_ref, *, n: int, block: int):
    # as _write_kernel, and each row is quantized on the way (quant.quantize_kv, in registers)
    del k_in_ref, v_in_ref, ks_in_ref, vs_in_ref  # aliased with the outputs
    i, h = pl.program_id(0), pl.program_id(1)
    d = k_new_ref.shape[-1]
    r = jnp.minimum(i * block + jnp.arange(block, dtype=jnp.int32), n - 1)  # [T]
    slot = slots_ref[r]
    num_slots = k_out_ref.shape[0]
    slot = jnp.where((slot >= 0) & (slot < num_slots), slot, 0)  # bad slot -> null page
    col = jnp.arange(d, dtype=jnp.int32)[None, :]
    for new_ref, out_ref, sc_ref in ((k_new_ref, k_out_ref, ks_out_ref), (v_new_ref, v_out_ref, vs_out_ref)):
        q, scale = quantize_kv(new_ref[r[:, None], h, col], out_ref.dtype)  # [T, D], [T]
        out_ref[slot[:, None], col] = q
        sc_ref[slot] = scale


@functools.partial(jax.jit, static_argnames=("block_tokens", "num_warps", "interpret"))
def write_kv_quantized_pallas(
    k_pages: jax.Array,  # [Hkv, P, S, D] int8 / float8_e4m3fn
    v_pages: jax.Array,
    k_scale: jax.Array,  # [Hkv, P, S] float32
    v_scale: jax.Array,
    k_new: jax.Array,  # [N, Hkv, D]
    v_new: jax.Array,
    slots: jax.Array,  # [N] int32
    *,
    block_tokens: int = 64,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pallas variant of :func:`write_kv_quantized` (same contract): the quantization happens in the
    kernel that scatters, one pass over the new tokens."""
    hkv, p, s, d = k_pages.shape
    n = k_new.shape[0]
    common.check_scales(k_pages, k_scale, v_scale)
    common.check_int_vector("slots", slots, n)
    common.check_power_of_two("block_tokens", block_tokens)
    if n == 0:
        return k_pages, v_pages, k_scale, v_scale
    if interpret is None:
        interpret = common.default_interpret()
    k3, v3 = k_pages.reshape(hkv, p * s, d), v_pages.reshape(hkv, p * s, d)
    ks2, vs2 = k_scale.reshape(hkv, p * s), v_scale.reshape(hkv, p * s)
    page_spec = pl.BlockSpec((None, p * s, d), lambda i, h: (h, 0, 0))
    scale_spec = pl.BlockSpec((None, p * s), lambda i, h: (h, 0))
    new_spec = pl.BlockSpec((n, hkv, d), lambda i, h: (0, 0, 0))
    outs = pl.pallas_call(
        functools.partial(_write_quant_kernel, n=n, block=block_tokens),
        grid=(pl.cdiv(n, block_tokens), hkv),
        in_specs=[pl.BlockSpec((n,), lambda i, h: (0,)), new_spec, new_spec, page_spec, page_spec, scale_spec,
                  scale_spec],
        out_specs=[page_spec, page_spec, scale_spec, scale_spec],
        out_shape=[jax.ShapeDtypeStruct(k3.shape, k3.dtype), jax.ShapeDtypeStruct(v3.shape, v3.dtype),
                   jax.ShapeDtypeStruct(ks2.shape, jnp.float32), jax.ShapeDtypeStruct(vs2.shape, jnp.float32)],
        input_output_aliases={3: 0, 4: 1, 5: 2, 6: 3},
        compiler_params=common.compiler_params(num_warps, 1),
        interpret=interpret,
        name=f"write_kv_quantized_t{block_tokens}",
    )(slots.astype(jnp.int32), k_new, v_new, k3, v3, ks2, vs2)
    return (outs[0].reshape(k_pages.shape), outs[1].reshape(v_pages.shape), outs[2].reshape(k_scale.shape),
            outs[3].reshape(v_scale.shape))
