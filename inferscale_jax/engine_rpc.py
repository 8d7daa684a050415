"""Named engine calls: what the HTTP server asks of the engine besides generation.

Each is ``fn(engine, *args, **kwargs)``, run on the thread (``AsyncEngine``) or in the process
(``engine_core.py``) that owns the engine, as one command: nothing else runs between its checks
and its change.  The server reaches them by name (``rpc("delete_segment", ...)``) so the same
``serving/app.py`` works over an in-process ``AsyncEngine`` and over the engine core process,
where a closure could not travel.

Checks that belong to the server but must run with the change (a non-admin key changing a
public segment) raise ``AdminRequired``; ``serving/app.py`` answers it 403.
"""

from __future__ import annotations

from inferscale_jax.errors import InferScaleError


class AdminRequired(InferScaleError, PermissionError):
    """A non-admin key tried to change or delete a public segment: ``args = (action, segment_id)``."""


def visible_segment(engine, segment_id: str, tenant: str):
    """The segment ``tenant`` sees under this id (its own first) and its tier, or None."""
    infos = [i for i in engine.list_segments(tenant=tenant) if i.id == segment_id]
    if not infos:
        return None
    info = min(infos, key=lambda i: i.public)
    tier = engine.segment_tier(segment_id, tenant=tenant) if hasattr(engine, "segment_tier") else None
    return info, tier


def _changed_is_public(engine, segment_id: str, tenant: str) -> bool:
    """Whether the segment a change by ``tenant`` would hit is public (the engine changes the
    tenant's own segment of that id first, else the public one)."""
    infos = [i for i in engine.list_segments(tenant=tenant) if i.id == segment_id]
    return bool(infos) and all(i.public for i in infos)


def delete_segment(engine, segment_id: str, tenant: str, admin: bool) -> None:
    """The admin check, then the delete."""
    if not admin and _changed_is_public(engine, segment_id, tenant):
        raise AdminRequired("deleting", segment_id)
    engine.delete_segment(segment_id, tenant=tenant)


def change_segment(engine, segment_id: str, tenant: str, admin: bool, how: str, token_ids: list[int]):
    """The admin check, then ``update_segment`` (``how == "update"``) or ``append_segment``."""
    if not admin and _changed_is_public(engine, segment_id, tenant):
        raise AdminRequired("updating" if how == "update" else "appending to", segment_id)
    change = engine.update_segment if how == "update" else engine.append_segment
    return change(segment_id, token_ids=token_ids, tenant=tenant)


def ping(engine) -> None:
    """Nothing: ``/health``'s round trip through the engine loop."""
    return None


def _method(name: str):
    def call(engine, *args, **kwargs):
        return getattr(engine, name)(*args, **kwargs)
    call.__name__ = name
    return call


RPCS = {fn.__name__: fn for fn in (visible_segment, delete_segment, change_segment, ping)}
for _name in ("register_segment", "update_segment", "append_segment", "list_segments", "list_sessions",
              "session_info", "delete_session", "save_session", "stats", "prompt_logprobs"):
    RPCS[_name] = _method(_name)


def run_rpc(engine, name: str, args=(), kwargs=None):
    """``RPCS[name](engine, *args, **kwargs)``; an unknown name is a ``ValueError``."""
    fn = RPCS.get(name)
    if fn is None:
        raise ValueError(f"unknown engine call {name!r}")
    return fn(engine, *args, **(kwargs or {}))
