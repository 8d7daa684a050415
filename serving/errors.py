"""HTTP errors in OpenAI's body shape, and the mapping from engine exceptions to statuses.

Every error the server returns has the body ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's shape; ``param`` names the offending field when known, else null).  Statuses
(docs/architecture.md, "HTTP API"):

=====  =======================  ==========================================================
 400   invalid_request_error    body is not JSON / not UTF-8 (``invalid_json``), request too
                                long for the model or pool (``context_length_exceeded``: the
                                message names both lengths), no chat template, bad messages
 401   authentication_error     no ``Authorization: Bearer`` key, or an unknown one
 403   permission_error         a non-admin key registering a ``public`` segment
 404   not_found_error          unknown segment (a foreign tenant's segment is answered with
                                the very same body), unknown model name, unknown route
 405   invalid_request_error    method not allowed on the route
 409   conflict_error           a segment id that already exists
 413   invalid_request_error    body larger than ``max_body_bytes`` (checked before parsing)
 422   invalid_request_error    a field of the wrong type or out of range, an unknown field
                                (``invalid_field``; pydantic errors and the engine's
                                ``ValueError`` naming the field)
 503   overloaded_error         the waiting queue is full (``Retry-After`` header), or the KV
                                pool cannot hold the request right now
 500   server_error             a bug: the message carries only the request id, never internals
=====  =======================  ==========================================================
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from inferscale_jax.errors import PoolExhausted, RequestTooLong, SegmentExists, SegmentNotFound

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 422: "invalid_request_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error answered to the client as-is (status, OpenAI body, extra headers)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def segment_not_found(segment_id: str) -> APIError:
    """The one 404 body for a segment id the caller cannot see: missing and foreign look the same."""
    return APIError(404, f"segment {segment_id!r} not found; list your segments with GET /v1/segments",
                    "segment_not_found", "segments")


_SEGMENT_ID = re.compile(r"segment (.+?) not found")
_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+)=")


def from_engine(exc: BaseException) -> APIError:
    """Map an engine exception (raised by ``submit``, a segment call, or a failed request)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SegmentNotFound):
        # rebuild the message from the id alone so every path gives an identical body
        m = _SEGMENT_ID.search(str(exc))
        sid = m.group(1).strip("'\"") if m else "?"
        return segment_not_found(sid)
    if isinstance(exc, SegmentExists):
        return APIError(409, str(exc), "segment_exists", "id")
    if isinstance(exc, RequestTooLong):
        return APIError(400, str(exc), "context_length_exceeded")
    if isinstance(exc, PoolExhausted):
        return APIError(503, f"{exc}; retry later", "out_of_pages", headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):
        m = _SAMPLING_FIELD.match(str(exc))
        return APIError(422, str(exc), "invalid_field", m.group(1) if m else None)
    return internal_error()


def internal_error(request_id: str | None = None) -> APIError:
    where = f" (request {request_id})" if request_id else ""
    return APIError(500, f"internal server error{where}; the server log has the details", "internal_error")
