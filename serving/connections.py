"""Connection guards uvicorn lacks: a deadline for each request's head, a cap per client address.

``guarded_protocol()`` is the HTTP protocol ``UVICORN_OPTIONS["http"]`` names: uvicorn's httptools
protocol (the C parser of uvicorn's ``standard`` install, which vLLM and SGLang serve with) when
httptools is installed, else its pure-Python h11 protocol, either with two rules (``ConnectionGuard``):

1. **Head deadline.**  From the moment a connection opens, or starts a new request after a
   response, its request line and headers must arrive within ``HEAD_TIMEOUT_S``; else the
   connection is closed.  A client holding many connections open with partial headers
   (slow-loris) then holds each for seconds, not forever.  Once the head is in, the body has
   its own deadline (``body_timeout_s``, ``middleware.py``), and an idle keep-alive connection
   uvicorn's ``timeout_keep_alive``.
2. **Connections per client address.**  At most ``MAX_CONNECTIONS_PER_CLIENT`` open at once
   from one address (per API-server process); one more is closed as soon as it opens, so one
   client cannot take the server's connection limit (``limit_concurrency``) from everyone else.
   The cap is above what benchmark tools open from one machine (guidellm: 512 streams).

Behind a reverse proxy every client has the proxy's address: give the proxy these limits and
raise the cap (``MAX_CONNECTIONS_PER_CLIENT``) to its connection count.
"""

from __future__ import annotations

import logging
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("inferscale.server")
HEAD_TIMEOUT_S = 10.0
MAX_CONNECTIONS_PER_CLIENT = 1024


class ConnectionGuard:
    """The two rules over any uvicorn HTTP protocol (both keep ``cycle``, ``client``, ``loop`` and
    ``transport``, and call ``on_response_complete``); mixed in before the protocol class."""
    open_per_client: Counter = Counter()  # address -> open connections (this process, every protocol)
    head_timeout_s = HEAD_TIMEOUT_S
    max_per_client = MAX_CONNECTIONS_PER_CLIENT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._address = self.client[0] if self.client else None
        if self._address is not None:
            count = self.open_per_client[self._address] + 1
            self.open_per_client[self._address] = count
            if count > self.max_per_client:
                log.warning("closing a connection from %s: %d open, the limit per client address is %d",
                            self._address, count, self.max_per_client)
                self.transport.close()
                return
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        if self._address is not None:
            left = self.open_per_client[self._address] - 1
            if left > 0:
                self.open_per_client[self._address] = left
            else:
                self.open_per_client.pop(self._address, None)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()  # bytes of a new request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_timer()  # the head is in: a request is running

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_head_timer()  # (idle now: uvicorn's keep-alive timer takes over)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            log.info("closing a connection from %s: no complete request head within %.0f s",
                     self._address, self.head_timeout_s)
            self.transport.close()


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """uvicorn's h11 (pure Python) protocol with the guards."""


def guarded_protocol() -> type:
    """The guarded httptools protocol when httptools is installed, else the guarded h11 one."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools missing: uvicorn's pure-Python parser
        return GuardedH11Protocol

    class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
        """uvicorn's httptools (C parser) protocol with the guards."""

    return GuardedHttpToolsProtocol
