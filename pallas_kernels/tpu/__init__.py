"""Mosaic TPU Pallas kernels of the paged KV cache (self-contained: no engine imports).

The same page layout and the same contracts as the GPU kernels of :mod:`pallas_kernels`, each
kernel beside the shared pure-jnp reference it is tested against:

* :func:`ragged_paged_attention_tpu` (``ragged_attention.py``): mixed prefill + decode rows over
  paged KV; page table and work list as scalar prefetch, pages streamed HBM -> VMEM with
  double-buffered DMAs, online softmax.  Decode steps and cascade groups run it too.
* :func:`write_kv_tpu` (``kv_write.py``): the new tokens' K/V scattered into their slots by DMA.
* :func:`splice_kv_tpu` (``splice.py``): K/V copied between slots, K re-rotated by a RoPE shift.

Tiling rules, interpret mode off a TPU: :mod:`pallas_kernels.tpu.common`.  What was verified and
how to benchmark on a TPU: ``docs/tpu.md``.
"""

from pallas_kernels.tpu.common import tiling_problem
from pallas_kernels.tpu.kv_write import write_kv_tpu
from pallas_kernels.tpu.ragged_attention import ragged_paged_attention_tpu
from pallas_kernels.tpu.splice import splice_kv_tpu

__all__ = ["ragged_paged_attention_tpu", "splice_kv_tpu", "tiling_problem", "write_kv_tpu"]
