"""HTTP errors in OpenAI's body shape, and the mapping from engine exceptions to statuses.

Every error the server returns has the body ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's shape; ``param`` names the offending field when known, else null).  Statuses
(docs/architecture.md, "HTTP API"):

=====  =======================  ==========================================================
 400   invalid_request_error    body is not JSON / not UTF-8 (``invalid_json``); a field of the
                                wrong type or out of range, an unknown or unsupported field
                                (``invalid_field``: pydantic errors, FastAPI's request
                                validation and the engine's ``ValueError`` naming the field;
                                OpenAI and vLLM answer these 400 too, so OpenAI clients raise
                                ``BadRequestError``); request too long for the model or pool
                                (``context_length_exceeded``: the message names both
                                lengths); no chat template; bad messages
 401   authentication_error     no ``Authorization: Bearer`` key, or an unknown one
 403   permission_error         a non-admin key registering or deleting a ``public`` segment
                                (``admin_required``), or reading ``/v1/stats``
 404   not_found_error          unknown segment (a foreign tenant's segment is answered with
                                the very same body), unknown model name, unknown route
 405   invalid_request_error    method not allowed on the route
 408   invalid_request_error    the request body did not arrive within ``body_timeout_s``
                                (``body_timeout``; the connection is closed)
 409   conflict_error           a segment id that already exists
 413   invalid_request_error    body larger than ``max_body_bytes`` (checked before parsing)
 429   rate_limit_error         the tenant holds its share of the waiting queue
                                (``tenant_queue_full``, ``Retry-After``; other tenants are served)
 503   overloaded_error         the waiting queue is full (``Retry-After`` header), or the KV
                                pool cannot hold the request right now (``out_of_pages``)
 503   server_error             an engine-wide fault (``EngineFault``: a device error, not
                                this request's input): ``Retry-After``, retrying can succeed
 507   storage_error            the snapshot / registry / disk-tier folder is full or
                                read-only (``StorageError``, ``storage_full``: the message
                                names the folder)
 500   server_error             a bug: the message carries only the request id, never internals
=====  =======================  ==========================================================
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

from inferscale_jax.errors import (EngineFault, PoolExhausted, RequestTooLong, SegmentExists, SegmentNotFound,
                                   StorageError)

log = logging.getLogger("inferscale.server")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error", 507: "storage_error"}


class APIError(Exception):
    """An error answered to the client as-is (status, OpenAI body, extra headers)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}
        self._type = type_  # None: the status's usual type (the table above)

    @property
    def type(self) -> str:
        return self._type or _TYPES.get(self.status, "server_error")

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
_NAMED_FIELD = re.compile(r"^(\w+)=")


def invalid_field(message: str, param: str | None = None) -> APIError:
    """The 400 for a field of the wrong type or value (OpenAI's and vLLM's status for it)."""
    return APIError(400, message, "invalid_field", param)


def _engine_param(message: str) -> str | None:
    """The field an engine ``ValueError`` names (``SamplingParams.top_p=...``, ``segment_id=...``)."""
    m = _SAMPLING_FIELD.match(message) or _NAMED_FIELD.match(message)
    if m is None:
        return None
    return {"segment_id": "id"}.get(m.group(1), m.group(1))  # the HTTP body's name for it


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
    if isinstance(exc, StorageError):
        return APIError(507, str(exc), "storage_full")
    if isinstance(exc, EngineFault):
        # the fault's own text may describe device internals: it goes to the server log, not the client
        log.error("engine fault: %s", exc)
        return APIError(503, "the engine hit a fault that this request did not cause (the server log has the "
                        "details); retry after the Retry-After seconds", "engine_fault",
                        headers={"Retry-After": "1"}, type_="server_error")
    if isinstance(exc, ValueError):
        return invalid_field(str(exc), _engine_param(str(exc)))
    return internal_error()


def internal_error(request_id: str | None = None) -> APIError:
    where = f" (request {request_id})" if request_id else ""
    return APIError(500, f"internal server error{where}; the server log has the details", "internal_error")
