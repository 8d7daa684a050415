"""A lost device never leaves a half-serving server: in-flight requests get 503 ``engine_fault``,
``/health`` answers 503, and ``inferscale serve`` stops and exits non-zero."""

import threading
import time

import httpx

from inferscale_jax import AsyncEngine, Engine
from tests.support.server_util import free_port
from tests.engine.test_failure_isolation import _lose_device
from tests.server.test_server_limits import ThreadedServer
from tests.support.tiny_engine import make_engine
from serving import create_app

BODY = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}


def test_in_flight_requests_get_503_and_health_reports_the_failure(monkeypatch):
    e = make_engine()
    fatal = []
    ae = AsyncEngine(e, on_fatal=fatal.append)
    with ThreadedServer(create_app(ae)) as srv:
        assert httpx.post(srv.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
        _lose_device(e, monkeypatch)
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(srv.url + "/v1/completions", json=BODY, timeout=60))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [503] * 3
        assert all(r.json()["error"]["code"] == "engine_fault" and r.headers.get("retry-after") for r in results)
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert len(fatal) == 1
    ae.shutdown()


def test_serve_exits_nonzero_when_the_engine_loses_its_device(monkeypatch, capsys):
    from inferscale_cli import main as cli

    e = make_engine()
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, *a, **k: e))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    statuses = []

    def client():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        _lose_device(e, monkeypatch)
        statuses.append(httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code)

    t = threading.Thread(target=client)
    t.start()
    # the engine must be this process's (the monkeypatched one): the single-process layout
    rc = cli.main(["serve", "--port", str(port), "--dtype", "float32", "--engine-in-process"])
    t.join(60)
    assert rc == 1 and statuses == [503]
    assert "the device failed" in capsys.readouterr().err
