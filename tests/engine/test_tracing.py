"""Request tracing (inferscale_jax/tracing.py) with OpenTelemetry's in-memory span exporter: the
spans and attributes of a request whose segment hits HBM and reuses its chain node, one whose chain
node is computed (a miss), and one whose segment is promoted from the host tier; and the one JSON log
line per request."""

import json
import logging

import pytest

trace_sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is a test dependency")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from inferscale_jax import SamplingParams  # noqa: E402
from tests.support.tiny_engine import make_engine  # noqa: E402

EXPORTER = InMemorySpanExporter()
SP = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
A, B = list(range(3, 40)), list(range(50, 75))


def spans_of(request_id):
    spans = EXPORTER.get_finished_spans()
    root = next(s for s in spans if s.name == "inferscale.request" and s.attributes["inferscale.request_id"] == request_id)
    kids = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
    return root, kids


def test_spans_for_a_hit_a_miss_and_a_promotion(caplog):
    # installed here, not at import: the API keeps the first provider for the whole process, and the
    # other test modules' requests should not fill the in-memory exporter
    provider = trace_sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another tracer provider was installed first in this process")
    e = make_engine()
    e.register_segment("a", token_ids=A)
    e.register_segment("b", token_ids=B)
    EXPORTER.clear()
    with caplog.at_level(logging.INFO, logger="inferscale.request"):
        miss = e.generate(prompt_token_ids=[5, 6], segments=["a", "b"], sampling=SP)  # node [a, b] computed
        hit = e.generate(prompt_token_ids=[7, 8], segments=["a", "b"], sampling=SP)  # reused
        e.tiers.demote(e.store.resolve("a", "default"), "host")
        promo = e.generate(prompt_token_ids=[9], segments=["a"], sampling=SP)  # promoted from the host tier

    root, kids = spans_of(miss.request_id)
    assert set(kids) == {"admission", "prefill", "decode"}
    adm = kids["admission"].attributes
    assert adm["inferscale.chain_node"] == "computed" and adm["inferscale.promoted_bytes"] == 0
    assert (adm["inferscale.segment.0.id"], adm["inferscale.segment.0.tier"]) == ("a", "hbm")
    assert root.attributes["inferscale.finish_reason"] == "length"
    assert root.attributes["inferscale.generated_tokens"] == 3
    assert kids["prefill"].attributes["inferscale.chunks"] >= 1
    assert [ev.name for ev in kids["prefill"].events][:1] == ["chunk"]

    root, kids = spans_of(hit.request_id)
    assert kids["admission"].attributes["inferscale.chain_node"] == "reused"
    assert root.attributes["inferscale.cached_tokens"] == hit.metrics.cached_tokens == len(A + B)

    root, kids = spans_of(promo.request_id)
    adm = kids["admission"].attributes
    assert adm["inferscale.segment.0.tier"] == "host"
    assert adm["inferscale.promoted_bytes"] > 0

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "inferscale.request"]
    assert [x["request_id"] for x in lines] == [miss.request_id, hit.request_id, promo.request_id]
    assert lines[2]["segments"] == [{"id": "a", "uid": lines[2]["segments"][0]["uid"], "version": 1, "tier": "host"}]
    assert lines[1]["cached_tokens"] == len(A + B) and lines[1]["finish_reason"] == "length"
    assert [x["chain_node"] for x in lines] == ["computed", "reused", "reused"]
    assert lines[2]["promoted_bytes"] == adm["inferscale.promoted_bytes"] > 0 and lines[0]["promoted_bytes"] == 0
    assert all(x["ttft_s"] > 0 and x["e2e_s"] >= x["ttft_s"] for x in lines)
    # the queue's share of TTFT: the miss waited while a node job computed its chain node; the hit ran at once
    assert all(0 < x["queue_s"] < x["ttft_s"] for x in lines)
    assert lines[0]["queue_s"] > lines[1]["queue_s"]
    assert [x["queue_s"] for x in lines] == [round(o.metrics.queue_s, 6) for o in (miss, hit, promo)]
