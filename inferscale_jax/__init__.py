"""InferScale-JAX: personalized LLM serving by KV injection.

Public API (DESIGN.md): ``Engine``, ``EngineConfig``, ``SamplingParams`` and the exceptions
``SegmentNotFound``, ``SegmentExists``, ``RequestTooLong``, ``SnapshotMismatch``.
"""

from inferscale_jax.config import EngineConfig
from inferscale_jax.default_model import default_model_dir
from inferscale_jax.engine import Engine, PoolExhausted
from inferscale_jax.errors import RequestTooLong, SegmentExists, SegmentNotFound, SnapshotMismatch
from inferscale_jax.outputs import GenerationOutput, RequestMetrics
from inferscale_jax.sampling import SamplingParams
from inferscale_jax.segments import SegmentInfo

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "PoolExhausted",
    "RequestMetrics",
    "RequestTooLong",
    "SamplingParams",
    "SegmentExists",
    "SegmentInfo",
    "SegmentNotFound",
    "SnapshotMismatch",
    "default_model_dir",
]
