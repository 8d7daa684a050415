"""Prometheus metrics (docs/architecture.md names, prefix ``inferscale_``), one registry per app.

Each ``create_app`` owns a ``CollectorRegistry``, so several apps in one process (tests) never
collide on the global default registry.  Two sources feed it:

- **per request** (observed by the server as requests finish): ``requests_total{endpoint,status}``,
  the ``ttft_seconds`` / ``inter_token_seconds`` / ``e2e_seconds`` histograms, and the
  ``prompt_tokens_total`` / ``cached_tokens_total`` / ``generated_tokens_total`` counters
  (hit rate = cached / prompt).  TTFT and e2e are the engine's own measurements
  (``RequestMetrics``: submit -> first token sampled, submit -> finished); inter-token gaps are
  the times between a request's consecutive deltas as the server receives them.
- **engine state** (read at scrape time from ``engine.stats()``, fetched on the engine thread by
  the ``/metrics`` route): ``pages{tier,state}``, ``segments{tier}``, ``evictions_total{tier}``,
  ``integrity_errors_total{tier}``, ``preemptions_total`` and ``compiles_total{phase}``.  These mirror the engine's own cumulative counters, so they are
  exported through a custom collector rather than incremented here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Gauges and counters read from the last ``engine.stats()`` snapshot."""

    def __init__(self):
        self.stats: dict | None = None

    def describe(self):
        return []

    def collect(self):
        s = self.stats
        if not s:
            return
        tiers = s.get("tiers") or {}
        pages = GaugeMetricFamily("inferscale_pages", "KV pages by tier and state", labels=["tier", "state"])
        pages.add_metric(["hbm", "used"], s["pages_used"])
        pages.add_metric(["hbm", "free"], s["pages_free"])
        pages.add_metric(["hbm", "cached"], s.get("prefix_cached_pages", 0))
        for tier in ("host", "disk"):
            t = tiers.get(tier)
            if t:
                pages.add_metric([tier, "used"], t["pages_used"])
                if t.get("pages_total") is not None:
                    pages.add_metric([tier, "free"], max(0, t["pages_total"] - t["pages_used"]))
        yield pages
        tenants = GaugeMetricFamily("inferscale_tenant_requests", "engine requests per tenant: running (or on a "
                                    "chain-node job) and waiting (queued)", labels=["tenant", "state"])
        for tenant, counts in sorted((s.get("tenants") or {}).items()):
            for state, n in counts.items():
                tenants.add_metric([tenant, state], n)
        yield tenants
        segs = GaugeMetricFamily("inferscale_segments", "registered segments by where their KV is",
                                 labels=["tier"])
        evict = CounterMetricFamily("inferscale_evictions", "segment evictions out of each tier",
                                    labels=["tier"])
        for tier in ("hbm", "host", "disk", "recompute"):
            t = tiers.get(tier)
            if t is not None:
                segs.add_metric([tier], t.get("segments", 0))
                if "evictions" in t:
                    evict.add_metric([tier], t["evictions"])
        if not tiers:
            segs.add_metric(["hbm"], s.get("segments", 0))
        yield segs
        yield evict
        integrity = CounterMetricFamily("inferscale_integrity_errors", "stored KV found damaged or missing when "
                                        "read (never served: recomputed from its tokens)", labels=["tier"])
        for tier, n in (tiers.get("integrity_errors") or {}).items():
            integrity.add_metric([tier], n)
        yield integrity
        pre = CounterMetricFamily("inferscale_preemptions", "requests preempted for lack of KV pages")
        pre.add_metric([], s.get("preemptions", 0))
        yield pre
        comp = CounterMetricFamily("inferscale_compiles", "device-step compiles, by whether the engine was warm "
                                   "(after Engine.warmup every compile is a request that waited for one)",
                                   labels=["phase"])
        after = s.get("compiles_after_warmup", 0)
        comp.add_metric(["warmup"], s.get("compiles", 0) - after)
        comp.add_metric(["after_warmup"], after)
        yield comp
        if "kv_bytes_per_token" in s:
            bpt = GaugeMetricFamily("inferscale_kv_bytes_per_token",
                                    "KV bytes of one token, all layers, K and V (compressed KV: values + scales)",
                                    labels=["kv_dtype"])
            bpt.add_metric([str(s.get("kv_dtype"))], s["kv_bytes_per_token"])
            yield bpt
            res = GaugeMetricFamily("inferscale_tokens_resident", "tokens whose KV each tier holds", labels=["tier"])
            for tier, n in (s.get("tokens_resident") or {}).items():
                res.add_metric([tier], n)
            yield res
        mesh = s.get("mesh")
        if mesh:
            tp = GaugeMetricFamily("inferscale_tensor_parallel", "devices the model and KV pool are split over")
            tp.add_metric([], mesh["tensor_parallel"])
            yield tp
            mem = GaugeMetricFamily("inferscale_device_memory_bytes", "device memory in use and its limit, per device",
                                    labels=["device", "kind"])
            for d in mesh["devices"]:
                for kind in ("bytes_in_use", "bytes_limit"):
                    if d.get(kind) is not None:
                        mem.add_metric([d["device"], kind.replace("bytes_", "")], d[kind])
            yield mem


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("inferscale_requests", "HTTP requests by route and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("inferscale_ttft_seconds", "time to first token (engine: submit -> first token)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("inferscale_inter_token_seconds", "gap between a request's streamed tokens",
                                     buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("inferscale_e2e_seconds", "request latency (engine: submit -> finished)",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("inferscale_prompt_tokens", "prompt tokens (segments + prompt)", registry=r)
        self.cached_tokens = Counter("inferscale_cached_tokens", "prompt tokens whose KV was reused", registry=r)
        self.generated_tokens = Counter("inferscale_generated_tokens", "generated tokens", registry=r)
        self.tenant_rejected = Counter("inferscale_tenant_rejected", "requests refused for a full queue: 429 (the "
                                       "tenant over its share) or 503 (the whole queue)", ["tenant", "status"],
                                       registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)

    def observe_finished(self, metrics) -> None:
        """One finished request's ``RequestMetrics``."""
        if metrics.generated_tokens:
            self.ttft.observe(metrics.ttft_s)
        self.e2e.observe(metrics.e2e_s)
        self.prompt_tokens.inc(metrics.prompt_tokens)
        self.cached_tokens.inc(metrics.cached_tokens)
        self.generated_tokens.inc(metrics.generated_tokens)

    def render(self, stats: dict | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
