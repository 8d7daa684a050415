"""Soak test: a long run of mixed traffic through the real HTTP server, checked continuously
against the contract of docs/architecture.md ("HTTP API", "Tenancy and security", "Persistence").

Usage (from the repository root, INFERSCALE_CACHE set)::

    python bench/serving/soak.py                                  # 30 minutes, writes bench/results/soak.md
    python bench/serving/soak.py --minutes 1 --out /tmp/soak      # what tests/persistence/test_soak.py runs

Life of a run:

1. **Setup.** A key file with three tenants (``alpha``, ``beta``, ``gamma``) and one admin
   (``ops``), a snapshot folder, and ``inferscale serve`` as a subprocess on a free 127.0.0.1
   port with a small ``--hbm-pages`` (segments are demoted to the host tier and promoted back)
   and a short ``--snapshot-interval``.  Each tenant registers two *stable* segments (never
   changed), the admin a public stable one; a reference pass answers each with one prompt.
2. **Warm-up** (not timed): the full workload runs ``--warmup`` seconds so that the server
   compiles its step buckets; then the first quiet point (the baseline).
3. **Soak** (``--minutes``): ``--clients`` asyncio clients (httpx) send greedy and sampled
   completions, streaming or not, with no segment, a stable one, the public one, a *churn*
   segment, or two of them (exact mode); some streams are closed after their first chunk.
   Meanwhile one churner per tenant (and the admin, for a public churn segment) registers,
   updates (``PUT /v1/segments/{id}``; while the route answers 404 route_not_found or 405 the
   update is a delete + register) and deletes its churn segments, racing the completions that
   name them.  Every ``--quiet-every`` seconds a quiet point.  Half-way (``--kill-at``) the server
   gets ``kill -9`` and is restarted on the same port and snapshot folder.
4. **End**: a last quiet point, every segment deleted, the server stopped with SIGTERM.

Checks (each failure is recorded with its symptom; the exit status is 1 if any):

- no 5xx, ever, but for the 503 that docs/architecture.md allows when retrying can succeed
  (``Retry-After`` with code ``overloaded`` or ``out_of_pages``: counted, and segment calls retried);
  connection errors while the server is down after the kill are counted apart, and ``/health``
  may answer 503 until the restarted server is ready;
- a completion naming a segment that a churner deleted concurrently is a 200 or a 404
  ``segment_not_found``; a 404 for a segment present during the whole request, or a 200 for one
  absent during the whole request, is a failure; stable and public segments always succeed;
- a stream ends with ``[DONE]`` and carries no error event;
- every greedy answer equals the first answer recorded for the same (segment contents, prompt,
  max_tokens), across tenants and across the restart (requests racing an update are compared
  with every version they may have read);
- after the restart every acknowledged segment is listed (with its token count), none deleted
  with acknowledgement is, and the stable segments' answers are those recorded before the kill;
- at quiet points (no request in flight, ``running == waiting == 0``) the listing equals what
  the churners know, ``pages_used + pages_free == pages_total``, and ``pages_used`` is at most
  the pages of the HBM-resident segments plus the chain nodes' (so a request's pages not freed
  shows as a leak); no snapshot error; at the end, with every segment deleted, ``pages_used``,
  ``segments`` and ``chain_nodes`` are 0;
- the server's RSS (``/proc/<pid>/status`` VmRSS, sampled every ``--rss-every`` seconds) grows by
  less than ``--rss-growth`` in each server process once it compiles nothing new (from the first
  quiet point after which the ``compiles`` count stays the same to its last sample);
- the server log holds no ERROR line; and the run exercised what it claims (answers compared,
  404s on churned segments, closed streams, evictions, a snapshot restored after the kill).

Writes ``soak.md`` (tables) and ``soak.json`` (the figures) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
from collections import Counter

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib"))  # bench/lib/
from report import MD, log, table, write_md  # noqa: E402  (bench/lib/report.py)
from soak_damage import Damage  # noqa: E402  (beside this file)
from soak_state import ROOT, Result, Seg, Server, Version, now, wall  # noqa: E402


TENANTS = ("alpha", "beta", "gamma")
ADMIN = "ops"
KEYS = {**{f"soak-{t}-key-0123456789": t for t in TENANTS}, "soak-ops-key-0123456789": {"tenant": ADMIN, "admin": True}}
BEARER = {v if isinstance(v, str) else v["tenant"]: {"Authorization": f"Bearer {k}"} for k, v in KEYS.items()}
WORDS = ("warranty return policy shipping repair support invoice customer product battery screen charger "
         "refund exchange delivery account password order tracking manual cable adapter speaker camera "
         "station harbor river planet garden window market silver orange winter").split()
# four short and four long segment texts: two page counts, so few prefill shapes to compile
TEXTS = [" ".join(random.Random(100 + i).choices(WORDS, k=10 if i < 4 else 24)) + "." for i in range(8)]
PROMPTS = ["Q: what does it cover?", "Q: who pays?", "Summary:", "Q: how long?"]
CHURN_IDS = ("churn-0", "churn-1", "churn-2")
# the 503s docs/architecture.md allows ("overloaded (with Retry-After; only when retrying can succeed)"):
# queue full, or the KV pool held by running requests.  Any other 5xx (engine_fault included) is a failure.
BACKPRESSURE = ("overloaded", "out_of_pages")
RETRIED = "503 backpressure (Retry-After)"


class Soak:
    def __init__(self, args, server: Server):
        self.a, self.server = args, server
        self.ps = args.page_size
        self.failures: dict[str, list[str]] = {}
        self.fail_counts: Counter = Counter()
        self.completions: Counter = Counter()  # outcome -> count
        self.seg_ops: Counter = Counter()  # "op status" -> count
        self.refs: dict[tuple, str] = {}
        self.checks = Counter()  # compared / recorded / unverified / mismatch / restart_verified
        self.ntok: dict[int, int] = {}  # content -> num_tokens
        self.segs: dict[tuple[str, str], Seg] = {}
        self.go = asyncio.Event()  # clients and churners may send (cleared at quiet points)
        self.up = asyncio.Event()  # churners may send (cleared from the kill to the restart check)
        self.done = False
        self.inflight = 0
        self.kills: list[list] = []  # [t_kill, t_ready or None] per kill -9
        self.damage = Damage(server.snapshot_dir, args.seed) if args.damage_every > 0 else None
        self.t0 = now()
        self.rss: list[tuple[float, int, int]] = []  # (seconds since start, life, kB)
        self.rss_quiet: list[tuple[float, int, int, int]] = []  # at quiet points: (t, life, kB, compiles)
        self.quiet_rows: list[list] = []
        self.stats_by_life: dict[int, dict] = {}
        self.put_supported: bool | None = None
        self.put_symptom = ""
        self.health_503 = 0
        self.health_conn_errors = 0
        self.restart_s: list[float] = []
        self.timed = (0.0, 0)
        self.restored: list[dict] = []  # per restart
        self.final: dict | None = None

    # -- bookkeeping ------------------------------------------------------------------------
    def fail(self, kind: str, msg: str) -> None:
        self.fail_counts[kind] += 1
        lst = self.failures.setdefault(kind, [])
        if len(lst) < 12:
            lst.append(msg)
            log(f"[soak] FAIL {kind}: {msg}")

    def in_kill_window(self, t0: float, t1: float) -> bool:
        return any(t1 >= tk and (tr is None or t0 <= tr) for tk, tr in self.kills)

    def pages_of(self, num_tokens: int) -> int:
        return math.ceil((num_tokens + 1) / self.ps)  # + 1: a BOS token the engine may put first

    # -- HTTP -------------------------------------------------------------------------------
    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, timeout=httpx.Timeout(self.a.request_timeout, connect=5.0))

    @staticmethod
    def _json(r: httpx.Response):
        try:
            return r.json()
        except ValueError:
            return r.text[:300]

    @staticmethod
    def _err(body) -> tuple[str, str]:
        e = body.get("error") if isinstance(body, dict) else None
        return (e.get("code"), e.get("message")) if isinstance(e, dict) else (None, str(body)[:200])

    async def complete(self, http, tenant: str, body: dict, disconnect: bool) -> Result:
        headers = BEARER[tenant]
        if not body.get("stream"):
            r = await http.post("/v1/completions", json=body, headers=headers)
            res = Result(r.status_code, self._json(r), retry_after=r.headers.get("retry-after"))
            if r.status_code == 200:
                try:
                    res.text = res.body["choices"][0]["text"]
                except (TypeError, KeyError, IndexError):
                    self.fail("malformed", f"200 body without choices[0].text: {str(res.body)[:200]}")
            return res
        parts, done, errors = [], False, []
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Result(r.status_code, self._json(r), retry_after=r.headers.get("retry-after"))
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    errors.append(f"unexpected SSE line {line[:100]!r}")
                    break
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    errors.append(ev["error"])
                elif ev.get("choices"):
                    parts.append(ev["choices"][0].get("text") or "")
                if disconnect:
                    return Result(200, disconnected=True)  # leaving the block closes the connection
        if errors or not done:
            return Result(200, {"stream_errors": errors, "done": done})
        return Result(200, text="".join(parts))

    # -- one completion and its checks ---------------------------------------------------------
    async def request(self, http, tenant: str, segs: list[Seg], prompt: int, greedy: bool, stream: bool,
                      disconnect: bool, seed: int = 0) -> str:
        body = {"prompt": PROMPTS[prompt], "segments": [s.sid for s in segs], "max_tokens": self.a.max_tokens,
                "ignore_eos": True, "stream": stream}
        body.update({"temperature": 0} if greedy else {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": seed})
        desc = (f"tenant {tenant}, segments {[s.sid for s in segs]}, prompt {prompt}, "
                f"{'stream' if stream else 'json'}{', greedy' if greedy else ', sampled'}")
        t0 = now()
        try:
            res = await self.complete(http, tenant, body, disconnect)
        except (httpx.TransportError, json.JSONDecodeError) as e:
            t1 = now()
            if self.in_kill_window(t0, t1):
                self.completions["connection error (kill window)"] += 1
                return "conn"
            self.completions["connection error"] += 1
            self.fail("connection", f"{type(e).__name__}: {e} ({desc}, {t1 - t0:.1f} s)")
            return "conn"
        t1 = now()
        unsure = any(s.overlaps_unsure(t0, t1) for s in segs)
        status = res.status
        if self.backpressure(status, res.body, res.retry_after):
            self.completions[RETRIED] += 1
            return "503"
        self.completions[str(status) + (" (closed mid-stream)" if res.disconnected else "")] += 1
        if status >= 500:
            code, msg = self._err(res.body)
            self.fail("5xx", f"{status} {code}: {msg} ({desc})")
            return "5xx"
        if status == 404:
            code, msg = self._err(res.body)
            if code != "segment_not_found":
                self.fail("status", f"404 {code}: {msg} ({desc})")
            elif not unsure and all(s.present_throughout(t0, t1) for s in segs):
                self.fail("404 for a present segment", f"{msg} ({desc}; sent {wall(t0)}, answered {wall(t1)}; "
                          f"{' | '.join(s.history(t0, t1) for s in segs)})")
            return "404"
        if status != 200:
            code, msg = self._err(res.body)
            self.fail("status", f"{status} {code}: {msg} ({desc})")
            return "status"
        if not unsure:
            for s in segs:
                if not s.candidates(t0, t1):
                    self.fail("200 for an absent segment", f"{s.owner}/{s.sid} was deleted during the whole "
                              f"request ({desc}; sent {wall(t0)}, answered {wall(t1)}; {s.history(t0, t1)})")
                    return "bad"
        if isinstance(res.body, dict) and "stream_errors" in res.body:
            self.fail("stream", f"stream errors {res.body['stream_errors']}, [DONE] seen: {res.body['done']} ({desc})")
            return "bad"
        if res.text is None or not greedy or unsure:
            return "ok"
        return self.check_text(segs, t0, t1, prompt, res.text, desc)

    def check_text(self, segs, t0, t1, prompt, text, desc) -> str:
        combos = itertools.product(*(s.candidates(t0, t1) for s in segs))
        keys = [(combo, prompt, self.a.max_tokens) for combo in combos]
        if len(keys) == 1:
            want = self.refs.get(keys[0])
            if want is None:
                self.refs[keys[0]] = text
                self.checks["recorded"] += 1
                return "recorded"
            if want == text:
                self.checks["compared"] += 1
                return "compared"
        elif any(self.refs.get(k) == text for k in keys):
            self.checks["compared"] += 1
            return "compared"
        elif not all(k in self.refs for k in keys):
            self.checks["unverified"] += 1
            return "unverified"
        self.checks["mismatch"] += 1
        wants = [self.refs.get(k) for k in keys]
        self.fail("greedy mismatch", f"got {text!r}, want {wants[0] if len(wants) == 1 else wants!r} "
                  f"(segment contents {[k[0] for k in keys]}; {desc})")
        return "mismatch"

    # -- clients ----------------------------------------------------------------------------
    def visible(self, tenant: str) -> tuple[list[Seg], list[Seg]]:
        stable = [self.segs[(tenant, f"stable-{k}")] for k in range(2)]
        churn = [self.segs[(tenant, c)] for c in CHURN_IDS] + [self.segs[(ADMIN, "pub-churn")]]
        return stable, churn

    async def client_loop(self, i: int) -> None:
        rng = random.Random(self.a.seed * 1009 + i)
        http = self.client()
        try:
            while not self.done:
                await self.go.wait()
                if self.done:
                    break
                tenant = rng.choice(TENANTS)
                stable, churn = self.visible(tenant)
                pub = self.segs[(ADMIN, "pub-stable")]
                r = rng.random()
                segs = ([] if r < 0.15 else [rng.choice(stable)] if r < 0.45 else [pub] if r < 0.55
                        else [rng.choice(churn)] if r < 0.80 else [rng.choice(stable), rng.choice(churn + [pub])])
                stream = rng.random() < 0.4
                self.inflight += 1
                try:
                    out = await self.request(http, tenant, segs, rng.randrange(len(PROMPTS)), rng.random() < 0.9,
                                             stream, stream and rng.random() < 0.3, rng.randrange(1 << 30))
                finally:
                    self.inflight -= 1
                if out == "conn":
                    await http.aclose()
                    http = self.client()
                    await asyncio.sleep(0.25)
        finally:
            await http.aclose()

    def backpressure(self, status: int, body, retry_after: str | None) -> bool:
        return status == 503 and retry_after is not None and self._err(body)[0] in BACKPRESSURE

    # -- churn ------------------------------------------------------------------------------
    async def seg_call(self, http, seg: Seg, method: str, path: str, body=None):
        """One segment call, repeated after Retry-After while it answers backpressure (at most 60 s)."""
        t = now()
        while True:
            r = await http.request(method, path, json=body, headers=BEARER[seg.owner])
            resp = self._json(r)
            retry = r.headers.get("retry-after")
            if not self.backpressure(r.status_code, resp, retry) or now() - t > 60:
                return t, now(), r.status_code, resp
            self.seg_ops[f"{method} {RETRIED}"] += 1
            await asyncio.sleep(min(float(retry), 5.0))

    def note_ntok(self, content: int, body, where: str) -> None:
        n = body.get("num_tokens") if isinstance(body, dict) else None
        if n is None:
            return
        if self.ntok.setdefault(content, n) != n:
            self.fail("segment", f"{where}: num_tokens {n} for text {content}, earlier {self.ntok[content]}")

    async def register(self, http, seg: Seg, content: int, expect_new: bool = True) -> None:
        body = {"id": seg.sid, "text": TEXTS[content], **({"public": True} if seg.public else {})}
        t, ta, status, resp = await self.seg_call(http, seg, "POST", "/v1/segments", body)
        self.seg_ops[f"register {status}"] += 1
        if status == 201:
            seg.versions.append(Version(content, t, ta, ta))
            self.note_ntok(content, resp, f"register {seg.sid}")
        elif status >= 500 or expect_new:
            self.fail("5xx" if status >= 500 else "segment", f"register {seg.owner}/{seg.sid}: {status} {resp}")

    async def delete(self, http, seg: Seg) -> None:
        cur = seg.current()
        if cur is not None:
            cur.end_pending = now()  # from here a racing completion may see the segment gone
        t, ta, status, resp = await self.seg_call(http, seg, "DELETE", f"/v1/segments/{seg.sid}")
        self.seg_ops[f"delete {status}"] += 1
        if status == 200:
            cur = seg.current()
            cur.end_sent, cur.end_acked = t, ta
        else:
            if cur is not None:
                cur.end_pending = None
            self.fail("5xx" if status >= 500 else "segment", f"delete {seg.owner}/{seg.sid}: {status} {resp}")

    async def update(self, http, seg: Seg, content: int) -> None:
        if self.put_supported is not False:
            pending = seg.current()
            if pending is not None:
                pending.end_pending = now()  # (as in delete)
            t, ta, status, resp = await self.seg_call(http, seg, "PUT", f"/v1/segments/{seg.sid}",
                                                      {"text": TEXTS[content]})
            if pending is not None and status not in (200, 201):
                pending.end_pending = None
            self.seg_ops[f"update {status}"] += 1
            code = self._err(resp)[0]
            if status in (404, 405) and code in ("route_not_found", "method_not_allowed"):
                if self.put_supported is None:
                    self.put_symptom = f"{status} {code}"
                    log(f"[soak] PUT /v1/segments/{{id}} answers {status} {code}: updates are delete + register")
                self.put_supported = False
            elif status in (200, 201):
                self.put_supported = True
                cur = seg.current()
                cur.end_sent, cur.end_acked = t, ta
                seg.versions.append(Version(content, t, ta, cur.present_from))
                self.note_ntok(content, resp, f"update {seg.sid}")
                return
            else:
                self.fail("5xx" if status >= 500 else "segment", f"update {seg.owner}/{seg.sid}: {status} {resp}")
                return
        await self.delete(http, seg)
        await self.register(http, seg, content)

    async def reconcile(self, http, seg: Seg, op: str, content: int | None, t: float) -> None:
        """After a churn call lost to the kill: learn from the restarted server what it kept."""
        seg.unsure.append([t, None])
        await self.up.wait()
        _, ta, status, resp = await self.seg_call(http, seg, "GET", f"/v1/segments/{seg.sid}")
        present = status == 200
        n = resp.get("num_tokens") if present and isinstance(resp, dict) else None
        cur = seg.current()
        # an update switches between the short and the long texts, so the token count tells versions apart
        new = content is not None and present and (cur is None or n != self.ntok.get(cur.content))
        if cur is not None and (not present or new):
            cur.end_sent, cur.end_acked = t, ta
        if new:
            seg.versions.append(Version(content, t, ta, ta))
            self.note_ntok(content, resp, f"{op} {seg.sid} (reconciled)")
        seg.unsure[-1][1] = ta
        log(f"[soak] {seg.owner}/{seg.sid}: {op} lost to the kill; after the restart it is "
            f"{'present' if present else 'absent'} ({n} tokens)")

    async def churn_loop(self, owner: str, segs: list[Seg], k: int) -> None:
        rng = random.Random(self.a.seed * 7919 + k)
        http = self.client()
        try:
            while not self.done:
                await self.go.wait()
                await self.up.wait()
                if self.done:
                    break
                seg = rng.choice(segs)
                cur = seg.current()
                if cur is None:
                    op, content = "register", rng.randrange(len(TEXTS))
                elif rng.random() < 0.5:  # a new version of the other length (tells versions apart by size)
                    op, content = "update", rng.randrange(4) + (0 if cur.content >= 4 else 4)
                else:
                    op, content = "delete", None
                self.inflight += 1
                t = now()
                try:
                    await (self.register(http, seg, content) if op == "register" else
                           self.update(http, seg, content) if op == "update" else self.delete(http, seg))
                except httpx.TransportError as e:
                    if self.in_kill_window(t, now()) or not self.up.is_set():
                        await http.aclose()
                        http = self.client()
                        await self.reconcile(http, seg, op, content, t)
                    else:
                        self.fail("connection", f"{op} {owner}/{seg.sid}: {type(e).__name__}: {e}")
                finally:
                    self.inflight -= 1
                await asyncio.sleep(rng.uniform(0.2, 1.2))
        finally:
            await http.aclose()

    # -- server-wide checks -------------------------------------------------------------------
    async def stats(self, http) -> dict:
        r = await http.get("/v1/stats", headers=BEARER[ADMIN])
        if r.status_code != 200:
            raise RuntimeError(f"GET /v1/stats: {r.status_code} {r.text[:200]}")
        return r.json()

    async def check_listing(self, http, where: str) -> dict[tuple[str, str], dict]:
        """Every certain segment listed (with its token count) iff present; returns the listed ones."""
        listed = {}
        for tenant in (*TENANTS, ADMIN):
            r = await http.get("/v1/segments", headers=BEARER[tenant])
            if r.status_code != 200:
                self.fail("5xx" if r.status_code >= 500 else "listing", f"{where}: GET /v1/segments as {tenant}: "
                          f"{r.status_code} {r.text[:200]}")
                continue
            got = {s["id"]: s for s in r.json()["data"]}
            for seg in self.segs.values():
                if seg.owner != tenant and not seg.public:
                    continue
                if not seg.certain():
                    continue
                cur = seg.current()
                item = got.get(seg.sid)
                if cur is None and item is not None:
                    self.fail("listing", f"{where}: {seg.owner}/{seg.sid} is listed for {tenant} but was deleted "
                              "with acknowledgement")
                elif cur is not None and item is None:
                    self.fail("listing", f"{where}: acknowledged {seg.owner}/{seg.sid} is not listed for {tenant}")
                elif item is not None and item["num_tokens"] != self.ntok.get(cur.content):
                    self.fail("listing", f"{where}: {seg.owner}/{seg.sid} has {item['num_tokens']} tokens, "
                              f"want {self.ntok.get(cur.content)}")
                if item is not None:
                    listed[(seg.owner, seg.sid)] = item
        return listed

    async def quiet_point(self, label: str) -> dict:
        """No request in flight; then the page accounting and the listing (module docstring)."""
        self.go.clear()
        deadline = now() + self.a.request_timeout + 30
        while self.inflight and now() < deadline:
            await asyncio.sleep(0.1)
        async with self.client() as http:
            try:
                if self.inflight:
                    raise RuntimeError(f"{self.inflight} requests still in flight after "
                                       f"{self.a.request_timeout + 30:.0f} s")
                deadline = now() + 60
                while True:
                    st = await self.stats(http)
                    if st["running"] == 0 and st["waiting"] == 0:
                        break
                    if now() > deadline:
                        raise RuntimeError(f"running={st['running']} waiting={st['waiting']} 60 s after the last "
                                           "response")
                    await asyncio.sleep(0.2)
                listed = await self.check_listing(http, f"quiet point {label}")
                hbm = 0
                for (owner, sid), item in listed.items():
                    r = await http.get(f"/v1/segments/{sid}", headers=BEARER[owner])
                    if r.status_code == 200 and r.json().get("tier") == "hbm":
                        hbm += self.pages_of(item["num_tokens"])
                st = await self.stats(http)
            except (RuntimeError, httpx.TransportError) as e:
                self.fail("quiet point", f"{label}: {type(e).__name__}: {e}")
                self.go.set()
                return {}
        roots = st["tiers"]["hbm"]["segments"]
        slack = (st["chain_nodes"] - roots) * (max(self.pages_of(n) for n in self.ntok.values()) + 1)
        bound = hbm + slack
        ok = st["pages_used"] <= bound and st["pages_used"] + st["pages_free"] == st["pages_total"]
        if not ok:
            self.fail("pages", f"quiet point {label}: pages_used {st['pages_used']} > {bound} (HBM segments {hbm} + "
                      f"{st['chain_nodes'] - roots} chain nodes' {slack}), or used + free {st['pages_used']} + "
                      f"{st['pages_free']} != total {st['pages_total']}")
        snap = st.get("snapshot") or {}
        if snap.get("last_error"):
            self.fail("snapshot", f"quiet point {label}: last_error {snap['last_error']}")
        kb, t = self.server.rss_kb(), now() - self.t0
        if kb is not None:
            self.rss.append((t, self.server.life, kb))
            self.rss_quiet.append((t, self.server.life, kb, st["compiles"]))
        self.stats_by_life[self.server.life] = st
        self.quiet_rows.append([label, f"{t:.0f}", st["pages_used"], hbm, st["chain_nodes"] - roots,
                                st["prefix_cached_pages"], st["segments"], st["tiers"]["hbm"]["evictions"],
                                snap.get("snapshots"), st["compiles"], f"{kb / 1024:.0f}" if kb else "-",
                                "ok" if ok else "LEAK"])
        log(f"[soak] quiet point {label}: pages_used {st['pages_used']} (bound {bound}), segments {st['segments']}, "
            f"evictions {st['tiers']['hbm']['evictions']}, snapshots {snap.get('snapshots')}")
        self.go.set()
        return st

    async def wait_ready(self, timeout: float) -> None:
        deadline = now() + timeout
        async with self.client() as http:
            while now() < deadline:
                if self.server.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.server.proc.returncode}; see {self.server.logs[-1]}")
                try:
                    r = await http.get("/health", timeout=10)
                    if r.status_code == 200:
                        return
                    if r.status_code == 503:
                        self.health_503 += 1
                    else:
                        self.fail("health", f"/health answered {r.status_code} {r.text[:200]}")
                except httpx.TransportError:
                    self.health_conn_errors += 1
                await asyncio.sleep(0.25)
        raise RuntimeError(f"server not ready within {timeout:.0f} s; see {self.server.logs[-1]}")

    async def reference_pass(self, label: str) -> None:
        """Each stable segment of each tenant with prompt 0, greedy, one at a time."""
        async with self.client() as http:
            for tenant in TENANTS:
                stable, _ = self.visible(tenant)
                for seg in [*stable, self.segs[(ADMIN, "pub-stable")]]:
                    out = await self.request(http, tenant, [seg], 0, True, False, False)
                    if label == "after restart":
                        if out == "compared":
                            self.checks["restart_verified"] += 1
                        elif out != "mismatch":
                            self.fail("restart", f"{tenant} {seg.sid}: after the restart the answer was {out!r}, "
                                      "not compared with the one before the kill")

    async def kill_and_restart(self) -> None:
        self.up.clear()
        if self.server.life in self.stats_by_life:
            log(f"[soak] before the kill: {self.stats_by_life[self.server.life]['snapshot']}")
        self.kills.append([now(), None])
        async with self.client() as http:  # the dying life's integrity counters (best effort)
            try:
                self.stats_by_life[self.server.life] = await self.stats(http)
            except (httpx.HTTPError, KeyError, ValueError):
                pass
        await asyncio.to_thread(self.server.kill9)
        log(f"[soak] kill -9 number {len(self.kills)} at {self.kills[-1][0] - self.t0:.0f} s")
        if self.damage is not None:
            how = self.damage.registry_log()
            log(f"[soak] damage: registry write-ahead log {how or 'absent (nothing to damage)'}"
                + ("; snapshot data flipped" if self.damage.snapshot_at_kill() else ""))
        self.server.start()
        await self.wait_ready(self.a.ready_timeout)
        self.kills[-1][1] = now()
        self.restart_s.append(self.kills[-1][1] - self.kills[-1][0])
        log(f"[soak] restarted and ready after {self.restart_s[-1]:.1f} s")
        async with self.client() as http:
            await self.check_listing(http, "after the restart")
            st = await self.stats(http)
        snap = st.get("snapshot") or {}
        self.restored.append({k: snap.get(k) for k in ("restored_step", "restored_hbm", "restored_host",
                                                       "recomputed", "redone", "rebuilt", "lost_writes")})
        log(f"[soak] restore: {self.restored[-1]}")
        if snap.get("lost_writes"):
            self.fail("restart", f"the restart reports {snap['lost_writes']} lost acknowledged write(s)")
        await self.reference_pass("after restart")
        self.up.set()

    async def damage_loop(self) -> None:
        """Every ``--damage-every`` seconds one stored block damaged (``soak_damage.py``)."""
        while not self.done:
            await asyncio.sleep(self.a.damage_every)
            if not self.done and self.up.is_set():
                kind = self.damage.stored_block()
                log(f"[soak] damage: {kind or 'nothing stored to damage'} at {now() - self.t0:.0f} s")

    async def rss_loop(self) -> None:
        while not self.done:
            kb = self.server.rss_kb()
            if kb is not None and self.server.proc.poll() is None:
                self.rss.append((now() - self.t0, self.server.life, kb))
            await asyncio.sleep(self.a.rss_every)

    # -- the run ----------------------------------------------------------------------------
    async def setup(self) -> None:
        for t in TENANTS:
            for k in range(2):
                self.segs[(t, f"stable-{k}")] = Seg(f"stable-{k}", t, False, True)
            for c in CHURN_IDS:
                self.segs[(t, c)] = Seg(c, t, False, False)
        self.segs[(ADMIN, "pub-stable")] = Seg("pub-stable", ADMIN, True, True)
        self.segs[(ADMIN, "pub-churn")] = Seg("pub-churn", ADMIN, True, False)
        async with self.client() as http:
            for i, t in enumerate(TENANTS):
                await self.register(http, self.segs[(t, "stable-0")], i)
                await self.register(http, self.segs[(t, "stable-1")], 4 + i)
                await self.register(http, self.segs[(t, "churn-0")], (i + 1) % 8)
            await self.register(http, self.segs[(ADMIN, "pub-stable")], 3)
        for t in TENANTS:
            stable, _ = self.visible(t)
            if any(s.current() is None for s in stable):
                raise RuntimeError("the stable segments could not be registered")
        await self.reference_pass("setup")

    async def run(self) -> None:
        a = self.a
        self.server.start()
        await self.wait_ready(a.ready_timeout)
        log(f"[soak] server ready after {now() - self.t0:.1f} s")
        await self.setup()
        self.go.set()
        self.up.set()
        tasks = [asyncio.ensure_future(self.client_loop(i)) for i in range(a.clients)]
        tasks += [asyncio.ensure_future(self.churn_loop(t, [self.segs[(t, c)] for c in CHURN_IDS], k))
                  for k, t in enumerate(TENANTS)]
        tasks.append(asyncio.ensure_future(self.churn_loop(ADMIN, [self.segs[(ADMIN, "pub-churn")]], 99)))
        tasks.append(asyncio.ensure_future(self.rss_loop()))
        if self.damage is not None:
            tasks.append(asyncio.ensure_future(self.damage_loop()))
        try:
            log(f"[soak] warm-up {a.warmup:.0f} s")
            await asyncio.sleep(a.warmup)
            await self.quiet_point("warm-up")
            counts0 = Counter(self.completions)
            start = now()
            end = start + a.minutes * 60
            # kill -9 at kill_at (one kill), or at kills evenly spread points of the timed phase
            kill_times = ([start + a.kill_at * a.minutes * 60] if a.kills == 1 else
                          [start + (j + 1) * a.minutes * 60 / (a.kills + 1) for j in range(a.kills)]) \
                if a.kill_at > 0 and a.kills > 0 else []
            every = a.quiet_every or max(20.0, a.minutes * 60 / 8)
            next_quiet, n = start + every, 0
            while now() < end:
                if len(self.kills) < len(kill_times) and now() >= kill_times[len(self.kills)]:
                    await self.kill_and_restart()
                    next_quiet = min(end - 5, now() + min(every, max(5.0, (end - now()) / 2)))
                elif now() >= next_quiet and now() < end - 5:
                    n += 1
                    await self.quiet_point(f"{n}{' (restarted)' if self.server.life > 1 else ''}")
                    next_quiet = now() + every
                await asyncio.sleep(0.2)
            self.timed = (now() - start, sum(self.completions.values()) - sum(counts0.values()))
        finally:
            self.done = True
            self.go.set()
            self.up.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), a.request_timeout + 60)
        await self.quiet_point("end")
        await self.final_cleanup()

    async def final_cleanup(self) -> None:
        async with self.client() as http:
            for seg in self.segs.values():
                if seg.current() is not None or not seg.certain():
                    r = await http.delete(f"/v1/segments/{seg.sid}", headers=BEARER[seg.owner])
                    if r.status_code != 200 and not (r.status_code == 404 and not seg.certain()):
                        self.fail("segment", f"final delete {seg.owner}/{seg.sid}: {r.status_code} {r.text[:200]}")
            deadline = now() + 60
            while True:
                st = await self.stats(http)
                if (st["running"], st["waiting"]) == (0, 0) or now() > deadline:
                    break
                await asyncio.sleep(0.2)
        self.final = {k: st[k] for k in ("pages_used", "pages_free", "pages_total", "segments", "chain_nodes",
                                         "prefix_cached_pages", "running", "waiting")}
        log(f"[soak] after deleting every segment: {self.final}")
        if (st["pages_used"], st["segments"], st["chain_nodes"], st["running"], st["waiting"]) != (0, 0, 0, 0, 0):
            self.fail("pages", f"after deleting every segment and no request running: {self.final} "
                      "(want pages_used, segments, chain_nodes, running, waiting all 0)")
        self.stats_by_life[self.server.life] = st

    # -- figures and verdicts -------------------------------------------------------------------
    def rss_figures(self) -> list[list]:
        """Per server process: RSS growth over its steady window, from the first quiet point after which
        it compiled no new step bucket (compiled executables are memory that stays, not a leak) to its
        last sample; judged when that window is at least ``--rss-window`` seconds long."""
        rows = []
        for life in sorted({q[1] for q in self.rss_quiet}):
            quiet = [q for q in self.rss_quiet if q[1] == life]
            samples = [(t, kb) for t, lf, kb in self.rss if lf == life]
            t_base, _, kb0, _ = next(q for q in quiet if q[3] == quiet[-1][3])
            steady = [(t, kb) for t, kb in samples if t >= t_base]
            t_end, kb1 = steady[-1]
            growth, first = kb1 / kb0 - 1, samples[-1][1] / quiet[0][2] - 1
            row = [life, f"{quiet[0][0]:.0f}", f"{quiet[0][2] / 1024:.0f}", f"{first:+.1%}",
                   f"{t_base:.0f}-{t_end:.0f}", f"{kb0 / 1024:.0f}", f"{kb1 / 1024:.0f}", f"{growth:+.1%}"]
            if t_end - t_base < self.a.rss_window or len(steady) < 3:
                rows.append(row + ["-", "not judged: compiling until the last quiet point"])
                continue
            slope = statistics.linear_regression(*zip(*steady)).slope * 60 / 1024  # MiB per minute
            ok = growth < self.a.rss_growth
            if not ok:
                self.fail("memory", f"server life {life}: RSS {kb0 / 1024:.0f} -> {kb1 / 1024:.0f} MiB "
                          f"(+{growth:.0%}) from {t_base:.0f} s to {t_end:.0f} s with no compile; "
                          f"limit +{self.a.rss_growth:.0%}")
            rows.append(row + [f"{slope:+.1f}", "ok" if ok else "GROWS"])
        return rows

    def coverage(self) -> None:
        evictions = sum(st["tiers"]["hbm"]["evictions"] for st in self.stats_by_life.values())
        need = {"greedy answers compared with a reference": self.checks["compared"],
                "404 segment_not_found on churned segments": self.completions["404"],
                "streams closed mid-way": self.completions["200 (closed mid-stream)"],
                "HBM evictions": evictions}
        if self.kills:
            need["stable segments verified after the restart"] = self.checks["restart_verified"]
            if (self.stats_by_life.get(1, {}).get("snapshot") or {}).get("snapshots"):
                need["a snapshot restored after the kill"] = int(any(r.get("restored_step") is not None
                                                                     for r in self.restored))
        if self.damage is not None:
            need["damage injected"] = len(self.damage.events)
            need["damage found by the server (integrity errors or writes redone)"] = (
                sum(self.integrity().values()) + sum(r.get("redone") or 0 for r in self.restored))
        for what, n in need.items():
            if not n:
                self.fail("coverage", f"the run exercised no {what}")

    def integrity(self) -> dict[str, int]:
        """The servers' integrity errors by tier, summed over lives (each life's last stats)."""
        out: dict[str, int] = {}
        for st in self.stats_by_life.values():
            for tier, n in (st.get("tiers", {}).get("integrity_errors") or {}).items():
                out[tier] = out.get(tier, 0) + n
        return out

    def report(self, total_s: float) -> dict:
        a = self.a
        rss_rows = self.rss_figures()
        errors = self.server.error_lines()
        if self.damage is not None:  # damage found is logged as an integrity error: expected, counted
            found = [e for e in errors if "integrity error" in e and "lost" not in e]
            errors = [e for e in errors if e not in found]
            self.integrity_log_lines = len(found)
        if errors:
            self.fail("server log", f"{len(errors)} ERROR lines, first: {errors[0]}")
        self.coverage()
        fives = sum(n for k, n in self.completions.items() if k[:1] == "5" and k != RETRIED) + sum(
            n for k, n in self.seg_ops.items() if k.split()[1][:1] == "5" and not k.endswith(RETRIED))
        summary = {
            "passed": not self.failures, "minutes": round(self.timed[0] / 60, 2), "total_s": round(total_s),
            "requests": sum(self.completions.values()), "requests_timed": self.timed[1],
            "segment_ops": sum(self.seg_ops.values()), "completions_by_status": dict(self.completions),
            "segment_ops_by_status": dict(self.seg_ops), "5xx": fives,
            "backpressure_503": self.completions[RETRIED] + sum(n for k, n in self.seg_ops.items()
                                                                if k.endswith(RETRIED)),
            "conn_errors_kill_window": self.completions["connection error (kill window)"],
            "conn_errors_outside": self.completions["connection error"], "mismatches": self.checks["mismatch"],
            "checks": dict(self.checks), "kills": len(self.kills),
            "restart_s": [round(x, 1) for x in self.restart_s],
            "health_503_after_restart": self.health_503, "restored": self.restored,
            "damage": self.damage.counts() if self.damage is not None else {},
            "integrity_errors": self.integrity(),
            "put_route": "supported" if self.put_supported else f"fallback delete+register ({self.put_symptom})",
            "rss": rss_rows, "leak": self.fail_counts["pages"] > 0, "final": self.final,
            "failures": {k: {"count": self.fail_counts[k], "examples": v} for k, v in self.failures.items()},
            "server_errors": errors[:20],
        }
        MD.clear()
        MD.extend([
            "# Soak test", "", f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- command: `python {shlex.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}`",
            f"- server: `inferscale serve --dtype {a.dtype} --page-size {a.page_size} --hbm-pages {a.hbm_pages} "
            f"--snapshot-interval {a.snapshot_interval}"
            + (f" --host-pages {a.host_pages}" if a.host_pages else "") + f"`, {a.clients} clients, seed {a.seed}, "
            f"max_tokens {a.max_tokens}",
            f"- verdict: **{'PASSED' if not self.failures else 'FAILED'}**", ""])
        table("Summary", ["figure", "value"], [
            ["minutes (timed phase, after warm-up)", summary["minutes"]], ["wall time of the run, s", round(total_s)],
            ["completions (all phases)", summary["requests"]], ["completions in the timed phase", self.timed[1]],
            ["segment register/update/delete calls", summary["segment_ops"]], ["5xx responses", fives],
            ["connection errors while down after kill -9", summary["conn_errors_kill_window"]],
            ["connection errors otherwise", summary["conn_errors_outside"]],
            ["503 backpressure answers (Retry-After; allowed: segment calls retried)", summary["backpressure_503"]],
            ["/health 503 answers while restarting", self.health_503],
            ["kill -9 (each with the registry's log damaged when damage is on)", summary["kills"]],
            ["restart: kill -9 to ready, s", summary["restart_s"]], ["restores", summary["restored"]],
            ["damage injected (--damage-every)", summary["damage"] or "none"],
            ["integrity errors the servers found, by tier", summary["integrity_errors"]],
            ["greedy answers compared / recorded / unverifiable (racing an update)",
             f"{self.checks['compared']} / {self.checks['recorded']} / {self.checks['unverified']}"],
            ["greedy mismatches", self.checks["mismatch"]],
            ["stable segments verified after the restart", self.checks["restart_verified"]],
            ["PUT /v1/segments/{id}", summary["put_route"]],
            ["after deleting every segment", summary["final"]]])
        table("Completions by outcome", ["outcome", "count"], sorted(self.completions.items()))
        table("Segment calls by status", ["call", "count"], sorted(self.seg_ops.items()))
        table("Quiet points (no request in flight)", ["point", "t s", "pages_used", "HBM segment pages",
                                                      "chain nodes", "prefix cached", "segments", "evictions",
                                                      "snapshots", "compiles", "RSS MiB", "pages"], self.quiet_rows)
        table(f"Server RSS (limit +{a.rss_growth:.0%} per process once it compiles nothing new)",
              ["life", "first quiet point s", "MiB there", "growth to its end", "steady window s", "start MiB",
               "end MiB", "growth", "slope MiB/min", "verdict"], rss_rows)
        if self.failures:
            MD.extend(["## Failures", ""])
            for kind, msgs in self.failures.items():
                MD.append(f"- **{kind}** ({self.fail_counts[kind]}):")
                MD.extend(f"  - `{m}`" for m in msgs)
            MD.append("")
        if errors:
            MD.extend(["## Server log ERROR lines (first 20)", "", "```", *errors[:20], "```", ""])
        return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="timed phase, after the warm-up (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the clients' and churners' random choices")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--warmup", type=float, default=25.0, help="seconds of workload before the timed phase")
    p.add_argument("--kill-at", type=float, default=0.5, help="kill -9 at this fraction of the timed phase (0: never)")
    p.add_argument("--kills", type=int, default=1, help="kill -9 this many times, evenly spread (1: at --kill-at)")
    p.add_argument("--damage-every", type=float, default=0.0, help="seconds between damaged stored blocks (disk-tier "
                   "file or snapshot data; and the registry's log at each kill); 0: none (bench/serving/soak_damage.py)")
    p.add_argument("--host-pages", type=int, default=None, help="host-tier pages (small: segments reach the disk tier)")
    p.add_argument("--quiet-every", type=float, default=0.0, help="seconds between quiet points (0: minutes*60/8, "
                   "at least 20)")
    p.add_argument("--rss-every", type=float, default=5.0)
    p.add_argument("--rss-growth", type=float, default=0.20, help="largest RSS growth per server process")
    p.add_argument("--rss-window", type=float, default=30.0, help="shortest steady window judged, seconds")
    p.add_argument("--hbm-pages", type=int, default=64, help="small: segments are demoted and promoted")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--snapshot-interval", type=float, default=5.0)
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--workdir", help="key file, snapshots, server logs (default: a new temporary folder)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="where soak.md and soak.json go")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="inferscale-soak-")
    os.makedirs(workdir, exist_ok=True)
    server = Server(args, workdir, KEYS)
    soak = Soak(args, server)
    t0 = now()
    try:
        asyncio.run(soak.run())
    except Exception as e:  # noqa: BLE001 - the run broke off: report what was seen
        soak.fail("run", f"{type(e).__name__}: {e}")
    finally:
        server.stop()
    summary = soak.report(now() - t0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    write_md(args.out, "soak.md", MD)
    log(f"\n[soak] {'PASSED' if summary['passed'] else 'FAILED'}: {summary['requests']} completions, "
        f"{summary['minutes']} min timed, 5xx {summary['5xx']}, mismatches {summary['mismatches']}, "
        f"conn errors in the kill window {summary['conn_errors_kill_window']}; workdir {workdir}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
