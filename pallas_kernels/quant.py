"""Compressed KV: int8 and float8 (e4m3) pages with one float32 scale per (token, kv head).

``quantize_kv(x)`` maps a token's D values of one head to ``round(x / s)`` (int8, s = max|x| / 127)
or ``x / s`` cast to float8_e4m3fn (s = max|x| / 448, its largest finite value); ``dequantize_kv``
multiplies back.  A scale per (token, head) rather than per page: a token's KV is quantized once,
when the step that computed it writes it, and never revisited as its page fills (a per-page scale
would have to grow - and the page be requantized - whenever a later token had a larger value), and
a real K's outlier channels then cost precision in their own token only.  The scales add 4 bytes to
a head's D values (3% at D = 128).

``pack_block`` / ``unpack_block`` carry a block of quantized pages and its scales as one uint8
array (the scale's 4 bytes appended to each row of D), the form the tiers and snapshots move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}
SCALE_BYTES = 4  # a row's float32 scale, stored beside its D one-byte values
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] of ``dtype``, scale [...] float32)."""
    name = jnp.dtype(dtype).name
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / _QMAX[name], 1.0)
    y = xf / scale[..., None]
    if name == "int8":
        # round half away from zero as add-then-truncate: the conversion truncates toward zero, and
        # Pallas' Triton lowering has no `round` primitive (the H200 run found jnp.round unlowerable)
        y = jnp.clip(y + jnp.where(y >= 0, 0.5, -0.5), -127.0, 127.0)
    return y.astype(dtype), scale


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """values [..., D], scale [...] -> [..., D] of ``dtype``."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def dequantize_rows(rows: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Gathered rows [R, D] and their scales [R] -> [R, D] of ``dtype`` (inside a kernel: in registers)."""
    return (rows.astype(jnp.float32) * scales[:, None]).astype(dtype)


def dequantize_pages(k_pages, v_pages, k_scale, v_scale, dtype):
    """The references' view of compressed pages: both dequantized to ``dtype`` (unchanged when
    ``k_scale`` is None: pages of the model's dtype)."""
    if k_scale is None:
        return k_pages, v_pages
    return dequantize_kv(k_pages, k_scale, dtype), dequantize_kv(v_pages, v_scale, dtype)


def pack_block(q: jax.Array, scale: jax.Array) -> jax.Array:
    """values [..., D] (1-byte dtype), scale [...] float32 -> [..., D + 4] uint8."""
    qb = jax.lax.bitcast_convert_type(q, jnp.uint8)
    sb = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)  # [..., 4]
    return jnp.concatenate([qb, sb], axis=-1)


def unpack_block(packed: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The inverse of ``pack_block``."""
    q = jax.lax.bitcast_convert_type(packed[..., :-4], jnp.dtype(dtype))
    scale = jax.lax.bitcast_convert_type(packed[..., -4:], jnp.float32)
    return q, scale
