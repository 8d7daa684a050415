"""Conversation memory: a session keeps a conversation's KV resident, tiered and durable between turns.

A session is a segment under a reserved id (``SESSION_PREFIX`` + the session id: ``~`` is not a
segment-id character, so no segment id can name one) in the tenant's namespace.  Everything a
segment has, a session has: durable registry rows (a session survives ``kill -9`` and restarts),
snapshots, LRU demotion to host and disk when idle, promotion on use, versions
(``segment_updates.py``).  Segment routes and ``list_segments`` never show sessions.

The functions here take the engine (they hold nothing; the engine's segment operations do the
work).  One turn (the chat route does this for ``session: id``; ``Engine.submit(session=...)``
and ``Engine.save_session`` are the Python API):

1. **Use** (``split``, at submit): if the session's tokens are a prefix of the request's token
   sequence (the client re-sends the whole conversation, as with OpenAI), the request becomes
   ``[session] + the rest``: the session's KV is injected as segment 1 (exact by construction:
   it is the KV of exactly those leading tokens), so only the new message is computed and
   ``cached_tokens`` covers every previous turn.  Otherwise (an edited history, another
   template) the session is not used for this request (the prefix cache still helps).
2. **Save** (``save``, after the reply): the conversation so far - the messages plus the reply,
   rendered without a generation prompt - becomes the session's next version.  Its KV is
   mostly reused: the previous version is the common prefix and the finished request's full
   pages are prefix-cache hits, so only the tail after the last full page is computed.

Limits (``EngineConfig``): ``session_ttl_s`` since a session's last save (an expired session is
deleted when next seen or listed, or at the next save of any session), and
``max_sessions_per_tenant`` (saving one more deletes the tenant's least recently saved).
"""

from __future__ import annotations

import dataclasses

from inferscale_jax.errors import SegmentNotFound
from inferscale_jax.segments import SEGMENT_ID_ALPHABET, SESSION_PREFIX, Segment, check_segment_id


def is_session_id(internal_id: str) -> bool:
    return internal_id.startswith(SESSION_PREFIX)


def check_session_id(session_id) -> str:
    """Session ids follow the segment-id rule (``segments.check_segment_id``); the error names ``session``."""
    try:
        return check_segment_id(session_id)
    except ValueError:
        raise ValueError(f"session={session_id!r} is invalid: use 1-256 characters of {SEGMENT_ID_ALPHABET}") from None


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """What ``list_sessions`` and ``save_session`` return."""
    id: str
    tenant: str
    num_tokens: int  # tokens of the conversation the session holds (its turns so far)
    turns: int  # saves so far (the session's version)
    created: float
    updated: float  # the last save
    expires: float  # updated + session_ttl_s


def _info(engine, seg: Segment) -> SessionInfo:
    i = seg.info
    updated = i.updated or i.created
    return SessionInfo(id=i.id[len(SESSION_PREFIX):], tenant=i.tenant, num_tokens=i.num_tokens, turns=i.version,
                       created=i.created, updated=updated, expires=updated + engine.config.session_ttl_s)


def _all(engine, tenant: str | None = None) -> list[Segment]:
    return [s for s in engine.store.all_segments()
            if is_session_id(s.info.id) and (tenant is None or s.namespace == tenant)]


def count(engine) -> int:
    return len(_all(engine))


def purge(engine, now: float | None = None) -> int:
    """Delete every expired session; returns how many."""
    now = engine.now() if now is None else now
    dead = [s for s in _all(engine) if _info(engine, s).expires <= now]
    for seg in dead:
        engine._remove(seg)
    return len(dead)


def get(engine, session_id: str, tenant: str) -> Segment | None:
    """The live session (``None`` if absent or expired: an expired one is deleted here)."""
    seg = engine.store.get(tenant, SESSION_PREFIX + check_session_id(session_id))
    if seg is not None and _info(engine, seg).expires <= engine.now():
        engine._remove(seg)
        return None
    return seg


def split(engine, session_id: str, tenant: str, tokens: list[int]) -> Segment | None:
    """At submit: the session when its tokens are a proper prefix of ``tokens`` (the request's
    token ids after the BOS), else ``None``."""
    seg = get(engine, session_id, tenant)
    if seg is None:
        return None
    n = len(seg.token_ids)
    return seg if n < len(tokens) and tokens[:n] == seg.token_ids else None


def save(engine, session_id: str, tenant: str, token_ids: list[int]) -> SessionInfo:
    """The conversation so far becomes the session's next version (a new session: its first)."""
    purge(engine)
    seg = get(engine, session_id, tenant)
    if seg is None:
        mine = sorted(_all(engine, tenant), key=lambda s: _info(engine, s).updated)
        for old in mine[:max(0, len(mine) - engine.config.max_sessions_per_tenant + 1)]:
            engine._remove(old)  # the tenant's least recently saved, beyond the cap
        engine._register(SESSION_PREFIX + session_id, token_ids, tenant, session=True)
    else:
        engine._next_version(seg, token_ids, promote=True)
    return _info(engine, engine.store.get(tenant, SESSION_PREFIX + session_id))


def listing(engine, tenant: str) -> list[SessionInfo]:
    purge(engine)
    return sorted((_info(engine, s) for s in _all(engine, tenant)), key=lambda i: i.id)


def info(engine, session_id: str, tenant: str) -> SessionInfo:
    seg = get(engine, session_id, tenant)
    if seg is None:
        raise SegmentNotFound(f"session {session_id!r} not found; list your sessions with GET /v1/sessions")
    return _info(engine, seg)


def delete(engine, session_id: str, tenant: str) -> None:
    seg = get(engine, session_id, tenant)
    if seg is None:
        raise SegmentNotFound(f"session {session_id!r} not found; list your sessions with GET /v1/sessions")
    engine._remove(seg)
