"""Connection limits and engine-fault statuses, against a real uvicorn server (loopback, in a
thread) over a stub engine (no model needed): a stalled upload gets 408 and its connection closed
while other requests are served; ``UVICORN_OPTIONS`` holds the keep-alive timeout; StorageError
is a 507 naming the folder, EngineFault a 503 with Retry-After."""

import asyncio
import json
import socket
import threading
import time
import types

import httpx
import pytest
import uvicorn

from inferscale_jax.errors import EngineFault, StorageError
from inferscale_jax.outputs import RequestMetrics
from serving import UVICORN_OPTIONS, create_app
from tests.support.server_util import free_port

pytestmark = pytest.mark.alone  # (timeouts of 1-5 s: conftest.py)


class StubAsyncEngine:
    """What the app needs of an ``AsyncEngine``: ``engine``, ``call``, ``stream``, ``register_segment``."""

    def __init__(self, register_error=None, stream_error=None):
        self.engine = types.SimpleNamespace(tokenizer=None, stats=lambda: {}, list_segments=lambda tenant: [])
        self.register_error, self.stream_error = register_error, stream_error

    async def call(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    async def register_segment(self, *args, **kwargs):
        raise self.register_error

    async def stream(self, **request):
        raise self.stream_error
        yield  # an async generator, like AsyncEngine.stream


class ThreadedServer:
    def __init__(self, app, http=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = dict(UVICORN_OPTIONS, **({"http": http} if http is not None else {}))
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def test_uvicorn_options():
    assert UVICORN_OPTIONS["timeout_keep_alive"] <= 10
    assert UVICORN_OPTIONS["limit_concurrency"] > 256  # above the default max_waiting
    uvicorn.Config(lambda *a: None, **UVICORN_OPTIONS)  # every option is one uvicorn knows


def test_stalled_body_gets_408_and_the_connection_is_closed():
    app = create_app(StubAsyncEngine(), body_timeout_s=1.0)
    with ThreadedServer(app) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')  # 10 of 1000 bytes, then nothing
        # meanwhile other requests are served at once
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 200
        assert time.monotonic() - t0 < 1.0
        received = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
        elapsed = time.monotonic() - t0
        assert 0.9 < elapsed < 5, elapsed
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"connection: close" in head.lower()
        assert b'"code": "body_timeout"' in body and b"body_timeout_s" in body


def test_trickled_body_is_bounded_per_request():
    """A byte now and then does not extend the wait: the bound is on the whole body."""
    app = create_app(StubAsyncEngine(), body_timeout_s=1.0)
    with ThreadedServer(app) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        try:
            for _ in range(20):
                sock.sendall(b" ")
                time.sleep(0.2)
        except OSError:  # the server closed the connection
            pass
        received = sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 408"), received[:200]
        assert time.monotonic() - t0 < 3.5


def test_whole_body_in_time_is_served():
    app = create_app(StubAsyncEngine(), body_timeout_s=1.0)
    with ThreadedServer(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "temperature": -1})  # reaches validation
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_create_app_rejects_bad_body_timeout():
    with pytest.raises(ValueError, match="body_timeout_s"):
        create_app(StubAsyncEngine(), body_timeout_s=0)


def _post(app, path, body):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_storage_full_is_507_naming_the_folder():
    err = StorageError("the segment registry folder /data/kv/registry is full (ENOSPC): free space there")
    r = _post(create_app(StubAsyncEngine(register_error=err)), "/v1/segments", {"id": "s1", "text": "x"})
    assert r.status_code == 507, r.text
    e = r.json()["error"]
    assert e["code"] == "storage_full" and "/data/kv/registry" in e["message"]
    assert set(e) == {"message", "type", "param", "code"}


def test_engine_fault_is_503_with_retry_after():
    fault = EngineFault("XLA device lost: CUDA_ERROR_ILLEGAL_ADDRESS at 0x7f00")
    app = create_app(StubAsyncEngine(stream_error=fault))
    r = _post(app, "/v1/completions", {"prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    e = r.json()["error"]
    assert e["code"] == "engine_fault" and e["type"] == "server_error"
    assert "0x7f00" not in e["message"]  # device internals stay in the server log
    r = _post(create_app(StubAsyncEngine(register_error=fault)), "/v1/segments", {"id": "s1", "text": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_fault"


class LetterTokenizer:
    """Token id 5 + i is the letter 'a' + i; no chat template."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 5) for i in ids)


class ScriptedAsyncEngine(StubAsyncEngine):
    """Streams fixed deltas; ``with_logprobs``: each delta carries its tokens' log-probs (as an
    engine setting ``RequestOutput.logprobs`` does), else only the final output has them."""

    def __init__(self, with_logprobs: bool):
        super().__init__()
        self.with_logprobs = with_logprobs
        self.engine.tokenizer = LetterTokenizer()

    async def stream(self, **request):
        ids, texts = [5, 6, 7], ["a", "b", "c"]
        lps = [{t: -0.5 * (i + 1)} for i, t in enumerate(ids)]
        out = types.SimpleNamespace(text="abc", token_ids=ids, logprobs=lps, finish_reason="length",
                                    metrics=RequestMetrics(prompt_tokens=2, cached_tokens=0, generated_tokens=3))
        for i in range(3):
            last = i == 2
            yield types.SimpleNamespace(new_token_ids=[ids[i]], text=texts[i], finished=last,
                                        output=out if last else None,
                                        logprobs=[lps[i]] if self.with_logprobs else None)


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_streamed_logprobs_per_chunk(with_logprobs):
    app = create_app(ScriptedAsyncEngine(with_logprobs))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "logprobs": 1, "stream": True,
                                                      "max_tokens": 3})
            return [ln for ln in r.text.splitlines() if ln.startswith("data: {")]

    chunks = [json.loads(ln[6:])["choices"][0] for ln in asyncio.run(go())]
    content = [c for c in chunks if c["text"]]
    assert [c["text"] for c in content] == ["a", "b", "c"]  # one chunk per delta, in order
    assert [c["logprobs"]["token_logprobs"] for c in content] == [[-0.5], [-1.0], [-1.5]]
    assert [c["logprobs"]["text_offset"] for c in content] == [[0], [1], [2]]
    assert chunks[-1]["finish_reason"] == "length"


def test_a_tenant_over_its_share_of_the_queue_gets_429_and_others_are_served():
    """Two tenants, max_waiting 4: each may hold 2 queued requests (half), then gets 429 with
    Retry-After while the other is still admitted; the whole queue full is 503; releasing frees
    the tenant's share; refusals are counted per tenant and status."""
    from serving.app import ServerState
    from serving.auth import ApiKeys
    from serving.errors import APIError

    keys = ApiKeys({"ka": "a", "kb": "b", "ka2": "a"})
    assert keys.tenants() == ["a", "b"]
    state = ServerState(types.SimpleNamespace(engine=types.SimpleNamespace()), api_keys=keys, max_waiting=4,
                        model_names=["m"], default_max_tokens=16)
    assert state.max_waiting_per_tenant == 2
    state.admit(1, "a")
    state.admit(1, "a")
    with pytest.raises(APIError) as e:
        state.admit(1, "a")
    assert e.value.status == 429 and 1 <= int(e.value.headers["Retry-After"]) <= 60
    assert "tenant 'a'" in str(e.value) and "--max-waiting-per-tenant" in str(e.value)
    state.admit(1, "b")  # b is still served
    state.admit(1, "b")
    with pytest.raises(APIError) as e:  # b at its share too
        state.admit(1, "b")
    assert e.value.status == 429
    state.release(1, "a")
    state.admit(1, "a")
    assert state.pending == 4 and state.pending_by_tenant == {"a": 2, "b": 2}
    for t in ("a", "b"):
        state.release(2, t)
    assert state.pending == 0 and not state.pending_by_tenant
    # one tenant (no key file): the whole queue is its share; past it, 503
    solo = ServerState(types.SimpleNamespace(engine=types.SimpleNamespace()), api_keys=None, max_waiting=2,
                       model_names=["m"], default_max_tokens=16)
    solo.admit(2)
    with pytest.raises(APIError) as e:
        solo.admit(1)
    assert e.value.status == 503
    stats = {"pages_used": 1, "pages_free": 2, "tenants": {"a": {"running": 3, "waiting": 5}}}
    text = state.metrics.render(stats).decode()
    assert 'inferscale_tenant_requests{state="waiting",tenant="a"} 5.0' in text
    assert 'inferscale_tenant_rejected_total{status="429",tenant="a"} 1.0' in text
    assert 'inferscale_tenant_rejected_total{status="429",tenant="b"} 1.0' in text


def _closed_within(sock, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return None
    except OSError:
        pass
    return time.monotonic() - t0


def protocols():
    """Both guarded protocols: httptools (what serve runs when httptools is installed) and h11."""
    from serving.connections import GuardedH11Protocol, guarded_protocol

    return [pytest.param(guarded_protocol(), id="default"), pytest.param(GuardedH11Protocol, id="h11")]


def test_serve_runs_the_httptools_protocol_with_its_guards():
    """httptools is a dependency: the server's protocol is its C parser, guarded."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from serving.connections import ConnectionGuard

    assert issubclass(UVICORN_OPTIONS["http"], HttpToolsProtocol)
    assert issubclass(UVICORN_OPTIONS["http"], ConnectionGuard)


@pytest.mark.parametrize("http", protocols())
def test_a_connection_withholding_its_request_head_is_closed(monkeypatch, http):
    """Slow-loris: partial headers (or none) are closed after the head deadline, while a normal
    client is served meanwhile; a kept-alive connection gets a fresh deadline per request."""
    from serving.connections import ConnectionGuard

    monkeypatch.setattr(ConnectionGuard, "head_timeout_s", 0.6)
    app = create_app(StubAsyncEngine())
    with ThreadedServer(app, http) as srv:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        partial = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            assert c.get("/health").status_code == 200
            time.sleep(1.0)  # past the deadline: a request on the kept-alive connection still works
            assert c.get("/v1/models").status_code == 200
        for sock in (silent, partial):
            took = _closed_within(sock, 5)
            assert took is not None, "the server kept a connection without a request head open"
            sock.close()


@pytest.mark.parametrize("http", protocols())
def test_connections_per_client_address_are_capped(monkeypatch, http):
    from serving.connections import ConnectionGuard  # (the count is shared by both protocols)

    monkeypatch.setattr(ConnectionGuard, "max_per_client", 3)
    app = create_app(StubAsyncEngine())
    with ThreadedServer(app, http) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(3)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        assert _closed_within(extra, 3) is not None  # the 4th from this address: closed at once
        extra.close()
        for sock in held[:2]:
            assert _closed_within(sock, 0.2) is None  # the first 3 stay open
        held[0].close()
        time.sleep(0.2)
        with httpx.Client(base_url=srv.url, timeout=5) as c:  # room again for one more
            assert c.get("/health").status_code == 200
        for sock in held[1:]:
            sock.close()
        deadline = time.monotonic() + 5  # every close is counted (the count is the server's own)
        while ConnectionGuard.open_per_client.get("127.0.0.1", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ConnectionGuard.open_per_client.get("127.0.0.1", 0) == 0


def test_key_count_before_parsing_counts_keys_not_text():
    """A body with too many object keys is refused before it is parsed; text that only looks like
    keys (a prompt full of embedded JSON) is not counted, and spaced keys fall back to the parse."""
    import json

    from serving.app import MAX_JSON_KEYS, _count_keys

    many = json.dumps({f"k{i}": i for i in range(MAX_JSON_KEYS + 1)}, separators=(",", ":")).encode()
    assert _count_keys(many) == MAX_JSON_KEYS + 1
    prompt = json.dumps({"prompt": '{"a":1} \\": x"' * 20000, "max_tokens": 4}).encode()
    assert _count_keys(prompt) == 2  # the two real keys; the prompt's 40000 look-alikes are escaped
    assert _count_keys(b'{"a" : 1}') == 0  # (counted by the parse instead)


def test_an_admin_only_tenant_is_an_operator_not_a_tenant_to_share_with(tmp_path):
    """The defaults that share the engine between tenants (half the queue each, 1/8 of the rows kept from
    any one) count the tenants with a non-admin key: an operator's admin-only key (``/v1/stats``, public
    segments) beside one serving tenant leaves that tenant the whole queue and every row (before, the
    benchmark's own admin key capped its one tenant at 224 of 256 rows: bench/NOTES.md, run AN); a second
    serving tenant turns both on, as the flags typed by a user give them."""
    from inferscale_cli.main import build_parser, resolve_dtype
    from inferscale_cli.serve import DEFAULT_TENANT_RESERVE, _engine_config
    from serving.app import ServerState
    from serving.auth import ApiKeys

    one = {"ka": "a", "kops": {"tenant": "ops", "admin": True}}
    two = {**one, "kb": "b"}
    assert ApiKeys(one).tenants() == ["a", "ops"] and ApiKeys(one).serving_tenants() == ["a"]
    assert ApiKeys(two).serving_tenants() == ["a", "b"]
    for keys, share, reserve in ((one, 4, 0.0), (two, 2, DEFAULT_TENANT_RESERVE)):
        state = ServerState(types.SimpleNamespace(engine=types.SimpleNamespace()), api_keys=ApiKeys(keys),
                            max_waiting=4, model_names=["m"], default_max_tokens=16)
        assert state.max_waiting_per_tenant == share
        (tmp_path / "keys.json").write_text(json.dumps(keys))
        args = build_parser().parse_args(["serve", "--api-keys", str(tmp_path / "keys.json")])
        assert _engine_config(args, resolve_dtype).tenant_reserve == reserve
    args = build_parser().parse_args(["serve", "--api-keys", str(tmp_path / "keys.json"), "--tenant-reserve", "0"])
    assert _engine_config(args, resolve_dtype).tenant_reserve == 0.0
