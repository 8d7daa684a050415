"""Tool calling in chat: OpenAI's ``tools`` / ``tool_choice``, the model family's own format.

How a request with ``tools`` goes (vLLM's behaviour, which clients and agent frameworks expect):

1. ``check`` validates the tools (``{"type": "function", "function": {"name", "description",
   "parameters"}}``; names of ``A-Z a-z 0-9 _ -``, at most 64 characters) and ``tool_choice``
   (``none``, ``auto``, ``required``, or ``{"type": "function", "function": {"name"}}`` naming one
   of them), each problem a 400 naming the field.
2. The tools go to the chat template (``apply_chat_template(tools=...)``), so the model sees them
   in its family's own format; earlier ``assistant`` messages' ``tool_calls`` and ``tool``
   messages (with ``tool_call_id``) go back into the template as the template expects them
   (arguments as objects).  A template that ignores tools renders the conversation without them.
3. ``required`` and a named function are enforced by a grammar (``grammar``): a named function's
   output *is* its arguments, a JSON object matching its ``parameters`` schema; ``required`` is a
   JSON array of ``{"name", "parameters"}`` calls, each matching its tool's schema (one call at
   most with ``parallel_tool_calls: false``).  So the arguments always parse and match.
   ``auto`` is the model's choice: the output is parsed with the family's parser (``parse``):
   ``llama3_json`` (``{"name", "parameters"}`` objects, ``;``-separated, optionally after
   ``<|python_tag|>``), ``hermes`` (Qwen2.5 / Hermes: ``<tool_call>{"name", "arguments"}</tool_call>``)
   or ``mistral`` (``[TOOL_CALLS][{"name", "arguments"}]``).  ``--tool-call-parser`` picks it;
   the default follows the model's architecture (``default_parser``).
4. The answer: ``message.tool_calls`` (``id``, ``type``, ``function.name``, ``function.arguments``
   as JSON text), ``content`` the text before the calls (null when none), ``finish_reason``
   ``tool_calls`` (``stop`` for a named function, as OpenAI answers).  Streaming (``Stream``) sends
   content as it comes; calls stream as they are generated: a named function's arguments, and
   ``required``'s and ``auto``'s calls one by one (each call's ``id`` and ``name`` once its head
   ``{"name": N, "parameters": {`` is complete, then its arguments in fragments).  ``auto`` holds
   content back from the first character that may begin a call (``{``, ``[TOOL_CALLS]``,
   ``<tool_call>``); a call written another way (arguments first, arguments as a string) is sent
   whole when the output ends, once parsed; text that looked like a call but parses as none is
   sent then as content.
"""

from __future__ import annotations

import json
import re
import secrets

from inferscale_jax.structured import StructuredOutputs
from serving.errors import APIError

PARSERS = ("llama3_json", "hermes", "mistral")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def default_parser(architecture: str) -> str:
    """The parser of a model family (``--tool-call-parser`` overrides it)."""
    a = architecture.lower()
    if a.startswith("mistral") or a.startswith("mixtral"):
        return "mistral"
    if a.startswith("llama"):
        return "llama3_json"
    return "hermes"  # Qwen2 / Qwen2.5 / Qwen3 and the Hermes-format fine-tunes


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_field", param)


def check(tools: list | None, tool_choice) -> tuple[list[dict], str | None]:
    """The request's tools (each ``{"type": "function", "function": {...}}``) and its choice:
    None (no tools, or ``none``), ``auto``, ``required`` or the named function's name."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools holds {len(tools)} tools: the limit is {MAX_TOOLS}", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                       "\"parameters\"}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"tools[{i}].function.name={name!r} is invalid: 1-64 characters of A-Z a-z 0-9 _ -",
                       f"tools[{i}].function.name")
        if name in names:
            raise _bad(f"tools[{i}].function.name={name!r} is given twice: tool names must be unique",
                       f"tools[{i}].function.name")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise _bad(f"tools[{i}].function has unknown field(s) {sorted(extra)}", f"tools[{i}].function")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    choice = tool_choice
    if choice is None:
        return out, "auto" if out else None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                       '...}}', "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice names function {name!r}, which is not among the tools ({sorted(names)})",
                       "tool_choice")
        return out, name
    if choice not in ("none", "auto", "required"):
        raise _bad(f'tool_choice={choice!r} is invalid: "none", "auto", "required" or a named function', "tool_choice")
    if choice != "none" and not out:
        raise _bad(f'tool_choice={choice!r} needs tools: send "tools" or omit tool_choice', "tool_choice")
    return out, None if choice == "none" else choice


def grammar(tools: list[dict], choice: str | None, parallel: bool | None) -> StructuredOutputs | None:
    """The grammar that enforces ``required`` or a named function (None: the model chooses)."""
    if choice in (None, "auto"):
        return None
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice != "required":
        return StructuredOutputs(json=by_name[choice])
    calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False} for n, p in by_name.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, args) -> dict:
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _objects(text: str) -> list:
    """The JSON values ``text`` holds one after another (separated by whitespace or ``;``)."""
    dec, at, out = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at >= len(text):
            return out
        value, at = dec.raw_decode(text, at)
        out.append(value)


def _named(objs: list, args_key: tuple[str, ...]) -> list[dict]:
    calls = []
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise ValueError("not a call")
        args = next((o[k] for k in args_key if k in o), {})
        calls.append(_call(o["name"], args))
    return calls


def parse(text: str, parser: str) -> tuple[str | None, list[dict]]:
    """``auto``: the content and the tool calls in the model's output (no calls: all content)."""
    try:
        if parser == "hermes":
            at = text.find("<tool_call>")
            if at < 0:
                return text, []
            objs = [json.loads(m) for m in _HERMES.findall(text[at:]) if m.strip()]
            calls = _named(objs, ("arguments", "parameters"))
            return (text[:at].strip() or None), calls
        body = text.strip()
        if parser == "mistral":
            body = body.removeprefix("[TOOL_CALLS]").strip()
            if not body.startswith("["):
                return text, []
            objs = _objects(body)
            return None, _named([o for arr in objs for o in (arr if isinstance(arr, list) else [arr])],
                                ("arguments", "parameters"))
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        return None, _named(_objects(body), ("parameters", "arguments"))
    except ValueError:
        return text, []  # not calls after all: the output is content


def forced_calls(text: str, choice: str) -> list[dict]:
    """The calls of a ``required`` or named-function output (its grammar made it parse)."""
    if choice != "required":
        return [{"id": call_id(), "type": "function", "function": {"name": choice, "arguments": text}}]
    try:
        return [_call(c["name"], c.get("parameters", {})) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return []  # cut by max_tokens: no complete call


def message(text: str, choice: str | None, parser: str) -> tuple[dict, bool]:
    """The assistant message of a non-streamed answer, and whether it holds tool calls."""
    if choice in (None,):
        return {"role": "assistant", "content": text}, False
    if choice == "auto":
        content, calls = parse(text, parser)
    else:
        content, calls = None, forced_calls(text, choice)
    msg = {"role": "assistant", "content": content if calls else text}
    if calls:
        msg["tool_calls"] = calls
    return msg, bool(calls)


def finish_reason(reason: str, choice: str | None, has_calls: bool) -> str:
    """``tool_calls`` when the answer holds calls (a named function: ``stop``, as OpenAI answers)."""
    if has_calls and reason == "stop" and choice not in (None, "auto", "required"):
        return "stop"
    return "tool_calls" if has_calls and reason == "stop" else reason


def template_messages(messages: list[dict]) -> list[dict]:
    """Earlier assistant ``tool_calls`` with their arguments as objects, as chat templates read them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


class Stream:
    """One streamed choice's tool-call state (module docstring, 4): ``feed`` each text piece, get
    the content to send now and tool-call deltas; ``end`` the rest."""

    START = {"hermes": "<tool_call>"}

    def __init__(self, choice: str | None, parser: str):
        self.choice, self.parser = choice, parser
        self.text = ""  # everything generated
        self.sent = 0  # characters of ``text`` sent as content
        self.tool_mode = choice not in (None, "auto")
        self.named_id = call_id() if choice not in (None, "auto", "required") else None
        self.opened = False
        self.has_calls = False
        # required / auto: the calls found so far, and the one whose arguments stream now (``_calls``)
        self.calls: list[str] = []
        self.pos = 0  # where the next call's head is searched
        self.args: dict | None = None  # the open call: its arguments' scan state

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        self.text += piece
        if self.named_id is not None:  # the arguments stream as they come
            deltas = []
            if not self.opened:
                self.opened = self.has_calls = True
                deltas.append({"index": 0, "id": self.named_id, "type": "function",
                               "function": {"name": self.choice, "arguments": ""}})
            if piece:
                deltas.append({"index": 0, "function": {"arguments": piece}})
            return "", deltas
        if self.choice == "required":
            return "", self._calls(_CALL_HEAD)
        if self.tool_mode:  # auto, in its calls: each one streams once its head is complete
            return "", self._calls(_AUTO_HEAD)
        if self.choice is None:
            return self._send(len(self.text)), []
        if self.parser == "hermes":
            at = self.text.find(self.START["hermes"])
            if at >= 0:
                self.tool_mode, self.pos = True, at
                return self._send(at), self._calls(_AUTO_HEAD)
            return self._send(len(self.text) - _held(self.text, self.START["hermes"])), []
        head = self.text.lstrip()
        if not head:
            return "", []
        marks = ("{", "<|python_tag|>") if self.parser == "llama3_json" else ("[", "[TOOL_CALLS]")
        if any(head.startswith(m) or m.startswith(head) for m in marks):
            self.tool_mode, self.pos = True, self.sent
            return "", self._calls(_AUTO_HEAD)
        return self._send(len(self.text)), []

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def end(self) -> tuple[str, list[dict]]:
        """At the output's end: (content not sent yet, tool-call deltas)."""
        if self.named_id is not None:
            return "", ([] if self.opened else self.feed("")[1])
        if self.choice == "required":
            return "", self._calls(_CALL_HEAD)
        if not self.tool_mode:
            return self._send(len(self.text)), []
        if self.calls:  # auto, streamed call by call: the rest of the last one
            return "", self._calls(_AUTO_HEAD)
        calls = parse(self.text[self.sent:], self.parser)[1]
        if not calls:
            return self._send(len(self.text)), []
        self.has_calls = True
        deltas = []
        for k, c in enumerate(calls):
            deltas.append({"index": k, "id": c["id"], "type": "function",
                           "function": {"name": c["function"]["name"], "arguments": ""}})
            deltas.append({"index": k, "function": {"arguments": c["function"]["arguments"]}})
        return "", deltas

    def _calls(self, head: re.Pattern) -> list[dict]:
        """Calls as they are generated: each call's id and name go out once its ``head`` (``{"name":
        N, "parameters": `` up to its arguments' ``{``) is complete, then its arguments as they
        arrive, up to the end of their object.  ``required``'s output is ``[{"name": N,
        "parameters": {...}}, ...]`` exactly (its grammar, compact JSON: ``_CALL_HEAD``); ``auto``'s
        calls are the model's own JSON (``_AUTO_HEAD``: any spacing, ``parameters`` or ``arguments``,
        the name first; a call written otherwise is parsed whole at the end)."""
        deltas = []
        while True:
            if self.args is None:
                m = head.search(self.text, self.pos)
                if m is None:
                    return deltas
                self.calls.append(call_id())
                self.has_calls = True
                deltas.append({"index": len(self.calls) - 1, "id": self.calls[-1], "type": "function",
                               "function": {"name": json.loads(f'"{m.group(1)}"'), "arguments": ""}})
                self.args = dict(start=m.end(), scan=m.end(), sent=m.end(), depth=0, in_str=False, esc=False)
            a, end = self.args, None
            for i in range(a["scan"], len(self.text)):
                ch = self.text[i]
                if a["in_str"]:
                    if a["esc"]:
                        a["esc"] = False
                    elif ch == "\\":
                        a["esc"] = True
                    elif ch == '"':
                        a["in_str"] = False
                elif ch == '"':
                    a["in_str"] = True
                elif ch in "{[":
                    a["depth"] += 1
                elif ch in "}]":
                    a["depth"] -= 1
                    if a["depth"] == 0:
                        end = i + 1
                        break
            a["scan"] = end if end is not None else len(self.text)
            if a["scan"] > a["sent"]:
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": self.text[a["sent"]:a["scan"]]}})
                a["sent"] = a["scan"]
            if end is None:
                return deltas
            self.args, self.pos = None, end


_CALL_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "parameters": ')
_AUTO_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')


def _held(text: str, mark: str) -> int:
    """How many trailing characters of ``text`` could begin ``mark`` (held back from streaming)."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0
