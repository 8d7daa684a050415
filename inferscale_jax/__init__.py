"""InferScale-JAX: personalized LLM serving by KV injection.

Public API (DESIGN.md): ``Engine``, ``EngineConfig``, ``SamplingParams`` and the exceptions
``SegmentNotFound``, ``SegmentExists``, ``RequestTooLong``, ``SnapshotMismatch``.
"""

from inferscale_jax.default_model import default_model_dir
from inferscale_jax.errors import RequestTooLong, SegmentExists, SegmentNotFound, SnapshotMismatch
from inferscale_jax.sampling import SamplingParams

__all__ = [
    "RequestTooLong",
    "SamplingParams",
    "SegmentExists",
    "SegmentNotFound",
    "SnapshotMismatch",
    "default_model_dir",
]
