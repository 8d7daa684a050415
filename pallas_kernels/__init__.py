"""Triton-style Pallas kernels of the paged KV cache and the model's glue around it (no engine imports; the glue
kernels' references are the model's own forms, ``models/``).

Each kernel sits beside its pure-jnp ``*_ref`` in its own module; both call one validator.
Layout, backend selection and shared input checks: :mod:`pallas_kernels.common`.  The Mosaic TPU
kernels, on the same layout and beside the same references: :mod:`pallas_kernels.tpu`.
"""

from pallas_kernels.cascade_attention import (
    grouped_cascade_decode_attention,
    grouped_cascade_decode_attention_ref,
    grouped_shared_prefix_attention,
    grouped_shared_prefix_attention_ref,
    grouped_shared_prefix_partials,
    shared_prefix_decode_attention,
    shared_prefix_decode_attention_ref,
)
from pallas_kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.gemm import matmul_pallas, matmul_ref
from pallas_kernels.kv_write import write_kv, write_kv_pallas, write_kv_ref
from pallas_kernels.norm import add_rms_norm_pallas, add_rms_norm_ref
from pallas_kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_ref
from pallas_kernels.rope import qkv_rope_pallas, qkv_rope_ref
from pallas_kernels.splice import splice_kv, splice_kv_ref
from pallas_kernels.splice_quantized import splice_kv_quantized, splice_kv_quantized_ref

__all__ = [
    "add_rms_norm_pallas",
    "add_rms_norm_ref",
    "grouped_cascade_decode_attention",
    "grouped_cascade_decode_attention_ref",
    "grouped_shared_prefix_attention",
    "grouped_shared_prefix_attention_ref",
    "grouped_shared_prefix_partials",
    "matmul_pallas",
    "matmul_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "qkv_rope_pallas",
    "qkv_rope_ref",
    "ragged_paged_attention",
    "ragged_paged_attention_ref",
    "shared_prefix_decode_attention",
    "shared_prefix_decode_attention_ref",
    "splice_kv",
    "splice_kv_quantized",
    "splice_kv_quantized_ref",
    "splice_kv_ref",
    "write_kv",
    "write_kv_pallas",
    "write_kv_ref",
]
