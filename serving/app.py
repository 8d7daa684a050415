"""``create_app``: the OpenAI-compatible FastAPI app over one engine (docs/architecture.md, "HTTP API").

Threads and processes: the ``Engine`` is owned by one loop (continuous batching across all HTTP
requests): an ``AsyncEngine`` thread in this process, or the engine core process that
``inferscale serve`` runs by default, reached through a ``CoreClient`` (``core_client.py``,
``inferscale_jax/engine_core.py``) with the same surface.  Handlers run on the asyncio event loop
and reach the engine only through that handle (``stream``, ``register_segment``, and named calls
``rpc("list_segments", ...)``: ``inferscale_jax/engine_rpc.py``), so they never block the event
loop on device work and never touch engine state from another thread.  Periodic snapshots
(``engine.maybe_snapshot()``) are taken by the engine loop itself, between steps; the final one
when the CLI stops it.

Layers, outermost first:

1. ``ServingMiddleware`` (``middleware.py``): 413 on bodies over ``max_body_bytes`` before any
   parsing, 408 on bodies that do not arrive within ``body_timeout_s``; one JSON log line and
   ``requests_total`` per request.
2. Auth (``auth.py``): ``Authorization: Bearer`` -> tenant (+ admin flag); 401 otherwise.  No
   key file: the single tenant ``default``.  ``/health`` and ``/metrics`` need no key;
   ``/v1/stats`` needs an admin key.
3. Body parsing (``_parse``): strict UTF-8, then JSON (NaN / Infinity / deep nesting rejected),
   each failure a 400; then the pydantic model (``schemas.py``), whose errors are a 400 naming
   the field (OpenAI's and vLLM's status, so OpenAI clients raise ``BadRequestError``).  Nothing
   malformed reaches the engine, and nothing malformed raises out of a handler: every exception
   becomes an OpenAI error body (``errors.py``), a 500 only for bugs.
4. Routes: completions and chat (``generation.py``), segments, models, stats, health, metrics.

Segments: ``POST /v1/segments`` computes the KV on the engine thread (the call returns when the
segment is durable, per docs/architecture.md); ``GET /v1/segments`` lists the caller's and the public
segments; ``GET`` / ``DELETE /v1/segments/{id}`` answer a foreign id exactly like a missing one.
Ids may hold ``/`` and ``:`` (the routes match the rest of the path).  ``PUT /v1/segments/{id}``
(new content) and ``POST /v1/segments/{id}/append`` make a new version (``segment_updates.py``);
their responses carry ``version``.  Deleting, updating or appending to a public segment needs an
admin key (403 ``admin_required``), like registering one; the check and the change run as one
call on the engine thread, so no other command slips between them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import logging
import math
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale_jax.async_engine import AsyncEngine
from inferscale_jax.engine_rpc import AdminRequired, run_rpc
from serving import tools
from serving.auth import LOCAL, Principal, load_api_keys
from serving.chat import check_template
from serving.connections import guarded_protocol
from serving.errors import APIError, from_engine, internal_error, invalid_field, segment_not_found
from serving.generation import chat_job, completion_job, run_job
from serving.metrics import ServerMetrics
from serving.middleware import LOG_KEY, ServingMiddleware
from serving.schemas import ChatCompletionRequest, CompletionRequest, SegmentContent, SegmentCreate

log = logging.getLogger("inferscale.server")
MAX_JSON_DEPTH = 64
MAX_JSON_KEYS = 10000  # object keys in one request body (logit_bias and friends need far fewer)
PARSE_OFF_LOOP_BYTES = 64 << 10  # bodies above this are parsed on a worker thread (_parse)
# What ``uvicorn.run(app, ...)`` should be given (``inferscale serve`` passes these):
# timeout_keep_alive: an idle keep-alive connection is closed after 5 s;
# limit_concurrency: connections (and tasks) beyond this are answered 503 by uvicorn itself, before
#   the app (a plain-text body: the app never sees them); keep it above max_waiting + max_batch;
# timeout_graceful_shutdown: on SIGTERM, streams still open after 10 s are cut so shutdown (and
#   the final snapshot) is not held up by a client that never leaves.
# http: uvicorn's h11 protocol with a deadline for each request's head and a cap on connections per
#   client address (connections.py).
# The request body itself is bounded by create_app's body_timeout_s (middleware.py).
UVICORN_OPTIONS = dict(timeout_keep_alive=5, limit_concurrency=4096, timeout_graceful_shutdown=10,
                       http=guarded_protocol())
MIN_MAX_WAITING = 1024
MAX_AUTO_WAITING = 3072
TOKENS_PER_QUEUED_REQUEST = 256  # auto_max_waiting: a queued request's share of the pool
DRAIN_RATE_WINDOW_S = 10.0  # ServerState.retry_after's moving average
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


class ServerState:
    """What handlers share: the engine handle, a private tokenizer copy, metrics, limits.

    Admission (``admit``): a request waits in the engine's queue until its first token.  A tenant
    holding ``max_waiting_per_tenant`` such requests gets 429 (its fair share is used; the others
    are still served); beyond ``max_waiting`` in all, 503.  Both carry ``Retry-After``.
    ``max_waiting`` defaults to what the KV pool holds (``auto_max_waiting``), the per-tenant cap
    to half of it when the key file names several tenants with non-admin keys (else the whole queue); the engine
    admits between tenants fairly (``inferscale_jax/fair_queue.py``).  ``Retry-After`` is the
    queue's length over its measured drain rate (requests reaching their first token per second,
    an exponential moving average), 1-60 s."""

    def __init__(self, async_engine, *, api_keys, max_waiting, model_names, default_max_tokens,
                 chat_template=None, max_waiting_per_tenant=None, tool_call_parser=None):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        tok = getattr(self.engine, "tokenizer", None)
        try:  # a private copy: the engine thread's tokenizer is never used from the event loop
            self.tokenizer = copy.deepcopy(tok)
        except Exception:  # noqa: BLE001 - fall back to sharing (decode is read-only)
            self.tokenizer = tok
        self.api_keys = api_keys
        self.max_waiting = max_waiting if max_waiting is not None else auto_max_waiting(self.engine)
        tenants = len(api_keys.serving_tenants()) if api_keys is not None else 1
        self.max_waiting_per_tenant = (max_waiting_per_tenant if max_waiting_per_tenant is not None
                                       else self.max_waiting // 2 if tenants > 1 else self.max_waiting)
        self.pending_by_tenant: collections.Counter = collections.Counter()
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # the name responses carry
        self.default_max_tokens = default_max_tokens
        self.chat_template = chat_template
        if tool_call_parser is not None and tool_call_parser not in tools.PARSERS:
            raise ValueError(f"tool_call_parser={tool_call_parser!r} is invalid: one of {tools.PARSERS}")
        self._tool_parser = tool_call_parser
        self._grammars = None
        self.metrics = ServerMetrics()
        self.pending = 0  # requests submitted but without a first token yet (generation.py, 2)
        self.started = int(time.time())
        self._drain_rate = 0.0  # requests per second reaching their first token (EMA)
        self._drain_t = time.monotonic()

    async def rpc(self, name: str, *args, **kwargs):
        """A named engine call (``inferscale_jax/engine_rpc.py``) through the engine handle:
        ``rpc`` of an ``AsyncEngine`` or a ``CoreClient``, else (a handle with ``call`` alone)
        the function itself run through ``call``."""
        rpc = getattr(self.async_engine, "rpc", None)
        if rpc is not None:
            return await rpc(name, *args, **kwargs)
        return await self.async_engine.call(run_rpc, self.engine, name, args, kwargs)

    @property
    def tool_parser(self) -> str:
        """How tool calls are read with ``tool_choice`` auto (serving/tools.py)."""
        cfg = getattr(self.engine, "cfg", None)
        return self._tool_parser or tools.default_parser(getattr(cfg, "architecture", ""))

    @property
    def grammars(self):
        """This process's grammar compiler (inferscale_jax/structured.py): requests' schemas are
        compiled here before queueing (serving/response_format.py), so a bad one is a 400."""
        if self._grammars is None:
            from inferscale_jax.structured import GrammarCompiler

            cfg = self.engine.cfg
            self._grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        return self._grammars

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def admit(self, count: int = 1, tenant: str = "default") -> None:
        """Count ``count`` more queued requests of ``tenant``, or answer 429 when the tenant
        holds its share of the queue, 503 when the whole queue is full."""
        mine = self.pending_by_tenant[tenant]
        cap = self.max_waiting_per_tenant
        if cap < self.max_waiting and mine + count > max(cap, count):  # (a cap of the whole queue: 503 below)
            wait = self.retry_after()
            self.metrics.tenant_rejected.labels(tenant, "429").inc()
            raise APIError(429, f"tenant {tenant!r} has {mine} requests queued, its share of the queue (limit "
                           f"{self.max_waiting_per_tenant}, --max-waiting-per-tenant); other tenants are still "
                           f"served; retry after {wait} s (Retry-After)", "tenant_queue_full",
                           headers={"Retry-After": str(wait)})
        if self.pending + count > max(self.max_waiting, count):
            wait = self.retry_after()
            self.metrics.tenant_rejected.labels(tenant, "503").inc()
            raise APIError(503, f"server overloaded: {self.pending} requests are queued (limit {self.max_waiting}, "
                           f"--max-waiting); retry after {wait} s (Retry-After)", "overloaded",
                           headers={"Retry-After": str(wait)})
        self.pending += count
        self.pending_by_tenant[tenant] += count

    def release(self, count: int, tenant: str = "default") -> None:
        """``count`` of ``tenant``'s queued requests reached their first token, failed or left."""
        self.pending -= count
        left = self.pending_by_tenant[tenant] - count
        if left > 0:
            self.pending_by_tenant[tenant] = left
        else:
            self.pending_by_tenant.pop(tenant, None)

    def note_started(self, count: int) -> None:
        """``count`` requests reached their first token: update the drain rate."""
        now = time.monotonic()
        dt, self._drain_t = max(now - self._drain_t, 1e-3), now
        w = min(1.0, dt / DRAIN_RATE_WINDOW_S)  # the EMA forgets over about one window
        self._drain_rate = (1 - w) * self._drain_rate + w * (count / dt)

    def retry_after(self) -> int:
        """Seconds until the queue has drained at the measured rate (1-60)."""
        if self._drain_rate <= 0:
            return 1
        return int(min(60, max(1, math.ceil(self.pending / self._drain_rate))))

    def principal(self, request: Request) -> Principal:
        p = LOCAL if self.api_keys is None else self.api_keys.authenticate(request.headers.get("authorization"))
        request.scope.get(LOG_KEY, {})["tenant"] = p.tenant
        return p


def auto_max_waiting(engine) -> int:
    """The default queue limit: as many requests as the KV pool holds at
    ``TOKENS_PER_QUEUED_REQUEST`` tokens each, at least ``MIN_MAX_WAITING`` (benchmark clients open
    512 streams at once) and 8 x max_batch, at most ``MAX_AUTO_WAITING`` (below uvicorn's
    connection limit, ``UVICORN_OPTIONS``)."""
    try:  # sizes fixed at construction (read here, not through the engine thread)
        pool = (engine.pool.num_pages - 1) * engine.config.page_size
        batch = int(engine.max_batch)
    except AttributeError:  # a stub engine: the floor
        return MIN_MAX_WAITING
    return min(MAX_AUTO_WAITING, max(MIN_MAX_WAITING, 8 * batch, pool // TOKENS_PER_QUEUED_REQUEST))


def _too_many_keys() -> APIError:
    return APIError(400, f"the request body holds more than {MAX_JSON_KEYS} object keys (no request needs "
                    "that many; token ids go in arrays)", "invalid_json")


def _count_keys(raw: bytes) -> int:
    """Object keys in a JSON text written without a space before its colons, counted on the bytes
    (a fast C scan) so that a body with too many is refused before it is parsed: a ``":`` outside
    a string ends a key, and inside a string the quote is escaped (``\\":``).  A key written
    ``"k" :`` is not counted (parsing counts it, ``_check_json``)."""
    return raw.count(b'":') - raw.count(b'\\":')


def _check_json(obj, depth: int = 0, keys: list | None = None) -> None:
    """Bounded nesting and object keys, and no lone surrogates (``"\\ud800"`` escapes are not
    Unicode text)."""
    keys = [0] if keys is None else keys
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "a JSON string holds a lone surrogate escape (e.g. \\ud800), which is not "
                           "valid Unicode text", "invalid_json") from None
    elif isinstance(obj, dict):
        keys[0] += len(obj)
        if keys[0] > MAX_JSON_KEYS:
            raise _too_many_keys()
        for k, v in obj.items():
            _check_json(k, depth + 1, keys)
            _check_json(v, depth + 1, keys)
    elif isinstance(obj, list):
        for v in obj:
            _check_json(v, depth + 1, keys)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def _parse(request: Request, model):
    """The body as ``model``: a large body is decoded, checked and validated on a worker thread,
    so its parsing never holds the event loop (other requests' streams go on meanwhile)."""
    raw = await request.body()
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parse_bytes, raw, model)
    return _parse_bytes(raw, model)


def _parse_bytes(raw: bytes, model):
    if _count_keys(raw) > MAX_JSON_KEYS:  # (building a dict of 100k keys holds the GIL for tens of ms)
        raise _too_many_keys()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start}): send UTF-8 JSON",
                       "invalid_json") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        msg = str(e) if isinstance(e, ValueError) else "nested too deeply"
        raise APIError(400, f"request body is not valid JSON: {msg}", "invalid_json") from None
    _check_json(obj)
    if not isinstance(obj, dict):
        raise invalid_field(f"request body must be a JSON object, not {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # our validators' own messages name the rule and the fix: prefer one (a union's other branches
    # would otherwise report "should be a valid string" for a content part with a bad segment id)
    first = next((err for err in errors if err["type"] == "value_error"), errors[0])
    # drop pydantic's union-branch tags ("str", "list[int]", ...) from the location; keep names and indices
    loc = ".".join(str(x) for x in first["loc"] if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x)))
    if first["type"] == "extra_forbidden":
        msg = f"unknown or unsupported field {loc!r}: this server rejects fields it would otherwise ignore"
    else:
        text = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
        msg = f"{loc or 'body'}: {text}"
        if "input" in first and first["type"] not in ("missing",) and len(repr(first["input"])) <= 80:
            msg += f" (got {first['input']!r})"
    more = len(e.errors()) - 1
    if more > 0:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return invalid_field(msg, loc or None)


def public_needs_admin(action: str, segment_id: str, param: str | None = None) -> APIError:
    """The 403 for a non-admin key registering, changing or deleting a public segment."""
    return APIError(403, f"{action} the public segment {segment_id!r} needs an admin API key "
                    '({"tenant": ..., "admin": true} in the key file); public segments are shared by '
                    "every tenant", "admin_required", param)


def _segment_json(info) -> dict:
    return {"id": info.id, "object": "segment", "num_tokens": info.num_tokens, "public": info.public,
            "pin": info.pin, "created": int(info.created), "version": info.version,
            "updated": int(info.updated) if info.updated else None}


def _session_json(info) -> dict:
    return {"id": info.id, "object": "session", "num_tokens": info.num_tokens, "turns": info.turns,
            "created": int(info.created), "updated": int(info.updated), "expires_at": int(info.expires)}


def session_not_found(session_id: str) -> APIError:
    return APIError(404, f"session {session_id!r} not found (unknown, expired or deleted); list yours with "
                    "GET /v1/sessions", "session_not_found", "session")


def create_app(engine_or_async_engine, *, api_keys=None, max_body_bytes: int = 2 << 20,
               max_waiting: int | None = None, model_names: list[str] | str | None = None,
               model_name: str | None = None, default_max_tokens: int = 256, body_timeout_s: float = 30.0,
               chat_template: str | None = None, log_requests: bool = False,
               max_waiting_per_tenant: int | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The app.  ``engine_or_async_engine``: an ``Engine`` (wrapped in an ``AsyncEngine`` the app
    owns and shuts down) or an ``AsyncEngine`` (the caller owns it).  ``api_keys``: ``None``
    (one local tenant), a path to a JSON/TOML key file, a mapping, or ``ApiKeys``.
    ``max_waiting``: queued requests beyond which new ones get 503 (None: ``auto_max_waiting``);
    ``max_waiting_per_tenant``: one tenant's queued requests beyond which its new ones get 429
    (None: half of ``max_waiting`` when the keys name several non-admin tenants, else all of it).
    ``model_names``: the names clients may send as ``model`` (vLLM's ``--served-model-name``;
    the first is the one responses carry; ``model_name`` is the one-name form; default
    "inferscale").  ``default_max_tokens``: chat requests that give no ``max_tokens``
    (completions default to 16, like OpenAI).  ``body_timeout_s``: a request body must arrive
    completely within this many seconds (else 408 and the connection is closed).
    ``chat_template``: a Jinja chat template replacing the tokenizer's (``--chat-template``);
    a template that cannot render raises ``ValueError`` here, before serving.  ``log_requests``:
    one JSON log line per request.  ``tool_call_parser``: how chat tool calls are read with
    ``tool_choice`` auto (serving/tools.py; None: by the model's architecture).  Run it with ``uvicorn.run(app, ..., **UVICORN_OPTIONS)``."""
    if max_body_bytes < 1 or any(x is not None and x < 1 for x in (max_waiting, max_waiting_per_tenant)):
        raise ValueError(f"max_body_bytes={max_body_bytes}, max_waiting={max_waiting} and max_waiting_per_tenant="
                         f"{max_waiting_per_tenant} must be >= 1")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s={body_timeout_s!r} is invalid: must be > 0 seconds")
    names = [model_names] if isinstance(model_names, str) else list(model_names or [])
    names = names or [model_name or "inferscale"]
    owned = not hasattr(engine_or_async_engine, "stream")
    ae = AsyncEngine(engine_or_async_engine) if owned else engine_or_async_engine
    state = ServerState(ae, api_keys=load_api_keys(api_keys), max_waiting=max_waiting, model_names=names,
                        default_max_tokens=default_max_tokens, chat_template=chat_template,
                        max_waiting_per_tenant=max_waiting_per_tenant, tool_call_parser=tool_call_parser)
    check_template(state.tokenizer, chat_template)
    engine = state.engine
    model_name = state.model_name

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            if owned:
                ae.shutdown()

    app = FastAPI(title="InferScale-JAX", lifespan=lifespan)
    app.state.serving = state
    app.add_middleware(ServingMiddleware, max_body_bytes=max_body_bytes, metrics=state.metrics,
                       body_timeout_s=body_timeout_s, log_requests=log_requests)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        request.scope.get(LOG_KEY, {}).setdefault("error", exc.code)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.url.path}; see docs/architecture.md 'HTTP API'", "route_not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} not allowed on {request.url.path}", "method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail), "http_error")
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request, exc):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return invalid_field(f"{loc}: {first.get('msg')}", loc or None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return internal_error().response()

    def _engine_error(e: Exception, what: str) -> APIError:
        if isinstance(e, AdminRequired):  # engine_rpc's check, run with the change
            return public_needs_admin(*e.args)
        err = from_engine(e)
        if err.status == 500:
            log.error("engine call %s failed", what, exc_info=e)
        return err

    async def engine_call(name: str, *args, **kwargs):
        """A named engine call (``inferscale_jax/engine_rpc.py``), its failure as an APIError."""
        try:
            return await state.rpc(name, *args, **kwargs)
        except Exception as e:
            raise _engine_error(e, name) from None

    # -- generation -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        principal = state.principal(request)
        req = await _parse(request, CompletionRequest)
        return await run_job(state, request, completion_job(state, req, principal))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        principal = state.principal(request)
        req = await _parse(request, ChatCompletionRequest)
        return await run_job(state, request, await chat_job(state, req, principal))

    # -- segments ---------------------------------------------------------------------------
    @app.post("/v1/segments", status_code=201)
    async def create_segment(request: Request):
        principal = state.principal(request)
        req = await _parse(request, SegmentCreate)
        if req.public and not principal.admin:
            raise public_needs_admin("registering", req.id, "public")
        request.scope[LOG_KEY]["segments"] = [req.id]
        try:  # AsyncEngine.register_segment tokenizes the text off the engine thread
            info = await ae.register_segment(req.id, text=req.text, token_ids=req.token_ids,
                                             tenant=principal.tenant, public=req.public, pin=req.pin)
        except Exception as e:
            raise _engine_error(e, "register_segment") from None
        return JSONResponse(_segment_json(info), status_code=201)

    @app.get("/v1/segments")
    async def list_segments(request: Request):
        principal = state.principal(request)
        infos = await engine_call("list_segments", tenant=principal.tenant)
        return {"object": "list", "data": [_segment_json(i) for i in infos]}

    @app.get("/v1/segments/{segment_id:path}")
    async def get_segment(segment_id: str, request: Request):
        principal = state.principal(request)
        request.scope[LOG_KEY]["segments"] = [segment_id]
        found = await engine_call("visible_segment", segment_id, principal.tenant)
        if found is None:
            raise segment_not_found(segment_id)
        info, tier = found
        return {**_segment_json(info), "tier": tier}

    @app.delete("/v1/segments/{segment_id:path}")
    async def delete_segment(segment_id: str, request: Request):
        principal = state.principal(request)
        request.scope[LOG_KEY]["segments"] = [segment_id]
        try:
            await engine_call("delete_segment", segment_id, principal.tenant, principal.admin)
        except APIError as e:
            raise segment_not_found(segment_id) if e.status == 404 else e
        return {"id": segment_id, "object": "segment", "deleted": True}

    async def _new_version(segment_id: str, request: Request, how: str):
        principal = state.principal(request)
        req = await _parse(request, SegmentContent)
        request.scope[LOG_KEY]["segments"] = [segment_id]
        try:
            ids = req.token_ids if req.token_ids is not None else await ae.tokenize(req.text)  # off the engine thread
        except Exception as e:
            raise _engine_error(e, "tokenize") from None
        try:
            info = await engine_call("change_segment", segment_id, principal.tenant, principal.admin, how, ids)
        except APIError as e:
            raise segment_not_found(segment_id) if e.status == 404 else e
        return _segment_json(info)

    @app.put("/v1/segments/{segment_id:path}")
    async def update_segment(segment_id: str, request: Request):
        """A new version of the segment (``Engine.update_segment``); the response carries ``version``."""
        return await _new_version(segment_id, request, "update")

    @app.post("/v1/segments/{segment_id:path}/append")
    async def append_segment(segment_id: str, request: Request):
        """Tokens appended to the segment (``Engine.append_segment``); the response carries ``version``."""
        return await _new_version(segment_id, request, "append")

    # -- sessions (conversation memory: chat's "session" field) -----------------------------
    @app.get("/v1/sessions")
    async def list_sessions(request: Request):
        principal = state.principal(request)
        infos = await engine_call("list_sessions", tenant=principal.tenant)
        return {"object": "list", "data": [_session_json(i) for i in infos]}

    @app.get("/v1/sessions/{session_id:path}")
    async def get_session(session_id: str, request: Request):
        principal = state.principal(request)
        try:
            return _session_json(await engine_call("session_info", session_id, tenant=principal.tenant))
        except APIError as e:
            raise session_not_found(session_id) if e.status in (400, 404) else e

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str, request: Request):
        principal = state.principal(request)
        try:
            await engine_call("delete_session", session_id, tenant=principal.tenant)
        except APIError as e:
            raise session_not_found(session_id) if e.status in (400, 404) else e
        return {"id": session_id, "object": "session", "deleted": True}

    # -- models, stats, health, metrics -----------------------------------------------------
    model_cfg = getattr(engine, "cfg", None)  # (absent on test stubs)
    max_model_len = getattr(model_cfg, "max_position_embeddings", None)

    def _model_json(name: str) -> dict:
        out = {"id": name, "object": "model", "created": state.started, "owned_by": "inferscale",
               "root": state.model_name}
        if max_model_len is not None:
            out["max_model_len"] = max_model_len  # vLLM's field: clients size their prompts by it
        return out

    @app.get("/v1/models")
    async def models(request: Request):
        state.principal(request)
        return {"object": "list", "data": [_model_json(n) for n in state.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        state.principal(request)
        if model_id not in state.model_names:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves "
                           f"{' / '.join(map(repr, state.model_names))}", "model_not_found", "model")
        return _model_json(model_id)

    @app.get("/v1/stats")
    async def stats(request: Request):
        principal = state.principal(request)
        if not principal.admin:
            raise APIError(403, "engine stats need an admin API key", "admin_required")
        stats = dict(await engine_call("stats"))
        if hasattr(ae, "process_info"):  # the process layout: engine_process.pid, api_processes
            stats.update(ae.process_info())
        stats["api_process"] = {"pid": os.getpid()}  # the API server that answered
        return JSONResponse(json.loads(json.dumps(stats, default=str)))

    @app.get("/health")
    async def health():
        if getattr(ae, "fatal", None) is not None:  # the engine stopped serving (a lost device): the server is exiting
            return JSONResponse({"status": "failed", "error": "the engine stopped serving; see the server log"},
                                status_code=503)
        warming = getattr(ae, "warming", None)
        if warming is not None:  # compiling the step buckets (Engine.warmup): not ready yet
            return JSONResponse({"status": "warming up", "buckets_done": warming[0], "buckets": warming[1]},
                                status_code=503, headers={"Retry-After": "5"})
        try:
            await asyncio.wait_for(state.rpc("ping"), timeout=30.0)
        except Exception:  # noqa: BLE001 - the engine loop is stuck or gone
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await engine_call("stats")
        except APIError:
            stats = None
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
