"""Rotary position embeddings in the HF ``rotate_half`` layout.

``inv_freq`` carries the whole RoPE variant (default, linear, llama3 scaling) as one
``[D/2] float32`` vector, computed like transformers does; ``apply_rope`` is then the same for
every variant, and so is the splice kernel's re-rotation (a shift by ``d`` positions is a
rotation by ``d * inv_freq``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """``[D/2] float32`` angular frequencies, after any scaling."""
    base = np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    freq = (np.float32(1.0) / base).astype(np.float32)
    if rope.type == "linear":
        return (freq / np.float32(rope.factor)).astype(np.float32)
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return freq


def rope_cos_sin(positions: jax.Array, freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> cos, sin [B, T, D] float32 (frequencies repeated for both halves)."""
    angles = positions.astype(jnp.float32)[..., None] * freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D]; cos/sin [B, T, D].  Computed in x's dtype like transformers."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
