"""The OpenAI-compatible HTTP server (docs/architecture.md, "HTTP API"): ``create_app(engine, ...)``.

``app.py`` (the app and routes), ``generation.py`` (completions / chat, SSE streaming),
``schemas.py`` (request bodies), ``auth.py`` (API keys -> tenants), ``errors.py`` (OpenAI error
bodies and statuses), ``metrics.py`` (Prometheus), ``middleware.py`` (413, request log lines).
``inferscale serve`` (``inferscale_cli/main.py``) runs it with uvicorn, passing ``UVICORN_OPTIONS``
(keep-alive timeout, connection limit, graceful-shutdown bound).
"""

from serving.app import UVICORN_OPTIONS, create_app
from serving.auth import ApiKeys, Principal, load_api_keys

__all__ = ["UVICORN_OPTIONS", "ApiKeys", "Principal", "create_app", "load_api_keys"]
