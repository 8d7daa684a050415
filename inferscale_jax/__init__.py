"""InferScale-JAX: personalized LLM serving by KV injection.

Public API (docs/architecture.md): ``Engine`` (``LockstepEngine`` for a mesh over several processes:
docs/multi_host.md), ``EngineConfig``, ``SamplingParams`` and the exceptions
``SegmentNotFound``, ``SegmentExists``, ``RequestTooLong``, ``SnapshotMismatch``; ``InferScale``, the
HTTP client of the server's extensions (``inferscale_client``: standard library only).
"""

from inferscale_jax._version import __version__
from inferscale_jax.async_engine import AsyncEngine
from inferscale_jax.config import EngineConfig
from inferscale_jax.default_model import default_model_dir
from inferscale_jax.distributed import LockstepEngine
from inferscale_jax.engine import Engine
from inferscale_jax.errors import (EngineFault, PoolExhausted, RequestTooLong, SegmentExists, SegmentNotFound,
                                   SnapshotCorrupt, SnapshotInUse, SnapshotMismatch, StorageError)
from inferscale_jax.outputs import GenerationOutput, RequestMetrics
from inferscale_jax.sampling import SamplingParams
from inferscale_jax.request import RequestOutput
from inferscale_jax.segments import SegmentInfo
from inferscale_jax.sessions import SessionInfo
from inferscale_jax.structured import StructuredOutputs
from inferscale_client import InferScale, InferScaleError

__all__ = [
    "__version__",
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineFault",
    "GenerationOutput",
    "InferScale",
    "InferScaleError",
    "LockstepEngine",
    "PoolExhausted",
    "RequestMetrics",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
    "SegmentExists",
    "SegmentInfo",
    "SegmentNotFound",
    "SessionInfo",
    "StructuredOutputs",
    "SnapshotCorrupt",
    "SnapshotInUse",
    "SnapshotMismatch",
    "StorageError",
    "default_model_dir",
]
