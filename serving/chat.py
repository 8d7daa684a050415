"""Chat prompts as token ids: segments placed inside messages, and conversation memory (sessions).

**Placement.**  A segment goes where the client puts it: a content part ``{"type": "segment",
"id": "faq"}`` inside any message.  The request-level ``segments`` go inside the system message,
after its own text (a system message holding only them is added when there is none), so a real
chat model sees its context inside the chat format rather than ahead of it.  Each placed
segment becomes a placeholder (``_marker``: private-use characters no tokenizer merges with
text), the tokenizer's chat template renders the messages, and the text is split at the
placeholders: the literal pieces are tokenized one by one (no special tokens added; a leading
BOS the template wrote is dropped, since the engine adds the model's own), the segments keep
their registered token ids.  The request's tokens are therefore

    tokens(piece 0) + tokens(seg 1) + tokens(piece 1) + ... + tokens(seg n) + tokens(piece n)

which is the template rendered with each segment's text inline wherever the tokenizer does not
merge across a piece boundary (chat templates put segments between whitespace or special
tokens, where it does not).  The engine gets ``segments = [piece 0, seg 1, piece 1, ..., seg n]``
(pieces as literal token runs, ``segments.literal``) and ``prompt_token_ids = piece n``: in exact
mode the KV of [template prefix + segment] is a chain node keyed by the preceding tokens, computed
once and reused by every later request of the tenant with the same prefix.

**Sessions.**  With ``session: id`` the request also names the tenant's conversation memory
(``inferscale_jax/sessions.py``): the engine injects the session's KV when its tokens begin this
request's.  After the reply the conversation so far - the messages and the reply, rendered
without a generation prompt, split the same way - is saved as the session's next version
(``save_items``), before the response (or the stream's ``[DONE]``) goes out, so the next turn
finds it.
"""

from __future__ import annotations

import dataclasses
import re
import secrets

from serving import tools
from serving.errors import APIError

_MARK = re.compile("\ue000is-seg-([0-9]+)-([0-9a-f]{8})\ue001")


def _marker(i: int, nonce: str) -> str:
    return f"\ue000is-seg-{i}-{nonce}\ue001"


@dataclasses.dataclass
class ChatPrompt:
    segments: list  # engine chain items: segment ids and literal token-id lists
    prompt_token_ids: list[int]
    messages: list[dict]  # the template messages with placeholders (for the session save)
    placed: list[str]  # segment ids, in placeholder order
    nonce: str
    options: dict | None = None  # the request's chat_template_kwargs (the session save renders with them)
    tools: list | None = None  # the request's tools (serving/tools.py; the session save renders with them)


def _messages(req, nonce: str) -> tuple[list[dict], list[str]]:
    placed: list[str] = []

    def mark(segment_id: str) -> str:
        placed.append(segment_id)
        return _marker(len(placed) - 1, nonce)

    out = []
    for m in req.messages:
        if isinstance(m.content, list):
            text = "\n".join(p.text if p.type == "text" else mark(p.id) for p in m.content)
        else:
            text = m.content or ""
        d = {"role": m.role, "content": text}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    if req.segments:
        marks = "\n\n".join(mark(sid) for sid in req.segments)
        system = next((d for d in out if d["role"] in ("system", "developer")), None)
        if system is None:
            out.insert(0, {"role": "system", "content": marks})
        else:
            system["content"] = f"{system['content']}\n\n{marks}" if system["content"] else marks
    return tools.template_messages(out), placed


def _render(tok, messages: list[dict], generation_prompt: bool, template: str | None = None,
            options: dict | None = None, continue_final: bool = False, tool_list: list | None = None) -> str:
    """The template's text for ``messages``; ``template``: the server's ``--chat-template`` (None:
    the tokenizer's); ``options``: the request's ``chat_template_kwargs`` (template variables);
    ``tool_list``: the request's tools (serving/tools.py), rendered as the template does."""
    kwargs = dict(options or {})
    if continue_final:
        kwargs["continue_final_message"] = True
    if tool_list:
        kwargs["tools"] = tool_list
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                       chat_template=template, **kwargs)
    except ImportError as e:  # a missing server library (jinja2) is the server's fault, not the client's
        raise RuntimeError(f"chat templates cannot be rendered on this server: {e}") from e
    except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are the client's
        raise APIError(400, f"the chat template rejected the messages: {e}", "invalid_messages", "messages") from None


def check_template(tok, template: str | None) -> None:
    """At startup: raise ``ValueError`` naming the missing piece when a chat template exists (the
    model's or ``template``) but cannot render a plain conversation (no jinja2, a broken
    template).  A model with no template at all starts; its chat requests get a 400."""
    if tok is None or (template is None and not getattr(tok, "chat_template", None)):
        return
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    except ImportError as e:
        raise ValueError(f"chat templates cannot be rendered: {e} (pip install jinja2, a dependency of "
                         "inferscale-jax: reinstall with pip install -e .)") from None
    except Exception as e:  # noqa: BLE001 - a template that cannot render the simplest conversation
        try:  # templates that refuse a system role: a user message alone
            tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True, chat_template=template)
        except Exception:  # noqa: BLE001 - see above
            what = "the --chat-template" if template is not None else "the model's chat template"
            raise ValueError(f"{what} cannot render a conversation ({type(e).__name__}: {e}); fix it or give "
                             "another with --chat-template FILE") from None


async def _split(text: str, placed: list[str], nonce: str, tokenize, bos: list[int]) -> tuple[list, list[int]]:
    """Chain items and the final piece's ids of a rendered text (module docstring)."""
    items: list = []
    at, seen = 0, []
    pieces: list[str] = []
    for m in _MARK.finditer(text):
        if m.group(2) != nonce:
            continue
        pieces.append(text[at:m.start()])
        seen.append(int(m.group(1)))
        at = m.end()
    pieces.append(text[at:])
    if sorted(seen) != list(range(len(placed))):
        lost = [placed[i] for i in range(len(placed)) if i not in seen]
        raise APIError(400, f"the chat template dropped the message holding segment(s) {lost} (this model's "
                       "template ignores that message or role); place them in a user message as a content part "
                       '{"type": "segment", "id": ...}', "invalid_messages", "messages")
    ids = [await tokenize(p) if p else [] for p in pieces]
    if bos and ids[0][:len(bos)] == bos:
        ids[0] = ids[0][len(bos):]  # the template wrote the BOS; the engine adds it
    for piece, i in zip(ids[:-1], seen):
        if piece:
            items.append(piece)
        items.append(placed[i])
    return items, ids[-1]


def require_template(tok, template: str | None = None) -> None:
    if tok is None or (template is None and not getattr(tok, "chat_template", None)):
        raise APIError(400, "this model's tokenizer has no chat template, so chat messages cannot be formatted; "
                       "start the server with --chat-template FILE, or use /v1/completions with your own prompt "
                       "format", "no_chat_template")


async def build(tok, req, tokenize, bos: list[int], template: str | None = None,
                tool_list: list | None = None) -> ChatPrompt:
    """The engine's chain items and prompt ids of a chat request (module docstring);
    ``template``: the server's ``--chat-template`` (None: the tokenizer's); ``tool_list``: the
    request's checked tools."""
    require_template(tok, template)
    nonce = secrets.token_hex(4)
    messages, placed = _messages(req, nonce)
    text = _render(tok, messages, req.add_generation_prompt, template, req.chat_template_kwargs,
                   req.continue_final_message, tool_list)
    items, last = await _split(text, placed, nonce, tokenize, bos)
    return ChatPrompt(items, last, messages, placed, nonce, req.chat_template_kwargs, tool_list)


async def save_items(tok, prompt: ChatPrompt, reply: str, tokenize, bos: list[int],
                     template: str | None = None) -> tuple[list, list[int]]:
    """The session's content after this turn: the messages plus the reply, no generation prompt."""
    messages = [*prompt.messages, {"role": "assistant", "content": reply}]
    text = _render(tok, messages, False, template, prompt.options, tool_list=prompt.tools)
    return await _split(text, prompt.placed, prompt.nonce, tokenize, bos)
