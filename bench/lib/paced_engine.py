"""A model-free engine for measuring the API-server process alone (``bench/serving/api_overhead.py``).

``PacedEngine`` has the surface the engine core process uses (``submit``, ``step``,
``has_unfinished``, ``abort``, ``warmup``, ``stats``, ``close``...) and no model: every step takes
``step_ms`` of wall time (a sleep: the core process's CPU stays free) and gives every running
request one token, cycling through ordinary word tokens of the real tokenizer so the API
process detokenizes realistic text.  A request ends at its ``max_tokens``.  What is left is the
API process's own work per request and per streamed token - HTTP, validation, tokenization,
the ZMQ messages, detokenization, SSE - at the rate a GPU engine would produce tokens.
"""

from __future__ import annotations

import time
import types

from inferscale_jax.outputs import GenerationOutput, RequestMetrics
from inferscale_jax.request import RequestOutput


class PacedEngine:
    def __init__(self, model_dir: str | None, step_ms: float, max_batch: int) -> None:
        from inferscale_jax.default_model import default_model_dir
        from inferscale_jax.tokenizer import load_tokenizer
        from models import ModelConfig

        model_dir = model_dir or default_model_dir()
        self.cfg = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.bos_prefix: list[int] = []
        self.max_batch = max_batch
        self.pool = types.SimpleNamespace(num_pages=1 << 16)
        self.config = types.SimpleNamespace(page_size=16)
        self.fault = None
        self.step_s = step_ms / 1e3
        words = self.tokenizer("the engine reads each shared page once per step for every group of rows",
                               add_special_tokens=False).input_ids
        self.words = words or [1]
        # request id -> [max_tokens, generated ids, prompt length, submit time, running since, first token at]
        self.running: dict[str, list] = {}
        self.waiting: list[tuple[str, list]] = []
        self.next_t = 0.0
        self.steps = self.step_rows = self.step_tokens = 0

    # -- the engine core's calls --------------------------------------------------------------
    def submit(self, **request) -> str:
        rid = request["request_id"]
        sampling = request.get("sampling")
        max_tokens = getattr(sampling, "max_tokens", None) or 16
        prompt = request.get("prompt_token_ids") or []
        self.waiting.append((rid, [max_tokens, [], len(prompt), time.perf_counter(), None, None]))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, request_id: str):
        self.running.pop(request_id, None)
        self.waiting = [(r, s) for r, s in self.waiting if r != request_id]
        return None

    def step(self) -> list[RequestOutput]:
        now = time.perf_counter()
        if self.next_t > now:
            time.sleep(self.next_t - now)
        self.next_t = max(now, self.next_t) + self.step_s
        now = time.perf_counter()
        while self.waiting and len(self.running) < self.max_batch:
            rid, state = self.waiting.pop(0)
            state[4] = now
            self.running[rid] = state
        outs = []
        words = self.words
        for rid, state in list(self.running.items()):
            max_tokens, ids, prompt_len, t0, t_run, t_first = state
            tok = words[len(ids) % len(words)]
            ids.append(tok)
            if t_first is None:
                t_first = state[5] = time.perf_counter()
            if len(ids) < max_tokens:
                outs.append(RequestOutput(rid, [tok], False, prompt_tokens=prompt_len))
                continue
            del self.running[rid]
            e2e = time.perf_counter() - t0
            metrics = RequestMetrics(ttft_s=t_first - t0, prompt_tokens=prompt_len, generated_tokens=len(ids),
                                     e2e_s=e2e, queue_s=t_run - t0)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out = GenerationOutput(text=text, token_ids=list(ids), finish_reason="length", metrics=metrics,
                                   request_id=rid)
            outs.append(RequestOutput(rid, [tok], True, out, prompt_tokens=prompt_len))
        self.steps += 1
        self.step_rows += len(outs)
        self.step_tokens += len(outs)
        return outs

    def maybe_snapshot(self) -> None:
        pass

    def warmup(self, progress=None, first_runs: str = "now") -> dict:
        return {"buckets": 0, "seconds": 0.0}

    def warm_idle(self) -> bool:  # (no buckets: nothing to run in idle time)
        return False

    def stop_warmup(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"compiles": 0, "steps": self.steps, "step_rows": self.step_rows,
                "step_decode_rows": self.step_rows, "step_tokens": self.step_tokens,
                "running": len(self.running), "waiting": len(self.waiting)}


def build(args) -> PacedEngine:
    """The core process's engine (``inferscale_cli.serve.build_engine``'s place)."""
    import os

    return PacedEngine(args.model, float(os.environ["INFERSCALE_PACED_STEP_MS"]), args.max_batch or 256)
