"""Structured outputs and tools over HTTP, through the openai SDK as users call them: every
output under a schema parses and validates, streamed and not; regex and choices match; forced
tool calls (``required``, a named function) always parse and match their tool's schema; tool
messages go back into the template; segments and ``n > 1`` work with a grammar."""

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.server_util import Server, cache_dir, sse_events

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 16},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "sources": {"type": "array", "items": {"enum": ["faq", "wiki", "profile"]}, "maxItems": 2},
    "ticket": {"type": "string", "pattern": "^T-[0-9]{4}$"},
}, "required": ["answer", "confidence", "ticket"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
REFUND = {"type": "function", "function": {"name": "refund", "parameters": {"type": "object", "properties": {
    "order": {"type": "string", "pattern": "^[0-9]{6}$"}, "amount": {"type": "integer", "minimum": 1,
                                                                     "maximum": 999}},
    "required": ["order", "amount"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Where is my order?"}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("structured"), cache_dir(tmp_path_factory), "--served-model-name", "tiny")
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7), (0.9, 8)])
def test_json_schema_streamed_and_not(client, temperature, seed):
    kw = dict(model="tiny", messages=MSGS, max_tokens=400, temperature=temperature, seed=seed,
              response_format=schema_format())
    out = client.chat.completions.create(**kw)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text  # same seed (or greedy): the same tokens, streamed
    done = client.completions.create(model="tiny", prompt="Reply:", max_tokens=400, temperature=temperature,
                                     seed=seed, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_parse_with_a_pydantic_model(client):
    for seed in (1, 2):
        out = client.chat.completions.parse(model="tiny", messages=MSGS, max_tokens=300, temperature=1.0, seed=seed,
                                            response_format=Person)
        person = out.choices[0].message.parsed
        assert isinstance(person, Person) and person.role in ("admin", "user", "guest")


def test_json_object_regex_choice_and_grammar(client, http):
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=60, temperature=0.0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].message.content.startswith("{")
    for body, pattern in (({"guided_regex": r"[A-Z]{3}-[0-9]{2}"}, r"[A-Z]{3}-[0-9]{2}"),
                          ({"guided_choice": ["yes", "no", "later"]}, r"yes|no|later"),
                          ({"structured_outputs": {"choice": ["alpha", "beta"]}}, r"alpha|beta"),
                          ({"guided_grammar": 'start: "id=" /[0-9]{3}/'}, r"id=[0-9]{3}")):
        for seed in (3, 4):
            r = http.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 20, "temperature": 1.0,
                                                   "seed": seed, **body})
            assert r.status_code == 200, r.text
            assert re.fullmatch(pattern, r.json()["choices"][0]["text"]), (body, r.json())
    # n > 1 and a stop string with a grammar: every choice matches
    r = http.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 20, "temperature": 1.0, "seed": 9,
                                           "n": 3, "guided_regex": r"[a-z]{2,6}"})
    assert [re.fullmatch(r"[a-z]{2,6}", c["text"]) is not None for c in r.json()["choices"]] == [True] * 3


def test_tool_choice_required_and_named(client):
    for seed in (1, 2, 3):
        out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=300, temperature=1.0, seed=seed,
                                             tools=[WEATHER, REFUND], tool_choice="required")
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            spec = {"get_weather": WEATHER, "refund": REFUND}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
            assert call.id.startswith("call_") and call.type == "function"
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=300, temperature=1.0, seed=4,
                                         tools=[WEATHER, REFUND], tool_choice="required", parallel_tool_calls=False)
    assert len(out.choices[0].message.tool_calls) == 1
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=300, temperature=0.0,
                                         tools=[WEATHER, REFUND],
                                         tool_choice={"type": "function", "function": {"name": "refund"}})
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "refund" and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), REFUND["function"]["parameters"])


def test_streamed_tool_calls_name_first_then_arguments(http):
    body = {"messages": MSGS, "max_tokens": 300, "temperature": 0.0, "stream": True, "tools": [WEATHER, REFUND],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = sse_events(list(resp.iter_lines()))
    assert events.pop() == "[DONE]"
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls", [])]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert len(deltas) > 2  # the arguments arrive in fragments
    args = "".join(d["function"].get("arguments", "") for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]
    body["tool_choice"] = "required"
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = sse_events(list(resp.iter_lines()))
    deltas = [d for e in events[:-1] for c in e["choices"] for d in c["delta"].get("tool_calls", [])]
    assert deltas and all("index" in d for d in deltas)
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]


def test_tool_messages_go_back_into_the_conversation(client):
    convo = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
    out = client.chat.completions.create(model="tiny", messages=convo, max_tokens=8, temperature=0.0,
                                         tools=[WEATHER], tool_choice="auto")
    assert out.choices[0].message.content is not None or out.choices[0].message.tool_calls
    alone = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0.0,
                                           tools=[WEATHER], tool_choice="auto")
    tool_text = client.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "user", "content": "4 degrees, rain"}]).usage.prompt_tokens
    # the tool's answer is in the prompt the template rendered: at least its own tokens more
    assert out.usage.prompt_tokens >= alone.usage.prompt_tokens + tool_text - 4
    out = client.chat.completions.create(model="tiny", messages=convo, max_tokens=8, temperature=0.0,
                                         tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.tool_calls is None


def test_with_a_segment(client, http):
    r = http.post("/v1/segments", json={"id": "tool-docs", "text": "get_weather(city, unit) returns the weather."})
    assert r.status_code == 201, r.text
    for seed in (5, 6):
        out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=300, temperature=1.0, seed=seed,
                                             tools=[WEATHER], tool_choice="required",
                                             extra_body={"segments": ["tool-docs"]})
        call = out.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_bad_schemas_are_400_naming_the_field(http):
    for body, param in (({"guided_regex": "(unclosed"}, "guided_regex"),
                        ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": 5}}})},
                         "response_format"),
                        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar")):
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, r.text
    assert http.get("/health").status_code == 200


@pytest.mark.alone  # (a time bound: conftest.py)
def test_a_grammar_that_compiles_too_long_is_a_400(monkeypatch):
    """The API's compile check is bounded: past ``COMPILE_TIMEOUT_S`` the request is a 400 naming the
    field (the engine never sees it), and the event loop was not blocked meanwhile."""
    import asyncio
    import threading
    import time

    from inferscale_jax.structured import StructuredOutputs
    from serving import response_format
    from serving.errors import APIError

    release = threading.Event()

    class SlowGrammars:
        def check(self, so):
            release.wait(5.0)  # a compile that takes "forever"

    class State:
        grammars = SlowGrammars()

    monkeypatch.setattr(response_format, "COMPILE_TIMEOUT_S", 0.2)

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        try:
            await response_format.check(State(), StructuredOutputs(regex="a+"), "guided_regex")
        except APIError as e:
            return e, time.perf_counter() - t0, ticks
        finally:
            t.cancel()
            release.set()
        return None, time.perf_counter() - t0, ticks

    e, took, ticks = asyncio.run(go())
    assert isinstance(e, APIError) and e.status == 400 and e.param == "guided_regex"
    assert "guided_regex" in e.message and "did not compile within 0.2 s" in e.message
    assert took < 2.0 and ticks >= 5  # answered at the bound; the loop ran meanwhile
