"""Malformed and hostile input against the real server: every case gets the right status and an
OpenAI error body, and the server keeps answering afterwards.  Also: overload -> 503 with
Retry-After (server run with ``--max-batch 1 --max-waiting 1``), the API key file's validation,
and chat on a tokenizer without a chat template (in-process app over a stub engine)."""

import asyncio
import json
import subprocess
import sys
import threading
import types

import httpx
import pytest

from serving import ApiKeys, create_app
from tests.support.server_util import REPO, Server, cache_dir, wait_for

C, CHAT, SEG = "/v1/completions", "/v1/chat/completions", "/v1/segments"
OK_CHAT = [{"role": "user", "content": "hi"}]
BIG = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
LONG_TEXT = "word " * 6000  # > 4096 positions of the default model

# (case id, method, path, body: dict -> JSON | bytes -> raw, expected status, expected error code)
CASES = [
    ("invalid json", "POST", C, b'{"prompt": "hi", ', 400, "invalid_json"),
    ("empty body", "POST", C, b"", 400, "invalid_json"),
    ("invalid utf-8", "POST", C, b'{"prompt": "\xff\xfe\xfd"}', 400, "invalid_json"),
    ("NaN literal", "POST", C, b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_json"),
    ("nested 100k deep", "POST", C, DEEP, 400, "invalid_json"),
    ("lone surrogate escape", "POST", C, b'{"prompt": "a\\ud800b"}', 400, "invalid_json"),
    ("segment: lone surrogate", "POST", SEG, b'{"id": "s\\udfff", "text": "x"}', 400, "invalid_json"),
    ("10 MB body", "POST", C, BIG, 413, "request_too_large"),
    # 20k keys (the 10k bound), and a 200 KB body (parsed on a worker thread: still a proper 400)
    ("20k object keys", "POST", C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(20000)}}, 400,
     "invalid_json"),
    ("200 KB prompt, parsed off the loop", "POST", C, {"prompt": "word " * 40000, "max_tokens": 4}, 400,
     "context_length_exceeded"),
    ("body is an array", "POST", C, [1, 2], 400, "invalid_field"),
    ("missing prompt", "POST", C, {"max_tokens": 4}, 400, "invalid_field"),
    ("prompt is a number", "POST", C, {"prompt": 5}, 400, "invalid_field"),
    ("prompt is null", "POST", C, {"prompt": None}, 400, "invalid_field"),
    ("empty prompt", "POST", C, {"prompt": ""}, 400, "invalid_field"),
    ("empty token list", "POST", C, {"prompt": []}, 400, "invalid_field"),
    ("a batched prompt is empty", "POST", C, {"prompt": ["a", ""]}, 400, "invalid_field"),
    ("257 batched prompts", "POST", C, {"prompt": ["a"] * 257}, 400, "invalid_field"),
    ("max_tokens as string", "POST", C, {"prompt": "hi", "max_tokens": "16"}, 400, "invalid_field"),
    ("max_tokens as float", "POST", C, {"prompt": "hi", "max_tokens": 4.5}, 400, "invalid_field"),
    ("max_tokens negative", "POST", C, {"prompt": "hi", "max_tokens": -5}, 400, "invalid_field"),
    ("max_tokens zero without echo", "POST", C, {"prompt": "hi", "max_tokens": 0}, 400, "invalid_field"),
    ("max_tokens huge", "POST", C, {"prompt": "hi", "max_tokens": 10**9}, 400, "context_length_exceeded"),
    # beyond int32: SamplingParams' own range check names the field, before any context check
    ("max_tokens 10**30", "POST", C, {"prompt": "hi", "max_tokens": 10**30}, 400, "invalid_field"),
    ("prompt too long", "POST", C, {"prompt": LONG_TEXT, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("temperature < 0", "POST", C, {"prompt": "hi", "temperature": -0.5}, 400, "invalid_field"),
    ("temperature > 2", "POST", C, {"prompt": "hi", "temperature": 7}, 400, "invalid_field"),
    ("temperature bool", "POST", C, {"prompt": "hi", "temperature": True}, 400, "invalid_field"),
    ("top_p zero", "POST", C, {"prompt": "hi", "top_p": 0}, 400, "invalid_field"),
    ("top_p > 1", "POST", C, {"prompt": "hi", "top_p": 1.5}, 400, "invalid_field"),
    ("top_k below -1", "POST", C, {"prompt": "hi", "top_k": -2}, 400, "invalid_field"),
    ("min_p > 1", "POST", C, {"prompt": "hi", "min_p": 1.5}, 400, "invalid_field"),
    ("min_tokens > max_tokens", "POST", C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "invalid_field"),
    ("logit_bias out of range", "POST", C, {"prompt": "hi", "logit_bias": {"5": 150}}, 400, "invalid_field"),
    ("logit_bias key not an id", "POST", C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "invalid_field"),
    ("logit_bias id beyond vocab", "POST", C, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "invalid_field"),
    ("prompt_logprobs too many", "POST", C, {"prompt": "hi", "prompt_logprobs": 21}, 400, "invalid_field"),
    ("seed negative", "POST", C, {"prompt": "hi", "seed": -1}, 400, "invalid_field"),
    ("seed 2**64", "POST", C, {"prompt": "hi", "seed": 2**64}, 400, "invalid_field"),
    ("stream as string", "POST", C, {"prompt": "hi", "stream": "yes"}, 400, "invalid_field"),
    ("stop list too long", "POST", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "invalid_field"),
    ("stop wrong type", "POST", C, {"prompt": "hi", "stop": 42}, 400, "invalid_field"),
    ("stop empty string", "POST", C, {"prompt": "hi", "stop": [""]}, 400, "invalid_field"),
    ("token id beyond vocab", "POST", C, {"prompt": [5, 10**6]}, 400, "invalid_field"),
    ("token id negative", "POST", C, {"prompt": [5, -3]}, 400, "invalid_field"),
    ("stop_token_ids beyond vocab", "POST", C, {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "invalid_field"),
    ("logprobs too many", "POST", C, {"prompt": "hi", "logprobs": 100}, 400, "invalid_field"),
    ("n = 0", "POST", C, {"prompt": "hi", "n": 0}, 400, "invalid_field"),
    ("n = 17", "POST", C, {"prompt": "hi", "n": 17}, 400, "invalid_field"),
    ("n as string", "POST", C, {"prompt": "hi", "n": "2"}, 400, "invalid_field"),
    ("seed + n overflows", "POST", C, {"prompt": "hi", "n": 4, "seed": 2**63 - 2}, 400, "invalid_field"),
    ("echo of a negative token id", "POST", C, {"prompt": [-1], "echo": True}, 400, "invalid_field"),
    ("echo of a huge token id", "POST", C, {"prompt": [2**40], "echo": True}, 400, "invalid_field"),
    ("presence_penalty > 2", "POST", C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "invalid_field"),
    ("frequency_penalty < -2", "POST", C, {"prompt": "hi", "frequency_penalty": -3}, 400, "invalid_field"),
    ("repetition_penalty 0", "POST", C, {"prompt": "hi", "repetition_penalty": 0}, 400, "invalid_field"),
    ("repetition_penalty > 2", "POST", C, {"prompt": "hi", "repetition_penalty": 2.5}, 400, "invalid_field"),
    ("best_of 2", "POST", C, {"prompt": "hi", "best_of": 2}, 400, "invalid_field"),
    ("suffix", "POST", C, {"prompt": "hi", "suffix": "end"}, 400, "invalid_field"),
    ("guided_regex that does not compile", "POST", C, {"prompt": "hi", "guided_regex": "[a-"}, 400,
     "invalid_field"),
    ("guided_json not a schema", "POST", C, {"prompt": "hi", "guided_json": [1, 2]}, 400, "invalid_field"),
    ("two structured outputs", "POST", C, {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}, 400,
     "invalid_field"),
    ("chat: response_format type", "POST", CHAT, {"messages": OK_CHAT, "response_format": {"type": "xml"}},
     400, "invalid_field"),
    ("chat: json_schema without schema", "POST", CHAT, {"messages": OK_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "invalid_field"),
    ("chat: tool_choice names no tool", "POST", CHAT, {"messages": OK_CHAT, "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, 400, "invalid_field"),
    ("tools on completions", "POST", C, {"prompt": "hi", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "invalid_field"),
    ("chat: tool_choice", "POST", CHAT, {"messages": OK_CHAT, "tool_choice": "auto"}, 400, "invalid_field"),
    ("chat: functions", "POST", CHAT, {"messages": OK_CHAT, "functions": [{"name": "f"}]}, 400, "invalid_field"),
    ("chat: echo", "POST", CHAT, {"messages": OK_CHAT, "echo": True}, 400, "invalid_field"),
    ("unknown field", "POST", C, {"prompt": "hi", "foo": 1}, 400, "invalid_field"),
    ("typo max_token", "POST", C, {"prompt": "hi", "max_token": 4}, 400, "invalid_field"),
    ("stream_options wrong", "POST", C, {"prompt": "hi", "stream_options": True}, 400, "invalid_field"),
    ("segments not a list", "POST", C, {"prompt": "hi", "segments": "dup"}, 400, "invalid_field"),
    ("segment id empty", "POST", C, {"prompt": "hi", "segments": [""]}, 400, "invalid_field"),
    ("mode unknown", "POST", C, {"prompt": "hi", "mode": "fast"}, 400, "invalid_field"),
    ("unknown segment", "POST", C, {"prompt": "hi", "segments": ["no-such-seg"]}, 404, "segment_not_found"),
    ("unknown model", "POST", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found"),
    ("chat: no messages", "POST", CHAT, {"messages": []}, 400, "invalid_field"),
    ("chat: messages not a list", "POST", CHAT, {"messages": "hi"}, 400, "invalid_field"),
    ("chat: unknown role", "POST", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_field"),
    ("chat: content number", "POST", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "invalid_field"),
    ("chat: tool without function", "POST", CHAT, {"messages": OK_CHAT, "tools": [{"type": "function"}]}, 400,
     "invalid_field"),
    ("chat: continue a user message", "POST", CHAT, {"messages": OK_CHAT, "continue_final_message": True,
                                                     "add_generation_prompt": False}, 400, "invalid_field"),
    ("chat: temperature < 0", "POST", CHAT, {"messages": OK_CHAT, "temperature": -1}, 400, "invalid_field"),
    ("chat: unknown segment", "POST", CHAT, {"messages": OK_CHAT, "segments": ["nope"]}, 404, "segment_not_found"),
    ("segment: duplicate id", "POST", SEG, {"id": "dup", "text": "again"}, 409, "segment_exists"),
    ("segment: text and token_ids", "POST", SEG, {"id": "s1", "text": "a", "token_ids": [1]}, 400, "invalid_field"),
    ("segment: neither source", "POST", SEG, {"id": "s1"}, 400, "invalid_field"),
    ("segment: empty id", "POST", SEG, {"id": "", "text": "a"}, 400, "invalid_field"),
    ("segment: id too long", "POST", SEG, {"id": "x" * 300, "text": "a"}, 400, "invalid_field"),
    ("segment: id with newline", "POST", SEG, {"id": "faq\nv2", "text": "a"}, 400, "invalid_field"),
    ("segment: id with space", "POST", SEG, {"id": "my faq", "text": "a"}, 400, "invalid_field"),
    ("segment: id with ?", "POST", SEG, {"id": "faq?v=2", "text": "a"}, 400, "invalid_field"),
    ("segment: id with %", "POST", SEG, {"id": "faq%2F", "text": "a"}, 400, "invalid_field"),
    ("segment: id not ascii", "POST", SEG, {"id": "fa\u00e7ade", "text": "a"}, 400, "invalid_field"),
    ("segment: empty text", "POST", SEG, {"id": "s1", "text": ""}, 400, "invalid_field"),
    ("segment: ids beyond vocab", "POST", SEG, {"id": "s1", "token_ids": [1, 10**6]}, 400, "invalid_field"),
    ("segment: too long", "POST", SEG, {"id": "s1", "text": LONG_TEXT}, 400, "context_length_exceeded"),
    ("segment: pin not bool", "POST", SEG, {"id": "s1", "text": "a", "pin": "yes"}, 400, "invalid_field"),
    ("get unknown segment", "GET", SEG + "/no-such-seg", None, 404, "segment_not_found"),
    ("delete unknown segment", "DELETE", SEG + "/no-such-seg", None, 404, "segment_not_found"),
    ("unknown route", "GET", "/v1/nothing", None, 404, "route_not_found"),
    ("wrong method", "PUT", C, {"prompt": "hi"}, 405, "method_not_allowed"),
]


# the error's "param" names the offending field
PARAMS = {"stream as string": "stream", "max_tokens negative": "max_tokens", "temperature < 0": "temperature",
          "seed 2**64": "seed", "chat: unknown role": "messages.0.role", "typo max_token": "max_token",
          "token id beyond vocab": None, "stop list too long": "stop", "segment: pin not bool": "pin",
          "n = 17": "n", "max_tokens 10**30": "max_tokens", "seed + n overflows": "seed",
          "presence_penalty > 2": "presence_penalty",
          "repetition_penalty > 2": "repetition_penalty", "best_of 2": "best_of", "suffix": "suffix",
          "logit_bias out of range": "logit_bias.5", "chat: response_format type": "response_format",
          "chat: echo": "echo", "guided_regex that does not compile": "guided_regex",
          "chat: json_schema without schema": "response_format", "chat: tool_choice names no tool": "tool_choice",
          "chat: tool_choice": "tool_choice", "chat: tool without function": "tools[0]",
          "tools on completions": "tools", "two structured outputs": "guided_choice",
          "segment: id with newline": "id", "segment: id with space": "id", "segment: id too long": "id"}
# unsupported fields: rejected with a message that says so, naming the field
UNSUPPORTED = {"unknown field": "foo", "typo max_token": "max_token",
               "best_of 2": "best_of", "suffix": "suffix",
               "chat: functions": "functions", "chat: echo": "echo"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = cache_dir(tmp_path_factory)
    srv = Server(tmp_path_factory.mktemp("bad-input-server"), cache, "--max-batch", "1", "--max-waiting", "1")
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.post(SEG, json={"id": "dup", "text": "a registered segment"}).status_code == 201
        yield client


def _send(http, method, path, body):
    if body is None:
        return http.request(method, path)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.request(method, path, content=raw, headers={"Content-Type": "application/json"})


def test_table_has_enough_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,path,body,status,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http, server, name, method, path, body, status, code):
    r = _send(http, method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and isinstance(err["message"], str) and len(err["message"]) > 10
    assert err["type"] in ("invalid_request_error", "not_found_error", "conflict_error")
    if code == "context_length_exceeded":  # says both lengths: what was asked and the limit
        assert "4096" in err["message"] and any(ch.isdigit() for ch in err["message"].replace("4096", ""))
    if name in PARAMS:
        assert err["param"] == PARAMS[name]
    if name in UNSUPPORTED:  # rejected, not ignored
        assert f"unsupported field {UNSUPPORTED[name]!r}" in err["message"], err["message"]
    if name.startswith("segment: id with"):  # names the allowed alphabet
        assert "A-Z a-z 0-9 . _ - : /" in err["message"], err["message"]
    assert server.alive()


def test_still_serving_after_bad_input(http, server):
    for name, method, path, body, _, _ in CASES:  # all of them again, back to back
        _send(http, method, path, body)
    assert http.get("/health").json()["status"] == "ok"
    r = http.post(C, json={"prompt": "still alive?", "max_tokens": 4, "temperature": 0, "segments": ["dup"]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = http.get("/v1/stats").json()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert server.alive()


def test_overload_503_with_retry_after(http, server):
    """max_batch 1 and max_waiting 1: one running, one waiting, the third is turned away."""
    base = http.get("/v1/stats").json()
    long = {"prompt": "go on", "max_tokens": 400, "ignore_eos": True, "stream": True}
    stop = threading.Event()

    def hold(tag, started):
        with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", C, json=long) as r:
            started[tag] = r.status_code
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    started: dict = {}
    t1 = threading.Thread(target=hold, args=("running", started), daemon=True)
    t1.start()
    wait_for(lambda: "running" in started)
    t2 = threading.Thread(target=hold, args=("waiting", started), daemon=True)
    t2.start()
    wait_for(lambda: http.get("/v1/stats").json()["waiting"] == 1)
    r = http.post(C, json={"prompt": "one more", "max_tokens": 2})
    # Retry-After: the queue over its measured drain rate, whole seconds in [1, 60], named in the message
    assert r.status_code == 503 and 1 <= int(r.headers["retry-after"]) <= 60
    assert f"retry after {r.headers['retry-after']} s" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "overloaded_error"
    stop.set()  # both clients hang up: their requests are aborted and their pages freed
    t1.join(60)
    t2.join(60)
    stats = wait_for(lambda: (s := http.get("/v1/stats").json())["running"] == 0 and s["waiting"] == 0 and s)
    assert stats["pages_free"] == base["pages_free"]
    assert http.post(C, json={"prompt": "after", "max_tokens": 2}).status_code == 200


def test_api_key_file_validation(tmp_path):
    good = tmp_path / "keys.toml"
    good.write_text('"k1" = "acme"\n"k2" = { tenant = "ops", admin = true }\n')
    keys = ApiKeys.from_file(str(good))
    assert keys.authenticate("Bearer k1").tenant == "acme" and not keys.authenticate("Bearer k1").admin
    assert keys.authenticate("bearer k2").admin
    bad_cases = {
        "reserved.json": {"sk-secret-1": "__public__"},
        "admin.json": {"sk-secret-1": {"tenant": "a", "admin": "yes"}},
        "extra.json": {"sk-secret-1": {"tenant": "a", "role": "x"}},
        "empty.json": {},
        "tenant.json": {"sk-secret-1": ""},
    }
    for name, mapping in bad_cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(mapping))
        with pytest.raises(ValueError) as e:
            ApiKeys.from_file(str(path))
        assert "sk-secret-1" not in str(e.value)
    (tmp_path / "garbage.json").write_text("{not json, not toml")
    with pytest.raises(ValueError, match="neither valid JSON nor valid TOML"):
        ApiKeys.from_file(str(tmp_path / "garbage.json"))
    # the CLI refuses it before loading the model, without echoing the key
    proc = subprocess.run([sys.executable, "-m", "inferscale_cli", "serve", "--api-keys",
                           str(tmp_path / "reserved.json")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "reserved" in proc.stderr and "sk-secret-1" not in proc.stderr


def test_chat_without_template_is_400():
    """In-process app over a stub engine whose tokenizer has no chat template."""
    stub = types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=None), stream=None)
    app = create_app(stub, api_keys={"k": "t"})

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.post(CHAT, json={"messages": OK_CHAT}, headers={"Authorization": "Bearer k"})
            unauth = await c.post(CHAT, json={"messages": OK_CHAT})
            return r, unauth

    r, unauth = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert "chat template" in r.json()["error"]["message"]
    assert unauth.status_code == 401


def test_client_cancelling_a_queued_call_keeps_the_engine_loop_alive():
    """A handler cancelled (client gone) while its submit / call waits behind a busy engine thread:
    the command is skipped, nothing is left running, and the loop keeps serving."""
    from tests.support.tiny_engine import make_engine

    from inferscale_jax import AsyncEngine, SamplingParams

    engine = make_engine()
    ae = AsyncEngine(engine)
    gate = threading.Event()
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def go():
        blocker = asyncio.ensure_future(ae.call(gate.wait, 30))  # the engine thread is busy
        await asyncio.sleep(0.05)

        async def consume():
            async for _ in ae.stream(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=50),
                                     request_id="gone"):
                pass

        queued = [asyncio.ensure_future(consume()), asyncio.ensure_future(ae.call(engine.stats))]
        await asyncio.sleep(0.05)
        for task in queued:
            task.cancel()
        gate.set()
        await blocker
        stats = await asyncio.wait_for(ae.call(engine.stats), 30)
        out = await asyncio.wait_for(ae.generate(prompt_token_ids=[4, 5, 6], sampling=sampling), 60)
        return stats, out

    try:
        stats, out = asyncio.run(go())
    finally:
        ae.shutdown()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert len(out.token_ids) == 3
