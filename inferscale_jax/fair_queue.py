"""The scheduler's waiting queue, fair between tenants.

Requests wait in arrival order (a deque), and the queue counts each tenant's waiting requests.
Admission takes its next request with ``pick``:

1. Among the tenants that have requests waiting, the one with the fewest requests running now
   (ties: the tenant that has been waiting longest, the counter's insertion order).
2. Of that tenant's first ``lookahead`` waiting requests, the first whose chain nodes are all
   resident (it can start without computing a node), else its oldest.

So a tenant that floods the queue with a thousand requests delays another tenant's request by
at most the admissions of its own turn: each admission goes to whoever runs least, and a
single tenant (or no contention) keeps plain arrival order.  Requests leave with ``remove``;
a preempted request goes back to the front (``appendleft``).  The server's per-tenant cap on
queued requests (``serving/app.py``, 429) keeps one tenant from holding the whole queue, and
the scheduler's ``tenant_cap`` (``pick``'s ``cap``) from holding every row of a step.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Iterator


class FairQueue:
    def __init__(self) -> None:
        self._queue: deque = deque()
        self.count: Counter = Counter()  # tenant -> requests waiting (only tenants with some)

    def append(self, req) -> None:
        self._queue.append(req)
        self.count[req.tenant] += 1

    def appendleft(self, req) -> None:
        self._queue.appendleft(req)
        self.count[req.tenant] += 1

    def remove(self, req) -> None:
        self._queue.remove(req)
        left = self.count[req.tenant] - 1
        if left:
            self.count[req.tenant] = left
        else:
            del self.count[req.tenant]

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator:
        return iter(self._queue)

    def pick(self, running: Counter, lookahead: int, ready: Callable, cap: int | None = None) -> object | None:
        """The next request to admit (the module docstring's rule); ``running``: requests
        running per tenant; ``ready(req)``: whether it can start without computing a node;
        ``cap``: a tenant running that many is passed over (``None`` when every waiting tenant is)."""
        tenants = list(self.count) if cap is None else [t for t in self.count if running.get(t, 0) < cap]
        if not tenants:
            return None
        if len(tenants) < len(self.count) or len(tenants) > 1:
            tenant = min(tenants, key=lambda t: running.get(t, 0))
            window = []
            for req in self._queue:
                if req.tenant == tenant:
                    window.append(req)
                    if len(window) >= lookahead:
                        break
        else:  # one tenant waits (or none is capped among one): plain arrival order
            window = [self._queue[i] for i in range(min(lookahead, len(self._queue)))]
        return next((r for r in window if ready(r)), window[0])
