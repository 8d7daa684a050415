"""The real server (``inferscale serve`` under uvicorn, in a subprocess, loopback only) driven over
HTTP: completions, chat, SSE streaming, segments CRUD, cached tokens, equality with the in-process
``Engine``, tenancy and auth, disconnect -> abort, metrics, request logs, and a 64-client
streaming load test with a shared segment (no page leak; TTFT p50/p99 printed)."""

import asyncio
import json
import statistics
import time

import httpx
import pytest

from inferscale_jax import Engine, EngineConfig, SamplingParams, default_model_dir
from tests.support.server_util import ENGINE_KW, Server, cache_dir, sse_events, stream_text, wait_for

KEYS = {"key-acme-0123456789": {"tenant": "acme", "admin": True}, "key-beta-9876543210": "beta",
        "key-acme-user-5555555": "acme"}
A = {"Authorization": "Bearer key-acme-0123456789"}
B = {"Authorization": "Bearer key-beta-9876543210"}
A_USER = {"Authorization": "Bearer key-acme-user-5555555"}  # acme's tenant, without admin rights
FAQ = ("Acme warranty policy. Every Acme product carries a two year warranty from the date of "
       "purchase. Returns are accepted within thirty days with the original receipt. Repairs under "
       "warranty are free; shipping is paid by the customer. Contact support by email for help.")
SECRET_PROMPT = "zebra-quartz-7781 what is the warranty period"
PROMPTS = [f"Question {i}: how long is the warranty on item {i * 7}?" for i in range(8)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache):
    tmp = tmp_path_factory.mktemp("server")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    srv = Server(tmp, cache, "--api-keys", str(keys), "--model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(cache, server):
    """The in-process engine with the server's model and config (loaded while the server boots)."""
    engine = Engine.from_pretrained(default_model_dir(cache), EngineConfig(**ENGINE_KW))
    engine.register_segment("faq", text=FAQ)
    server.wait_ready()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def http(server, ref):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/segments", json={"id": "faq", "text": FAQ}, headers=A)
        assert r.status_code == 201, r.text
        yield client


def greedy(ref, prompt=None, max_tokens=12, **kw):
    return ref.generate(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), **kw)


def test_health_models_metrics(http):
    assert http.get("/health").json()["status"] == "ok"
    models = http.get("/v1/models", headers=A).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    http.post("/v1/completions", json={"model": "tiny", "prompt": "warm up", "max_tokens": 2}, headers=A)
    text = http.get("/metrics").text
    for name in ("inferscale_requests_total", "inferscale_ttft_seconds_bucket", "inferscale_inter_token_seconds",
                 "inferscale_e2e_seconds_count", "inferscale_prompt_tokens_total", "inferscale_cached_tokens_total",
                 "inferscale_generated_tokens_total", 'inferscale_pages{state="free",tier="hbm"}',
                 "inferscale_evictions_total", "inferscale_segments{", "inferscale_preemptions_total"):
        assert name in text, name
    assert "inferscale_tensor_parallel 1.0" in text  # one device (tensor parallelism: docs/architecture.md)
    assert 'inferscale_kv_bytes_per_token{kv_dtype="float32"}' in text and 'inferscale_tokens_resident{tier="hbm"}' in text


def test_completion_equals_engine(http, ref):
    want = greedy(ref, PROMPTS[0])
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12,
                                           "temperature": 0}, headers=A)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == want.text
    assert r.headers["x-request-id"] == body["id"]  # the id the engine's JSON log line names (tracing.py)
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    usage = body["usage"]
    assert usage["prompt_tokens"] == want.metrics.prompt_tokens
    assert usage["completion_tokens"] == len(want.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]
    # token-id prompts, and logprobs (non-streaming)
    ids = ref.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 2},
                  headers=A).json()
    assert r["choices"][0]["text"] == want.text
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(want.token_ids) and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])


def render(ref, messages):
    return ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_equals_engine(http, ref):
    """Named segments go inside the system message, after its text: the request is the template
    rendered with the segment's text there (serving/chat.py)."""
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Warranty?"}]
    inline = [{"role": "system", "content": "You answer briefly.\n\n" + FAQ}, messages[1]]
    want = greedy(ref, render(ref, inline), max_tokens=10)
    cached = []
    for _ in range(2):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 10,
                                                    "temperature": 0, "segments": ["faq"]}, headers=A)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}
        assert body["usage"]["prompt_tokens"] == want.metrics.prompt_tokens
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    header = len(ref.tokenizer.encode("<|system|>You answer briefly.\n\n", add_special_tokens=False))
    faq_tokens = len(ref.tokenizer.encode(FAQ, add_special_tokens=False))
    assert cached[1] >= header + faq_tokens  # [template prefix + segment]: a chain node, reused


def test_chat_segment_placed_as_a_content_part(http, ref):
    parts = [{"type": "text", "text": "Policy:"}, {"type": "segment", "id": "faq"},
             {"type": "text", "text": "How long is the warranty?"}]
    messages = [{"role": "user", "content": parts}]
    want = greedy(ref, render(ref, [{"role": "user", "content": "Policy:\n" + FAQ + "\nHow long is the warranty?"}]),
                  max_tokens=8)
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0},
                  headers=A).json()
    assert r["choices"][0]["message"]["content"] == want.text
    assert r["usage"]["prompt_tokens"] == want.metrics.prompt_tokens
    # another tenant naming "faq" has none (404), and with its own "faq" it never hits acme's KV
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, headers=B)
    assert r.status_code == 404 and r.json()["error"]["code"] == "segment_not_found"
    assert http.post("/v1/segments", json={"id": "faq", "text": FAQ}, headers=B).status_code == 201
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0},
                  headers=B).json()
    assert r["choices"][0]["message"]["content"] == want.text
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert http.delete("/v1/segments/faq", headers=B).status_code == 200
    bad = [{"role": "user", "content": [{"type": "segment", "id": "bad id"}]}]
    r = http.post("/v1/chat/completions", json={"messages": bad}, headers=A)
    assert r.status_code == 400 and "segment id" in r.json()["error"]["message"]


def test_chat_session_keeps_every_turn(http, ref):
    messages = [{"role": "system", "content": "You are terse."}]
    seen = 0
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question number {turn}: what is covered?"})
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                    "session": "conv-1", "segments": ["faq"]}, headers=A)
        assert r.status_code == 200, r.text
        body = r.json()
        reply = body["choices"][0]["message"]["content"]
        inline = [{"role": "system", "content": "You are terse.\n\n" + FAQ}, *messages[1:]]
        want = greedy(ref, render(ref, inline), max_tokens=6)
        assert reply == want.text and body["usage"]["prompt_tokens"] == want.metrics.prompt_tokens
        if turn:  # every earlier turn (and the placed segment) came from the session
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == seen
        messages.append({"role": "assistant", "content": reply})
        info = http.get("/v1/sessions/conv-1", headers=A).json()
        assert info["turns"] == turn + 1 and info["num_tokens"] > seen
        seen = info["num_tokens"]
    assert [s["id"] for s in http.get("/v1/sessions", headers=A).json()["data"]] == ["conv-1"]
    assert http.get("/v1/sessions", headers=B).json()["data"] == []
    assert http.get("/v1/sessions/conv-1", headers=B).status_code == 404
    assert http.delete("/v1/sessions/conv-1", headers=B).status_code == 404
    assert http.delete("/v1/sessions/conv-1", headers=A).json()["deleted"] is True
    assert http.get("/v1/sessions/conv-1", headers=A).status_code == 404
    assert "conv-1" not in str(http.get("/v1/segments", headers=A).json())


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_sse(http, ref, route):
    chat = route.endswith("chat/completions")
    messages = [{"role": "user", "content": PROMPTS[1]}]
    if chat:  # the named segment goes into a system message of its own (there is none)
        want = greedy(ref, render(ref, [{"role": "system", "content": FAQ}, *messages]), max_tokens=16)
    else:
        want = greedy(ref, PROMPTS[1], max_tokens=16, segments=["faq"])
    body = {"max_tokens": 16, "temperature": 0, "segments": ["faq"], "stream": True,
            "stream_options": {"include_usage": True}, **({"messages": messages} if chat else {"prompt": PROMPTS[1]})}
    if chat:  # the first chat with this system prefix computes the [prefix + faq] chain node
        assert http.post(route, json=dict(body, stream=False, max_tokens=1), headers=A).status_code == 200
    arrivals = []
    with http.stream("POST", route, json=body, headers=A) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert stream_text(events) == want.text
    content = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                       c["choices"][0].get("delta", {}).get("content"))]
    assert len(content) >= 4, "tokens must arrive as separate, incremental chunks"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == want.finish_reason
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(want.token_ids)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_segments_crud_and_cached_tokens(http, ref):
    text = FAQ + " Extended coverage can be bought for three more years."
    r = http.post("/v1/segments", json={"id": "crud/seg-1", "text": text, "pin": True}, headers=A)
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["id"] == "crud/seg-1" and info["num_tokens"] > 0 and info["pin"] is True
    assert http.post("/v1/segments", json={"id": "crud/seg-1", "text": "x"}, headers=A).status_code == 409
    ids = [s["id"] for s in http.get("/v1/segments", headers=A).json()["data"]]
    assert "crud/seg-1" in ids and "faq" in ids
    got = http.get("/v1/segments/crud/seg-1", headers=A).json()
    assert got["num_tokens"] == info["num_tokens"] and got["tier"] == "hbm"
    ref.register_segment("crud/seg-1", text=text)
    want = greedy(ref, "Can I extend it?", segments=["crud/seg-1"])
    cached = []
    for _ in range(2):
        r = http.post("/v1/completions", json={"prompt": "Can I extend it?", "segments": ["crud/seg-1"],
                                               "max_tokens": 12, "temperature": 0}, headers=A).json()
        assert r["choices"][0]["text"] == want.text
        assert r["usage"]["prompt_tokens"] == want.metrics.prompt_tokens
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[1] > 0 and cached[1] >= info["num_tokens"]
    r = http.delete("/v1/segments/crud/seg-1", headers=A)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert http.get("/v1/segments/crud/seg-1", headers=A).status_code == 404
    r = http.post("/v1/completions", json={"prompt": "x", "segments": ["crud/seg-1"]}, headers=A)
    assert r.status_code == 404 and r.json()["error"]["code"] == "segment_not_found"


def test_segment_update_and_append(http, ref):
    sid, t1 = "ver/doc", "Store hours: nine to five on weekdays."
    assert http.post("/v1/segments", json={"id": sid, "text": t1}, headers=A).json()["version"] == 1
    t2 = "Store hours: eight to eight every day, holidays included."
    r = http.put(f"/v1/segments/{sid}", json={"text": t2}, headers=A)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["updated"] is not None
    ref.register_segment(sid, text=t2)
    t3 = " Closed on the first of January."
    r = http.post(f"/v1/segments/{sid}/append", json={"text": t3}, headers=A)
    assert r.status_code == 200 and r.json()["version"] == 3, r.text
    info = ref.append_segment(sid, text=t3)
    assert r.json()["num_tokens"] == info.num_tokens
    want = greedy(ref, "When are you open?", segments=[sid])
    r = http.post("/v1/completions", json={"prompt": "When are you open?", "segments": [sid], "max_tokens": 12,
                                           "temperature": 0}, headers=A).json()
    assert r["choices"][0]["text"] == want.text and r["usage"]["prompt_tokens"] == want.metrics.prompt_tokens
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= info.num_tokens
    assert http.get(f"/v1/segments/{sid}", headers=A).json()["version"] == 3
    # another tenant's id is a missing one; bad bodies are a 400 naming the rule
    assert http.put(f"/v1/segments/{sid}", json={"text": "x"}, headers=B).status_code == 404
    assert http.post(f"/v1/segments/{sid}/append", json={"text": "x"}, headers=B).status_code == 404
    assert http.put("/v1/segments/no-such", json={"text": "x"}, headers=A).status_code == 404
    r = http.put(f"/v1/segments/{sid}", json={"text": "x", "token_ids": [1]}, headers=A)
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = http.post(f"/v1/segments/{sid}/append", json={"token_ids": [10**9]}, headers=A)
    assert r.status_code == 400 and "vocab" in r.json()["error"]["message"]
    # a public segment changes only with an admin key
    assert http.post("/v1/segments", json={"id": "pub-ver", "text": t1, "public": True}, headers=A).status_code == 201
    r = http.put("/v1/segments/pub-ver", json={"text": t2}, headers=A_USER)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    assert http.put("/v1/segments/pub-ver", json={"text": t2}, headers=A).json()["version"] == 2
    assert http.delete("/v1/segments/pub-ver", headers=A).status_code == 200
    assert http.delete(f"/v1/segments/{sid}", headers=A).status_code == 200
    ref.delete_segment(sid)


def test_tenancy_and_auth(http):
    sid = "tenancy-private"

    def probes(headers):
        return [(r.status_code, r.json()) for r in (
            http.get(f"/v1/segments/{sid}", headers=headers),
            http.delete(f"/v1/segments/{sid}", headers=headers),
            http.post("/v1/completions", json={"prompt": "hi", "segments": [sid], "max_tokens": 2}, headers=headers))]

    missing = probes(B)  # before anyone registered it
    assert all(status == 404 for status, _ in missing)
    assert http.post("/v1/segments", json={"id": sid, "text": "acme internal notes"}, headers=A).status_code == 201
    assert probes(B) == missing  # another tenant's segment: byte-for-byte the same answer as a missing one
    assert http.get(f"/v1/segments/{sid}", headers=A).status_code == 200
    assert sid not in [s["id"] for s in http.get("/v1/segments", headers=B).json()["data"]]
    # public segments: admin only to register, readable by every tenant
    r = http.post("/v1/segments", json={"id": "pub-b", "text": "x y z", "public": True}, headers=B)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    assert http.post("/v1/segments", json={"id": "pub-faq", "text": FAQ, "public": True}, headers=A).status_code == 201
    r = http.post("/v1/completions", json={"prompt": "hello", "segments": ["pub-faq"], "max_tokens": 2}, headers=B)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # deleting a public segment needs an admin key too, even one of the tenant that registered it
    for headers in (A_USER, B):
        r = http.delete("/v1/segments/pub-faq", headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", r.text
        assert "pub-faq" in r.json()["error"]["message"] and "admin" in r.json()["error"]["message"]
    assert http.get("/v1/segments/pub-faq", headers=B).status_code == 200  # still there
    # a non-admin still deletes its tenant's private segment of that id, which the delete hits first
    assert http.post("/v1/segments", json={"id": "pub-faq", "text": "acme's own"}, headers=A_USER).status_code == 201
    assert http.delete("/v1/segments/pub-faq", headers=A_USER).status_code == 200
    assert http.get("/v1/segments/pub-faq", headers=A_USER).json()["public"] is True
    assert http.delete("/v1/segments/pub-faq", headers=A).status_code == 200
    assert http.get("/v1/segments/pub-faq", headers=B).status_code == 404
    # no key, bad key, malformed header -> 401 with an OpenAI error body
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-acme-0123456789"},
                    {"Authorization": "Basic a2V5"}, {"Authorization": "Bearer key-acme-012345678"}):
        r = http.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401, headers
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.headers["www-authenticate"] == "Bearer"
    assert http.get("/v1/segments").status_code == 401
    assert http.get("/v1/stats", headers=B).status_code == 403  # engine-wide stats: admin only
    # the prefix cache is per tenant: A's cached prompt is not B's
    long_prompt = " ".join(f"word{i}" for i in range(120))
    body = {"prompt": long_prompt, "max_tokens": 2, "temperature": 0}
    usage = lambda h: http.post("/v1/completions", json=body, headers=h).json()["usage"]  # noqa: E731
    first_a = usage(A)
    assert first_a["prompt_tokens"] > 64
    assert usage(B)["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage(A)["prompt_tokens_details"]["cached_tokens"] > 0  # the check above can fail


def test_openai_client(server, http, ref):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-acme-0123456789", max_retries=0)
    want = greedy(ref, PROMPTS[2], segments=["faq"])
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                    extra_body={"segments": ["faq"]})
    assert out.choices[0].text == want.text and out.usage.prompt_tokens_details.cached_tokens > 0
    messages = [{"role": "user", "content": PROMPTS[3]}]
    want = greedy(ref, ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="x", extra_body={"segments": ["no-such-segment"]})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # invalid fields are 400 as in OpenAI and vLLM, so clients catch them as BadRequestError
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, n=17)
    assert e.value.body["param"] == "n" and e.value.body["code"] == "invalid_field"
    with pytest.raises(openai.BadRequestError) as e:  # a schema that does not compile: 400 before it is queued
        client.chat.completions.create(model="tiny", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "strin"}}}}})
    assert e.value.body["param"] == "response_format" and "strin" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.post("/segments", body={"id": "bad id", "text": "x"}, cast_to=object)
    # n samples through the client: indices 0..n-1
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=4, n=2, seed=3)
    assert [c.index for c in out.choices] == [0, 1]


def _leave_mid_stream(http, body: dict, events: int) -> None:
    """Read ``events`` SSE events of a streamed completion, then close the connection."""
    with http.stream("POST", "/v1/completions", json=body, headers=A) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= events:
                break  # leaving the block closes the connection mid-stream


@pytest.mark.alone  # (a time bound: conftest.py)
def test_disconnect_aborts_and_frees_pages(http):
    base = http.get("/v1/stats", headers=A).json()
    body = {"prompt": "tell me everything", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    _leave_mid_stream(http, body, 3)
    stats = wait_for(lambda: (s := http.get("/v1/stats", headers=A).json())["running"] == 0 and s)
    assert stats["pages_free"] == base["pages_free"]
    assert stats["generated_tokens"] - base["generated_tokens"] < 400  # it was aborted, not finished


@pytest.mark.alone  # (a time bound: conftest.py)
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_an_n_2_request_aborts_both_samples(server, http, stream):
    """The client leaves while two samples generate (streamed: after a few chunks; not streamed: a
    read timeout): both samples are aborted and their pages freed."""
    base = http.get("/v1/stats", headers=A).json()
    body = {"prompt": "tell me everything twice", "max_tokens": 400, "ignore_eos": True, "n": 2, "seed": 1,
            "stream": stream}
    if stream:
        _leave_mid_stream(http, body, 4)
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, headers=A, timeout=httpx.Timeout(10, read=0.3))
    stats = wait_for(lambda: (s := http.get("/v1/stats", headers=A).json())["running"] == 0
                     and s["waiting"] == 0 and s)
    assert stats["pages_free"] == base["pages_free"]
    assert stats["generated_tokens"] - base["generated_tokens"] < 800  # aborted, not finished


async def _one_client(client, i, prompt, results):
    body = {"prompt": prompt, "segments": ["faq"], "max_tokens": 12, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, lines = None, []
    async with client.stream("POST", "/v1/completions", json=body, headers=A) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: "):
                ttft = time.perf_counter() - t0
            lines.append(line)
    results[i] = (ttft, stream_text(sse_events(lines)), sse_events(lines)[-1])


def _load_round(url, n):
    async def main():
        results = [None] * n
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*(_one_client(client, i, PROMPTS[i % len(PROMPTS)], results)
                                                    for i in range(n))), timeout=150)
        return results
    return asyncio.run(main())


def test_load_64_streaming_clients(server, http, ref):
    """64 concurrent streaming clients share a segment.  Rounds repeat (at most 4) until one runs
    without compiling a new step bucket, so the TTFT printed is a warm figure; every round is
    checked: all complete, outputs equal the greedy reference, no page leak."""
    want = [o.text for o in ref.generate_batch(
        [dict(prompt=p, segments=["faq"], sampling=SamplingParams(max_tokens=12, temperature=0.0)) for p in PROMPTS])]
    for round_ in range(1, 5):
        base = http.get("/v1/stats", headers=A).json()
        t0 = time.perf_counter()
        results = _load_round(server.url, 64)
        wall = time.perf_counter() - t0
        for i, (ttft, text, last) in enumerate(results):
            assert last == "[DONE]" and ttft is not None
            assert text == want[i % len(PROMPTS)], f"round {round_}, client {i}"
        stats = wait_for(lambda: (s := http.get("/v1/stats", headers=A).json())["running"] == 0 and s)
        assert stats["waiting"] == 0
        assert stats["pages_free"] == base["pages_free"], "KV pages leaked"
        assert stats["pages_used"] == base["pages_used"]  # only the segments' own pages stay referenced
        if stats["compiles"] == base["compiles"]:
            break
    ttfts = sorted(t for t, _, _ in results)
    p50 = statistics.median(ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    warm = "warm" if stats["compiles"] == base["compiles"] else "still compiling"
    print(f"\n[load] round {round_} ({warm}): 64 streaming clients, shared segment, 12 tokens each, "
          f"CPU: TTFT p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {ttfts[-1] * 1000:.0f} ms, "
          f"wall {wall:.2f} s")


def test_request_logs_hold_no_secrets(server, http):
    assert http.get("/v1/models", headers={"Authorization": "Bearer key-acme-0123456789x"}).status_code == 401
    rid = http.post("/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": 2}, headers=A).json()["id"]
    # the line is written once the response is sent: wait for this request's own line
    (line,) = wait_for(lambda: [ln for ln in server.request_lines() if ln.get("id") == rid], 10)
    for field in ("id", "tenant", "segments", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s",
                  "queue_s", "status"):
        assert field in line, field
    assert line["tenant"] == "acme" and line["status"] == 200
    assert any(ln["status"] == 401 for ln in server.request_lines())
    log = server.log()
    assert "zebra-quartz-7781" not in log
    for key in KEYS:
        assert key not in log
    assert server.alive()


def test_segment_ids_with_slash_and_colon(http):
    sid = "team/faq:v1.2"
    r = http.post("/v1/segments", json={"id": sid, "text": FAQ}, headers=A)
    assert r.status_code == 201 and r.json()["id"] == sid
    got = http.get(f"/v1/segments/{sid}", headers=A)
    assert got.status_code == 200 and got.json()["id"] == sid
    r = http.post("/v1/completions", json={"prompt": "hi", "segments": [sid], "max_tokens": 2}, headers=A)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert http.delete(f"/v1/segments/{sid}", headers=A).status_code == 200
    assert http.get(f"/v1/segments/{sid}", headers=A).status_code == 404
    # ids the routes could not carry are refused at registration, naming the field and the alphabet
    for bad in ("team faq", "faq\nv2", "faq?v=1", "a#b", "x" * 257):
        r = http.post("/v1/segments", json={"id": bad, "text": FAQ}, headers=A)
        assert r.status_code == 400 and r.json()["error"]["param"] == "id", bad
        assert "A-Z a-z 0-9 . _ - : /" in r.json()["error"]["message"]


def _metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def test_n_samples(http, ref):
    """n samples: indices 0..n-1, the prompt counted once, seed + i per sample (each equals the
    single request with that seed), and samples 1..n-1 reuse the prompt's full pages."""
    prompt = "Samples share pages: " + " ".join(f"tok{i}" for i in range(40))  # several full pages
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 11, "n": 3}
    cached_before = _metric(http, "inferscale_cached_tokens_total")
    r = http.post("/v1/completions", json=body, headers=A)
    assert r.status_code == 200, r.text
    out = r.json()
    cached_after = _metric(http, "inferscale_cached_tokens_total")
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    singles = [http.post("/v1/completions", json={**body, "n": 1, "seed": 11 + i}, headers=A).json()
               for i in range(3)]
    assert [c["text"] for c in out["choices"]] == [s["choices"][0]["text"] for s in singles]
    usage = out["usage"]
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]  # counted once
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    full_pages = (usage["prompt_tokens"] - 1) // 16 * 16
    assert full_pages >= 32
    assert cached_after - cached_before >= 2 * full_pages  # samples 1 and 2 hit sample 0's pages
    # chat, streaming: chunks interleave by index; each choice's text equals the non-streaming one
    messages = [{"role": "user", "content": PROMPTS[4]}]
    chat = {"messages": messages, "max_tokens": 8, "temperature": 0.9, "seed": 5, "n": 2}
    whole = http.post("/v1/chat/completions", json=chat, headers=A).json()
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True,
                                                           "stream_options": {"include_usage": True}},
                     headers=A) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    texts, finishes, roles = {0: "", 1: ""}, {}, set()
    for ev in events[:-1]:
        if not ev["choices"]:
            assert ev["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
            continue
        (ch,) = ev["choices"]
        texts[ch["index"]] += ch["delta"].get("content") or ""
        if ch["delta"].get("role"):
            roles.add(ch["index"])
        if ch["finish_reason"]:
            finishes[ch["index"]] = ch["finish_reason"]
    assert roles == {0, 1} and set(finishes) == {0, 1}
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]


def test_echo(http, ref):
    want = greedy(ref, PROMPTS[5], max_tokens=6)
    body = {"prompt": PROMPTS[5], "max_tokens": 6, "temperature": 0, "echo": True}
    r = http.post("/v1/completions", json=body, headers=A).json()
    assert r["choices"][0]["text"] == PROMPTS[5] + want.text
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=A) as resp:
        events = sse_events(list(resp.iter_lines()))
    assert events[0]["choices"][0]["text"] == PROMPTS[5]  # the prompt comes first
    assert stream_text(events) == PROMPTS[5] + want.text
    ids = ref.tokenizer.encode(PROMPTS[5], add_special_tokens=False)
    r = http.post("/v1/completions", json={**body, "prompt": ids}, headers=A).json()
    assert r["choices"][0]["text"] == ref.tokenizer.decode(ids, skip_special_tokens=True) + want.text


def test_penalties_reach_the_engine(http, ref):
    prompt = "one two one two one two one two"
    plain = greedy(ref, prompt)
    changed = 0
    for penalties in ({"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.8}):
        want = ref.generate(prompt=prompt, sampling=SamplingParams(max_tokens=12, temperature=0.0, **penalties))
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **penalties},
                      headers=A)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text, penalties
        changed += want.token_ids != plain.token_ids
    assert changed >= 1  # a penalty changed the greedy output: it was applied, not dropped


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_logprobs(http, route):
    """Each SSE chunk carries the log-probs of its own tokens, in OpenAI's shape; together they
    equal the non-streaming answer's."""
    chat = route.endswith("chat/completions")
    body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    if chat:
        body.update(messages=[{"role": "user", "content": PROMPTS[6]}], logprobs=True, top_logprobs=2)
    else:
        body.update(prompt=PROMPTS[6], logprobs=2)
    whole = http.post(route, json=body, headers=A).json()["choices"][0]["logprobs"]
    with http.stream("POST", route, json={**body, "stream": True}, headers=A) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    parts = [ev["choices"][0]["logprobs"] for ev in events[:-1] if ev["choices"] and ev["choices"][0]["logprobs"]]
    assert len(parts) >= 2, "log-probs come with the chunks, not in one piece"
    close = lambda a, b: a == pytest.approx(b, abs=1e-4)  # noqa: E731 - a prefix-cache hit may round differently
    if chat:
        content = [entry for p in parts for entry in p["content"]]
        assert len(content) == len(whole["content"]) == 10
        for got, want in zip(content, whole["content"]):
            assert (got["token"], got["bytes"]) == (want["token"], want["bytes"]) and close(got["logprob"],
                                                                                           want["logprob"])
            assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]]
            assert close([t["logprob"] for t in got["top_logprobs"]], [t["logprob"] for t in want["top_logprobs"]])
            assert len(got["top_logprobs"]) == 2
    else:
        merged = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
        assert len(merged["tokens"]) == 10
        assert merged["tokens"] == whole["tokens"] and merged["text_offset"] == whole["text_offset"]
        assert close(merged["token_logprobs"], whole["token_logprobs"])
        for got, want in zip(merged["top_logprobs"], whole["top_logprobs"]):
            assert got.keys() == want.keys() and close(list(got.values()), list(want.values()))
        assert merged["text_offset"] == sorted(merged["text_offset"])


def test_python_client_beside_the_openai_client(server, http, ref):
    """``inferscale_client.InferScale`` for segments, versions and sessions; ``openai`` for chat."""
    from openai import NotFoundError, OpenAI

    from inferscale_client import InferScale, InferScaleError, NotFound

    base, key = server.url + "/v1", A["Authorization"].split()[1]
    llm, kb = OpenAI(base_url=base, api_key=key, max_retries=0), InferScale(base_url=base, api_key=key)
    assert kb.health()["status"] == "ok"
    info = kb.segments.create("client/kb", text="Shipping takes three days.")
    assert info["version"] == 1 and "client/kb" in [s["id"] for s in kb.segments.list()]
    assert kb.segments.update("client/kb", text="Shipping takes two days.")["version"] == 2
    after = kb.segments.append("client/kb", text=" Express shipping takes one day.")
    assert after["version"] == 3 and kb.segments.get("client/kb")["num_tokens"] == after["num_tokens"]
    messages = [{"role": "user", "content": "How long is shipping?"}]
    turns = []
    for _ in range(2):
        r = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                        extra_body=kb.extensions(segments=["client/kb"], session="client-s"))
        messages = messages + [{"role": "assistant", "content": r.choices[0].message.content},
                               {"role": "user", "content": "And express?"}]
        turns.append(r.usage.prompt_tokens_details.cached_tokens)
    session = kb.sessions.get("client-s")
    assert session["turns"] == 2 and turns[1] > 0 and [s["id"] for s in kb.sessions.list()] == ["client-s"]
    kb.sessions.delete("client-s")
    with pytest.raises(NotFound):
        kb.sessions.get("client-s")
    with pytest.raises(InferScaleError) as e:
        kb.segments.create("client/kb", text="again")
    assert e.value.status == 409 and "already exists" in e.value.message
    kb.segments.delete("client/kb")
    with pytest.raises(NotFoundError):  # the openai client sees the same 404
        llm.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body=kb.extensions(segments=["client/kb"]))
    with pytest.raises(InferScaleError) as e:
        InferScale(base_url=base, api_key="wrong").segments.list()
    assert e.value.status == 401
