"""Compressed KV: int8 and float8 (e4m3) pages with one float32 scale per (token, kv head).

``quantize_kv(x)`` maps a token's D values of one head to ``round(x / s)`` (int8, s = max|x| / 127)
or ``x / s`` cast to float8_e4m3fn (s = max|x| / 448, its largest finite value); ``dequantize_kv``
multiplies back.  A scale per (token, head) rather than per page: a token's KV is quantized once,
when the step that computed it writes it, and never revisited as its page fills (a per-page scale
would have to grow - and the page be requantized - whenever a later token had a larger value), and
a real K's outlier channels then cost precision in their own token only.  The scales add 4 bytes to
a head's D values (3% at D = 128).

Inside the attention kernels the scales are *folded* rather than applied to the rows: a gathered
tile of one-byte values is converted to q's dtype (exact: int8 and e4m3 values are all bf16 values)
and goes straight to the tensor cores, and the scales multiply what the dots produce, since
``q . (s_j k_j) = s_j (q . k_j)`` and ``sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j``.  The multiply then
touches the ``[rows, BK]`` scores and probabilities instead of the ``[BK, D]`` K and V tiles, and the
convert-then-dot is the mixed-precision pattern Triton pipelines.  ``fold_scores`` / ``fold_probs`` are
those two multiplies; ``dequantize_rows`` (scales on the rows) is the other form, and ``scales_on_rows``
picks per page dtype, the form measured faster for each (bench/NOTES.md, "Compressed KV" and "Figures
moved from code comments"): float8_e4m3fn pages take the rows form (the decode kernel's K and V, the
ragged kernel's V), int8 pages the folded form.  The rows form rounds each dequantized value to q's dtype;
that error stays more than an order of magnitude below what quantizing to e4m3 costs against bf16 pages
(same NOTES entry).  The cascade kernel's shared-prefix part folds for both dtypes (its rows form was never
measured); its suffix part is the decode kernel, so on fp8 pages the two parts take different forms -
separate softmax partials merged by their log-sum-exp, each equal to the reference up to rounding.

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


def scales_on_rows(dtype) -> bool:
    """Whether the kernels' default for pages of ``dtype`` is the rows form (float8_e4m3fn; module doc)."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] of ``dtype``, scale [...] float32)."""
    xf = x.astype(jnp.float32)
    scale = scale_for(jnp.max(jnp.abs(xf), axis=-1), dtype)
    return codes(xf / scale[..., None], dtype), scale


def scale_for(amax: jax.Array, dtype) -> jax.Array:
    """A row's scale from its largest magnitude (1 for an all-zero row)."""
    return jnp.where(amax > 0, amax / _QMAX[jnp.dtype(dtype).name], 1.0)


def codes(y: jax.Array, dtype) -> jax.Array:
    """Values already divided by their scale -> ``dtype`` codes.  int8 rounds half away from zero as
    add-then-truncate: the conversion truncates toward zero, and Pallas' Triton lowering has no
    ``round`` primitive (the H200 run found jnp.round unlowerable)."""
    if jnp.dtype(dtype).name == "int8":
        y = jnp.clip(y + jnp.where(y >= 0, 0.5, -0.5), -127.0, 127.0)
    return y.astype(dtype)


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """values [..., D], scale [...] -> [..., D] of ``dtype``."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def dequantize_rows(rows: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Gathered rows [R, D] and their scales [R] -> [R, D] of ``dtype`` (inside a kernel: in registers)."""
    return (rows.astype(jnp.float32) * scales[:, None]).astype(dtype)


def pv_dtype(q_dtype):
    """The dtype of the PV dot's operands on compressed pages: q's, except float16, whose narrow range
    would flush small ``p * v_scale`` weights to subnormals or zero - bfloat16 there (the 1-byte codes
    are exact in it)."""
    return jnp.bfloat16 if jnp.dtype(q_dtype) == jnp.float16 else q_dtype


def fold_scores(scores: jax.Array, k_scales: jax.Array) -> jax.Array:
    """Scores [M, BK] of q against unscaled K rows -> the scores against the dequantized rows."""
    return scores * k_scales[None, :]


def fold_probs(p: jax.Array, v_scales: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Probabilities [M, BK] -> weights for the unscaled V rows; ``valid [BK]`` zeroes the scales of
    slots past a sequence (a stale slot's scale may be anything, even NaN, and 0 * NaN is NaN)."""
    if valid is not None:
        v_scales = jnp.where(valid, v_scales, 0.0)
    return p * v_scales[None, :]


def gather_pages(pages: jax.Array, scale: jax.Array | None, idx: jax.Array) -> jax.Array:
    """The references' gather: ``pages[:, idx]`` ([Hkv, *idx.shape, S, D]) as float32, compressed pages
    dequantized after the gather (only the gathered pages, never the whole pool, in float32)."""
    if scale is None:
        return pages[:, idx].astype(jnp.float32)
    return dequantize_kv(pages[:, idx], scale[:, idx], jnp.float32)


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
