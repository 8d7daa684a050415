"""Request tracing: OpenTelemetry spans and one structured JSON log line per request.

Spans (through ``opentelemetry-api``; a no-op when it is not installed or no SDK is configured): a
root span ``inferscale.request`` from ``submit()`` to the finish, with children

- ``admission`` - the cache outcome of every named segment: the tier it was in (``hbm``, ``host``,
  ``disk``, ``recompute``), the bytes promoted back to HBM, whether the chain node the request needs
  was reused or is computed now; and the prompt / cached token counts;
- ``prefill`` - admission to the first token, one ``chunk`` event per prefill chunk (tokens, start);
- ``decode`` - the first token to the finish;

and the root's attributes at the end: finish reason, generated tokens, TTFT, end-to-end seconds.
``configure_from_env()`` (``inferscale serve`` calls it) installs an SDK tracer provider with the
standard OTLP exporter when ``opentelemetry-sdk`` and an OTLP exporter package are installed and
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set; every other ``OTEL_*`` variable
(service name, headers, sampler) is read by the SDK itself.  ``pip install 'inferscale-jax[tracing]'``.

The log line (logger ``inferscale.request``, INFO): ``{"request_id", "tenant", "segments": [{"id",
"uid", "tier"}], "promoted_bytes", "chain_node", "mode", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s", "queue_s", "e2e_s",
"finish_reason"}`` - the request id the HTTP response returns in its ``X-Request-Id`` header.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("inferscale.request")


def _tracer():
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer("inferscale")


def configure_from_env() -> bool:
    """An OTLP-exporting tracer provider from the ``OTEL_*`` environment, when the packages are
    installed and an endpoint is set; returns whether tracing now exports."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as err:
        logging.getLogger("inferscale.tracing").warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but tracing is off: %s (pip install 'inferscale-jax[tracing]')", err)
        return False
    name = os.environ.get("OTEL_SERVICE_NAME", "inferscale")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def _ns(t_perf: float, ref_perf: float, ref_ns: int) -> int:
    return ref_ns + int((t_perf - ref_perf) * 1e9)


class RequestTrace:
    """The spans of one request; the scheduler calls each method at its moment."""

    def __init__(self, request_id: str, tenant: str, mode: str, segments: list, prompt_tokens: int):
        self.request_id, self.tenant, self.mode = request_id, tenant, mode
        self.segments = [{"id": s.info.id, "uid": s.uid, "version": s.info.version, "tier": None} for s in segments]
        self.prompt_tokens = prompt_tokens
        self._t0, self._t0_ns = time.perf_counter(), time.time_ns()
        self._admitted = self._first = None
        self.promoted_bytes, self.node = 0, "not admitted"
        self._chunks: list[tuple[float, int, int]] = []
        self.tracer = _tracer()
        self.root = None
        if self.tracer is not None:
            self.root = self.tracer.start_span("inferscale.request", start_time=self._t0_ns, attributes={
                "inferscale.request_id": request_id, "inferscale.tenant": tenant, "inferscale.mode": mode,
                "inferscale.prompt_tokens": prompt_tokens,
                "inferscale.segments": [s["id"] for s in self.segments]})

    def _child(self, name: str, start: float, end: float, attributes: dict, events=()) -> None:
        if self.root is None:
            return
        from opentelemetry import trace
        ctx = trace.set_span_in_context(self.root)
        span = self.tracer.start_span(name, context=ctx, start_time=_ns(start, self._t0, self._t0_ns),
                                      attributes=attributes)
        for ev_name, at, attrs in events:
            span.add_event(ev_name, attrs, timestamp=_ns(at, self._t0, self._t0_ns))
        span.end(end_time=_ns(end, self._t0, self._t0_ns))

    def admitted(self, tiers: list[str], promoted_bytes: int, node: str, t_start: float) -> None:
        """Admission: each segment's tier before it, the bytes promoted, the chain node reused /
        computed (``node``), from ``t_start`` (when admission began) to now."""
        now = time.perf_counter()
        self._admitted = now
        for s, tier in zip(self.segments, tiers):
            s["tier"] = tier
        self.promoted_bytes, self.node = promoted_bytes, node
        attrs = {"inferscale.promoted_bytes": promoted_bytes, "inferscale.chain_node": node,
                 "inferscale.queue_s": t_start - self._t0}
        for i, s in enumerate(self.segments):
            attrs[f"inferscale.segment.{i}.id"] = s["id"]
            attrs[f"inferscale.segment.{i}.tier"] = tier_of(s)
        self._child("admission", t_start, now, attrs)

    def chunk(self, tokens: int, start: int) -> None:
        self._chunks.append((time.perf_counter(), tokens, start))

    def first_token(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()
            self._child("prefill", self._admitted or self._t0, self._first,
                        {"inferscale.chunks": len(self._chunks)},
                        [("chunk", at, {"tokens": n, "start": st}) for at, n, st in self._chunks])

    def finished(self, reason: str, metrics) -> None:
        now = time.perf_counter()
        if self._first is not None:
            self._child("decode", self._first, now, {"inferscale.generated_tokens": metrics.generated_tokens})
        if self.root is not None:
            self.root.set_attributes({
                "inferscale.finish_reason": reason, "inferscale.cached_tokens": metrics.cached_tokens,
                "inferscale.generated_tokens": metrics.generated_tokens, "inferscale.ttft_s": metrics.ttft_s,
                "inferscale.e2e_s": metrics.e2e_s})
            self.root.end(end_time=_ns(now, self._t0, self._t0_ns))
        if log.isEnabledFor(logging.INFO):
            log.info(json.dumps({
                "request_id": self.request_id, "tenant": self.tenant, "mode": self.mode,
                "segments": [dict(s, tier=tier_of(s)) for s in self.segments],
                "promoted_bytes": self.promoted_bytes, "chain_node": self.node,
                "prompt_tokens": metrics.prompt_tokens, "cached_tokens": metrics.cached_tokens,
                "generated_tokens": metrics.generated_tokens, "ttft_s": round(metrics.ttft_s, 6),
                "queue_s": round(metrics.queue_s, 6),
                "e2e_s": round(metrics.e2e_s, 6), "finish_reason": reason}))


def tier_of(seg: dict) -> str:
    return seg["tier"] or "not admitted"
