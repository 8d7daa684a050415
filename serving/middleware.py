"""The outer ASGI layer: body size limit (413) and body read timeout (408) before any parsing,
and, with ``log_requests``, one log line per request.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which interferes with streaming
and disconnect detection):

1. A declared ``Content-Length`` over ``max_body_bytes`` is answered 413 at once; otherwise the
   body is read chunk by chunk and the request is answered 413 as soon as the running total
   passes the limit (chunked uploads cannot sneak past).  The rest of an oversized body is
   drained (up to ``DRAIN_LIMIT``) so the client can read the answer, and the connection closed.
   The whole body must arrive within ``body_timeout_s`` of the request's start: a stalled or
   trickled upload is answered 408 and its connection closed (``Connection: close``), so it
   holds no connection slot, task or buffer for longer than that.  The wait is bounded per
   request, not per chunk, so sending a byte now and then does not extend it.
2. The buffered body is replayed to the app; later ``receive`` calls pass through, so the app
   still sees ``http.disconnect`` (streaming handlers abort their request on it).
3. When the response ends (or the app raised), ``requests_total{endpoint,status}`` is counted
   and, with ``log_requests`` (``serve --log-requests``; off by default), one structured line is
   logged on ``inferscale.server`` as JSON - the only line per request (``serve`` keeps the
   engine's own ``inferscale.request`` line off).  ``/health`` probes and ``/metrics`` scrapes
   are counted, never logged.  Handlers add fields through ``request.scope["inferscale.log"]``
   (id, tenant, segments, token counts, ttft).  The line never holds prompt text, generated text
   or keys.  Status 499 means the client went away before the response finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from serving.errors import APIError

log = logging.getLogger("inferscale.server")
DRAIN_LIMIT = 64 << 20
LOG_KEY = "inferscale.log"


class _BodyTimeout(Exception):
    """The request body did not arrive within ``body_timeout_s``."""


class ServingMiddleware:
    def __init__(self, app, *, max_body_bytes: int, metrics, body_timeout_s: float = 30.0,
                 log_requests: bool = False):
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.body_timeout_s, self.log_requests = body_timeout_s, log_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        fields: dict = {}
        scope[LOG_KEY] = fields
        state = {"status": None, "done": False}

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            body, disconnected = await self._read_body(scope, receive, send_wrapped)
            if body is None:
                return
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            if disconnected:
                state["status"] = 499
                return
            await self.app(scope, replay, send_wrapped)
        except BaseException:
            state["status"] = state["status"] or 500
            raise
        finally:
            status = state["status"] if state["done"] or state["status"] in (None, 499, 500) else 499
            self._finish(scope, fields, status or 499, time.perf_counter() - t0)

    async def _read_body(self, scope, receive, send) -> tuple[bytes | None, bool]:
        """The whole body, or ``None`` after answering 413 / 408 / 400 itself."""
        deadline = time.monotonic() + self.body_timeout_s

        async def timed_receive():
            left = deadline - time.monotonic()
            if left <= 0:
                raise _BodyTimeout
            try:
                return await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise _BodyTimeout from None

        try:
            return await self._read_body_by(scope, timed_receive, send)
        except _BodyTimeout:
            await self._reject(send, APIError(
                408, f"the request body did not arrive completely within {self.body_timeout_s:g} s "
                "(body_timeout_s); send the whole body at once, or check the network", "body_timeout"))
            return None, False

    async def _read_body_by(self, scope, receive, send) -> tuple[bytes | None, bool]:
        limit = self.max_body_bytes
        declared = None
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._reject(send, APIError(400, "invalid Content-Length header", "invalid_header"))
                    return None, False
        if declared is not None and declared > limit:
            await self._drain(receive, declared)
            await self._reject(send, too_large(declared, limit))
            return None, False
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._drain(receive, size)
                await self._reject(send, too_large(size, limit, at_least=True))
                return None, False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    @staticmethod
    async def _drain(receive, seen: int) -> None:
        """Read (and drop) the rest of an oversized body, so the client reads the 413; a body
        that stalls meanwhile is left unread (the connection is closed after the answer)."""
        total = 0
        try:
            while total < DRAIN_LIMIT:
                message = await receive()
                if message["type"] != "http.request":
                    return
                total += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
        except _BodyTimeout:
            return

    @staticmethod
    async def _reject(send, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _finish(self, scope, fields: dict, status: int, elapsed: float) -> None:
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if not self.log_requests or endpoint in ("/metrics", "/health"):
            return  # probes and scrapes: counted, never logged
        line = {"event": "request", "method": scope.get("method"), "endpoint": endpoint, "status": status,
                **fields, "duration_s": round(elapsed, 6)}
        log.info(json.dumps(line, default=str, ensure_ascii=True))


def too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    what = f"more than {limit}" if at_least else f"{size}"
    return APIError(413, f"request body is {what} bytes; the limit is {limit} bytes (max_body_bytes): "
                    "send less, e.g. register long context once as a segment", "request_too_large")
