#!/usr/bin/env bash
# CI: the README's plain install (`pip install -e .`, no test extra) in a fresh venv serves chat.
# Starts `inferscale serve` on the default model, sends one /v1/chat/completions request, and
# fails unless it answers 200 with an assistant message.  Usage: .ci/plain_install_chat.sh VENV
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:?usage: .ci/plain_install_chat.sh VENV}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e .
WORK="$(mktemp -d)"
PORT="$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
INFERSCALE_CACHE="$WORK/cache" "$VENV/bin/inferscale" serve --port "$PORT" --no-warmup > "$WORK/serve.log" 2>&1 &
PID=$!
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
"$VENV/bin/python" - "$PORT" "$WORK/serve.log" <<'PY'
import json, sys, time, urllib.error, urllib.request
port, log = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 600
while True:
    try:
        # The port is bound before the model loads: a probe waits in the listen backlog until
        # the server is up, so a probe timing out only means "not yet".
        if urllib.request.urlopen(base + "/health", timeout=30).status == 200:
            break
    except OSError:  # URLError, ConnectionError, TimeoutError: not up yet
        pass
    if time.monotonic() > deadline:
        sys.exit("plain install: the server did not start; log:\n" + open(log).read()[-3000:])
    time.sleep(1)
body = json.dumps({"model": "inferscale-default", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "How long is the warranty?"}]}).encode()
req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
try:
    out = json.load(urllib.request.urlopen(req, timeout=300))
except urllib.error.HTTPError as e:
    sys.exit(f"plain install: chat answered {e.code}: {e.read().decode()}")
msg = out["choices"][0]["message"]
assert msg["role"] == "assistant" and isinstance(msg["content"], str), out
print(f"plain install serves chat: {out['usage']}")
PY
