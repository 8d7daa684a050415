"""A small standard-library client for InferScale's HTTP extensions (segments, versions, sessions),
used beside the ``openai`` client (``client.py`` shows how)."""

from inferscale_client.client import InferScale, InferScaleError, NotFound

__all__ = ["InferScale", "InferScaleError", "NotFound"]
