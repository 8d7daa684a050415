"""KV splice with a RoPE shift: move cached tokens to new slots and re-rotate their keys.

When a cached KV segment (e.g. an injected document) is placed at a different position than
the one it was computed at, its keys must be rotated by the position difference ``shift``:
RoPE rotations compose, ``R(p + d) = R(d) R(p)``, so ``K`` cached at position ``p`` becomes
the key of position ``p + d`` without recomputing the layer.  Values are position free and are
copied unchanged.

For every entry ``i`` and every KV head (and layer):

* ``K[dst[i]] = rope(K[src[i]], shift[i])`` with the HF ``rotate_half`` layout:
  ``x1, x2 = x[:D/2], x[D/2:]``, ``a = shift * inv_freq`` (``[D/2]``, any llama3-style scaling
  already folded in by the model), ``out = (x1 cos a - x2 sin a, x2 cos a + x1 sin a)``,
  computed in fp32 and stored in the page dtype.  ``shift == 0`` is a bit-exact copy (the
  kernel selects the loaded value, so even -0.0 and NaN payloads survive).
* ``V[dst[i]] = V[src[i]]``.

Slots are ``page * S + offset`` (see ``common``).  Contract: the destination slots are distinct
and no destination is also a source (so the kernel may read and write the same buffer in any
order); this is checked on the host when the slot arrays are concrete (not traced).  Padding
entries have ``dst_slot < 0`` and are skipped (their ``src_slot`` is ignored; use 0).

Kernel: the pages are viewed as ``[L, Hkv, P*S, D]`` (``L = 1`` for one layer's
``[Hkv, P, S, D]`` arrays; a stacked ``[L, Hkv, P, S, D]`` cache is spliced in one call).  Grid
``(cdiv(N, T), L, Hkv / heads_per_program)``: a program takes ``T`` entries, computes their
``cos``/``sin`` ``[T, D/2]`` once and loops over its heads, gathering the ``[T, D/2]`` halves of
K and the ``[T, D]`` rows of V (each row is contiguous, ``D * itemsize`` bytes) and scattering
them with a masked store.  The outputs alias the inputs (``input_output_aliases``), so inside a
jit that donates the pages the update is in place and only ``N`` rows per head move.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

PROGRAMS_PER_SM = 2


def check_splice_inputs(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq):
    """Validate splice inputs; return (L, Hkv, P, S, D, N).  Pages: [Hkv,P,S,D] or [L,Hkv,P,S,D]."""
    if k_pages.ndim not in (4, 5):
        common._fail("k_pages.shape", k_pages.shape, "[Hkv, P, S, D] or [L, Hkv, P, S, D]")
    lead = k_pages.shape[:-4]
    if v_pages.shape[:-4] != lead:
        common._fail("v_pages.shape", v_pages.shape, f"the shape of k_pages {k_pages.shape}")
    hkv, p, s, d = common.check_pages(k_pages.reshape(-1, *k_pages.shape[-3:]),
                                      v_pages.reshape(-1, *v_pages.shape[-3:]))
    num_layers = int(lead[0]) if lead else 1
    hkv //= num_layers
    if d % 2:
        common._fail("head_dim", d, "an even number (RoPE rotates pairs)")
    n = int(src_slots.shape[0]) if src_slots.ndim == 1 else -1
    common.check_int_vector("src_slots", src_slots, n)
    common.check_int_vector("dst_slots", dst_slots, n)
    common.check_int_vector("shift", shift, n)
    if inv_freq.shape != (d // 2,):
        common._fail("inv_freq.shape", inv_freq.shape, f"({d // 2},) = head_dim // 2")
    common.check_dtype("inv_freq", inv_freq, jnp.float32)
    if common.is_concrete(src_slots, dst_slots):
        _check_slots_host(np.asarray(src_slots), np.asarray(dst_slots), p * s)
    return num_layers, hkv, p, s, d, n


def _check_slots_host(src: np.ndarray, dst: np.ndarray, num_slots: int) -> None:
    active = dst >= 0
    src, dst = src[active], dst[active]
    for name, x in (("src_slots", src), ("dst_slots", dst)):
        if x.size and (x.min() < 0 or x.max() >= num_slots):
            common._fail(name, f"range [{x.min()}, {x.max()}]", f"slots in [0, {num_slots})")
    if np.unique(dst).size != dst.size:
        common._fail("dst_slots", "duplicate destinations", "distinct destination slots")
    both = np.intersect1d(src, dst)
    if both.size:
        common._fail("src_slots/dst_slots", f"slots {both[:8].tolist()} are both",
                     "disjoint sources and destinations (splice in two calls)")


def auto_blocking(n: int, num_layers: int, hkv: int) -> tuple[int, int]:
    """(T, heads_per_program): big blocks, shrunk until the grid has ~2 programs per SM."""
    want = PROGRAMS_PER_SM * common.num_sms()
    t, hpp = 64, hkv

    def programs():
        return pl.cdiv(n, t) * num_layers * (hkv // hpp)

    while programs() < want and hpp % 2 == 0 and hpp > 1:
        hpp //= 2
    while programs() < want and t > 16:
        t //= 2
    return t, hpp


def launch_knobs(n: int, num_layers: int, hkv: int, d: int, block_tokens, heads_per_program, interpret):
    """(block_tokens, heads_per_program, interpret) of a splice call: the defaults filled in
    (``auto_blocking``, the backend's interpret mode) and the values checked."""
    common.check_power_of_two("head_dim // 2", d // 2)
    t, hpp = auto_blocking(n, num_layers, hkv)
    block_tokens = block_tokens or t
    heads_per_program = heads_per_program or hpp
    common.check_power_of_two("block_tokens", block_tokens)
    if hkv % heads_per_program:
        common._fail("heads_per_program", heads_per_program, f"a divisor of Hkv={hkv}")
    return block_tokens, heads_per_program, common.default_interpret() if interpret is None else interpret


class Entries(NamedTuple):
    """One program's ``T`` splice entries, as both splice kernels index the pages with them."""
    src: jax.Array  # [T] source slots, clamped into the pages
    dst: jax.Array  # [T] destination slots (an inactive entry's own source)
    active: jax.Array  # [T] bool
    keep: jax.Array  # [T] bool: shift == 0, a bit-exact copy
    cos: jax.Array  # [T, D/2] fp32
    sin: jax.Array  # [T, D/2] fp32
    lo: jax.Array  # [1, D/2] columns of the first half
    hi: jax.Array  # [1, D/2] columns of the second half
    full: jax.Array  # [1, D] every column


def entry_block(src_ref, dst_ref, shift_ref, inv_freq_ref, num_slots: int, *, n: int, block: int) -> Entries:
    """Program ``pl.program_id(0)``'s ``T = block`` entries.  Sources are clamped into the pages (never
    read out of bounds); entries past ``n`` or with a bad destination are inactive (traced bad slots are
    skipped), and point their destination at their own source: inactive lanes are masked on the GPU,
    but in interpret mode a masked lane rewrites the old value of its address, so it must never be a
    destination."""
    rows = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)  # [T]
    r = jnp.minimum(rows, n - 1)
    src = src_ref[r]
    src = jnp.where((src >= 0) & (src < num_slots), src, 0)
    dst = dst_ref[r]
    active = (rows < n) & (dst >= 0) & (dst < num_slots)
    dst = jnp.where(active, dst, src)
    shift = shift_ref[r]
    angle = shift.astype(jnp.float32)[:, None] * inv_freq_ref[...][None, :]  # [T, D/2]
    d2 = inv_freq_ref.shape[0]
    lo = jnp.arange(d2, dtype=jnp.int32)[None, :]
    return Entries(src, dst, active, shift == 0, jnp.cos(angle), jnp.sin(angle), lo, lo + d2,
                   jnp.arange(2 * d2, dtype=jnp.int32)[None, :])


def _splice_kernel(
    src_ref,  # [N] int32 (whole)
    dst_ref,  # [N] int32
    shift_ref,  # [N] int32
    inv_freq_ref,  # [D/2] fp32
    k_in_ref,  # [Hkv, P*S, D] (layer l)
    v_in_ref,  # [Hkv, P*S, D]
    k_out_ref,  # [Hkv, P*S, D] aliases k_in
    v_out_ref,  # [Hkv, P*S, D] aliases v_in
    *,
    n: int,
    block: int,
    heads_per_program: int,
):
    hg = pl.program_id(2)
    e = entry_block(src_ref, dst_ref, shift_ref, inv_freq_ref, k_in_ref.shape[1], n=n, block=block)
    keep = e.keep[:, None]  # [T, 1] bit-exact copy
    s_, d_, mask = e.src[:, None], e.dst[:, None], e.active[:, None]  # [T, 1]

    def head(j, carry):
        h = hg * heads_per_program + j
        x1 = k_in_ref[h, s_, e.lo]  # [T, D/2] page dtype
        x2 = k_in_ref[h, s_, e.hi]
        f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        y1 = jnp.where(keep, x1, (f1 * e.cos - f2 * e.sin).astype(x1.dtype))
        y2 = jnp.where(keep, x2, (f2 * e.cos + f1 * e.sin).astype(x2.dtype))
        plt.store(k_out_ref.at[h, d_, e.lo], y1, mask=mask)
        plt.store(k_out_ref.at[h, d_, e.hi], y2, mask=mask)
        plt.store(v_out_ref.at[h, d_, e.full], v_in_ref[h, s_, e.full], mask=mask)
        return carry

    lax.fori_loop(0, heads_per_program, head, 0)


@functools.partial(jax.jit, static_argnames=("block", "heads_per_program", "num_warps",
                                             "num_stages", "interpret"))
def _splice_call(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq, *, block,
                 heads_per_program, num_warps, num_stages, interpret):
    shape = k_pages.shape
    *lead, hkv, p, s, d = shape
    num_layers = lead[0] if lead else 1
    n = src_slots.shape[0]
    k4 = k_pages.reshape(num_layers, hkv, p * s, d)  # [L, Hkv, P*S, D]
    v4 = v_pages.reshape(num_layers, hkv, p * s, d)
    page_spec = pl.BlockSpec((None, hkv, p * s, d), lambda i, l, g: (l, 0, 0, 0))
    vec = pl.BlockSpec((n,), lambda i, l, g: (0,))
    k_out, v_out = pl.pallas_call(
        functools.partial(_splice_kernel, n=n, block=block, heads_per_program=heads_per_program),
        grid=(pl.cdiv(n, block), num_layers, hkv // heads_per_program),
        in_specs=[vec, vec, vec, pl.BlockSpec((d // 2,), lambda i, l, g: (0,)), page_spec,
                  page_spec],
        out_specs=[page_spec, page_spec],
        out_shape=[jax.ShapeDtypeStruct(k4.shape, k4.dtype),
                   jax.ShapeDtypeStruct(v4.shape, v4.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=common.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"splice_kv_t{block}_h{heads_per_program}",
    )(src_slots.astype(jnp.int32), dst_slots.astype(jnp.int32), shift.astype(jnp.int32),
      inv_freq, k4, v4)
    return k_out.reshape(shape), v_out.reshape(shape)


def splice_kv(
    k_pages: jax.Array,  # [Hkv, P, S, D] or [L, Hkv, P, S, D]
    v_pages: jax.Array,  # same shape and dtype
    src_slots: jax.Array,  # [N] int32
    dst_slots: jax.Array,  # [N] int32, distinct, disjoint from src_slots; < 0 = padding
    shift: jax.Array,  # [N] int32 positions to rotate K by (new_pos - old_pos)
    inv_freq: jax.Array,  # [D/2] float32 RoPE inverse frequencies
    *,
    block_tokens: int | None = None,
    heads_per_program: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:  # (k_pages, v_pages), updated in place when donated
    """Copy K/V from ``src_slots`` to ``dst_slots``, rotating K by ``shift`` (see module doc)."""
    num_layers, hkv, _, _, d, n = check_splice_inputs(k_pages, v_pages, src_slots, dst_slots,
                                                      shift, inv_freq)
    if n == 0:
        return k_pages, v_pages
    block_tokens, heads_per_program, interpret = launch_knobs(n, num_layers, hkv, d, block_tokens,
                                                              heads_per_program, interpret)
    return _splice_call(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq,
                        block=block_tokens, heads_per_program=heads_per_program,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def rope_rotate_ref(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """HF ``rotate_half`` RoPE of ``x [..., N, D]`` by ``positions [N]``, in fp32."""
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
    cos = jnp.concatenate([jnp.cos(angle)] * 2, axis=-1)  # [N, D]
    sin = jnp.concatenate([jnp.sin(angle)] * 2, axis=-1)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return xf * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def splice_kv_ref(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq):
    """Plain-jnp reference of :func:`splice_kv` (same contract, same shapes)."""
    check_splice_inputs(k_pages, v_pages, src_slots, dst_slots, shift, inv_freq)
    shape = k_pages.shape
    *lead, hkv, p, s, d = shape
    k = k_pages.reshape(-1, p * s, d)  # [L*Hkv, P*S, D]
    v = v_pages.reshape(-1, p * s, d)
    active = dst_slots >= 0
    src = jnp.where(active, src_slots, 0)
    dst = jnp.where(active, dst_slots, p * s)  # out of bounds: dropped by the scatter
    ks = k[:, src]  # [L*Hkv, N, D]
    rot = rope_rotate_ref(ks, shift, inv_freq).astype(k.dtype)
    rot = jnp.where((shift == 0)[None, :, None], ks, rot)
    k = k.at[:, dst].set(rot, mode="drop")
    v = v.at[:, dst].set(v[:, src], mode="drop")
    return k.reshape(shape), v.reshape(shape)
