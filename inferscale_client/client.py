"""``InferScale``: a small client for the server's extensions, beside the ``openai`` client.

The ``openai`` client does completions and chat; this one does what OpenAI's API has no route
for: segments (register, list, get, update, append, delete) and sessions (list, get, delete).
It speaks the same HTTP, the same ``Authorization: Bearer`` key and the same error body, and
needs nothing but the standard library (no jax, no openai), so it runs anywhere::

    from openai import OpenAI
    from inferscale_client import InferScale

    base, key = "http://127.0.0.1:8000/v1", "my-key"
    llm, kb = OpenAI(base_url=base, api_key=key), InferScale(base_url=base, api_key=key)
    kb.segments.create("faq", text=open("faq.md").read())          # KV computed once, kept
    kb.segments.append("faq", text="\\nNew: returns within 60 days.")  # only the new tokens computed
    r = llm.chat.completions.create(model="inferscale", messages=[{"role": "user", "content": "Returns?"}],
                                    extra_body=kb.extensions(segments=["faq"], session="user-42"))
    r.usage.prompt_tokens_details.cached_tokens                       # the reused tokens

Errors: a non-2xx answer raises ``InferScaleError`` with the HTTP ``status``, the OpenAI error
``code`` and ``message`` (``NotFound`` for 404, so ``except NotFound`` reads naturally).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class InferScaleError(Exception):
    """A non-2xx answer: ``status`` (HTTP), ``code`` and ``message`` from the OpenAI error body."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class NotFound(InferScaleError):
    """404: an unknown segment or session (another tenant's is answered the same way)."""


class _Resource:
    def __init__(self, client: "InferScale", path: str):
        self._client, self._path = client, path

    def _url(self, item_id: str, suffix: str = "") -> str:
        return f"{self._path}/{urllib.parse.quote(item_id, safe='/:')}{suffix}"


class Segments(_Resource):
    """``/v1/segments``: named context whose KV the server keeps (docs/segments.md)."""

    def create(self, id: str, text: str | None = None, *, token_ids: list[int] | None = None,
               public: bool = False, pin: bool = False) -> dict:
        """Register a segment; returns ``{"id", "num_tokens", "version", ...}`` (409 if it exists)."""
        return self._client._request("POST", self._path, _content(text, token_ids, id=id, public=public, pin=pin))

    def list(self) -> list[dict]:
        return self._client._request("GET", self._path)["data"]

    def get(self, id: str) -> dict:
        return self._client._request("GET", self._url(id))

    def update(self, id: str, text: str | None = None, *, token_ids: list[int] | None = None) -> dict:
        """Replace the content: a new ``version``; requests already running keep the old one."""
        return self._client._request("PUT", self._url(id), _content(text, token_ids))

    def append(self, id: str, text: str | None = None, *, token_ids: list[int] | None = None) -> dict:
        """Append tokens (only they are computed): a new ``version``."""
        return self._client._request("POST", self._url(id, "/append"), _content(text, token_ids))

    def delete(self, id: str) -> dict:
        return self._client._request("DELETE", self._url(id))


class Sessions(_Resource):
    """``/v1/sessions``: conversation memory that chat requests with ``session`` keep and reuse."""

    def list(self) -> list[dict]:
        return self._client._request("GET", self._path)["data"]

    def get(self, id: str) -> dict:
        """``{"id", "num_tokens", "turns", "created", "updated", "expires_at"}``."""
        return self._client._request("GET", self._url(id))

    def delete(self, id: str) -> dict:
        return self._client._request("DELETE", self._url(id))


def _content(text, token_ids, **fields) -> dict:
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text or token_ids")
    return {**fields, **({"text": text} if text is not None else {"token_ids": list(token_ids)})}


class InferScale:
    """The extensions' client.  ``base_url``: the server, with or without ``/v1`` (the ``openai``
    client's ``base_url`` works as is); ``api_key``: the ``Bearer`` key (None: a server without
    keys); ``timeout`` in seconds (registering a long segment computes its KV before answering)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600.0):
        root = base_url.rstrip("/")
        self.base_url = root[:-3] if root.endswith("/v1") else root
        self.api_key, self.timeout = api_key, timeout
        self.segments = Segments(self, "/v1/segments")
        self.sessions = Sessions(self, "/v1/sessions")

    @staticmethod
    def extensions(*, segments: list[str] | None = None, session: str | None = None,
                   mode: str | None = None) -> dict:
        """The request extensions as the ``openai`` client's ``extra_body``."""
        body: dict = {}
        if segments:
            body["segments"] = list(segments)
        if session is not None:
            body["session"] = session
        if mode is not None:
            body["mode"] = mode
        return body

    def health(self) -> dict:
        return self._request("GET", "/health")

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)["error"]
                code, message = err.get("code"), err.get("message", "")
            except (ValueError, KeyError, TypeError):
                code, message = None, raw.decode(errors="replace")[:500]
            raise (NotFound if e.code == 404 else InferScaleError)(e.code, code, message) from None
