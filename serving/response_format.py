"""Structured-output fields of a request -> one ``StructuredOutputs`` (inferscale_jax/structured.py).

Accepted (C: completions, Ch: chat), at most one per request:

- ``response_format`` (OpenAI): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (the schema; ``strict`` or not, the grammar enforces it);
- ``structured_outputs`` (vLLM): ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (``guided_decoding_backend`` is accepted and ignored: the backend is always llguidance);
- chat's ``tool_choice`` ``required`` or a named function (serving/tools.py).

``check`` compiles the grammar in a worker thread before the request is queued, bounded by
``COMPILE_TIMEOUT_S``; a spec that does not compile (or not in time) is a 400 naming the field and
the grammar library's message.
"""

from __future__ import annotations

import asyncio

from inferscale_jax.structured import StructuredOutputs
from serving.errors import APIError

COMPILE_TIMEOUT_S = 10.0
_SO_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_field", param)


def spec(req) -> tuple[StructuredOutputs | None, str | None]:
    """The request's structured output and the field that gave it (None, None: unconstrained)."""
    found: list[tuple[StructuredOutputs, str]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append((StructuredOutputs(json_object=True), "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise _bad('response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": '
                           '{...}} with the schema an object', "response_format")
            found.append((StructuredOutputs(json=schema), "response_format"))
        elif kind != "text":
            raise _bad(f'response_format.type={kind!r} is invalid: "text", "json_object" or "json_schema"',
                       "response_format")
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict) or not set(so) <= _SO_KEYS:
            bad = sorted(set(so) - _SO_KEYS) if isinstance(so, dict) else so
            raise _bad(f"structured_outputs holds {bad!r}: it is an object with one of {sorted(_SO_KEYS)}",
                       "structured_outputs")
        found.append((StructuredOutputs(**{k: v for k, v in so.items() if v is not None and v is not False}),
                      "structured_outputs"))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((StructuredOutputs(**{key: value}), field))
    if len(found) > 1:
        raise _bad(f"{' and '.join(f for _, f in found)} both constrain the output: send one of them", found[1][1])
    if not found:
        return None, None
    out, field = found[0]
    try:
        out.validate()
    except ValueError as e:
        raise _bad(f"{field}: {e}", field) from None
    return out, field


async def check(state, so: StructuredOutputs, field: str) -> None:
    """Compile ``so`` off the event loop (cached); a 400 naming ``field`` when it does not."""
    try:
        await asyncio.wait_for(asyncio.to_thread(state.grammars.check, so), COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise _bad(f"{field}: the grammar did not compile within {COMPILE_TIMEOUT_S:g} s; send a simpler schema",
                   field) from None
    except ValueError as e:
        raise _bad(f"{field}: {e}", field) from None
