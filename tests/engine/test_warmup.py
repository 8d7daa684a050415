"""Warm-up sets and stopping a warm-up (``buckets.py``, ``Engine.warmup``).

- the ``small`` set is decode steps of the smallest row bucket over the narrow widths and mixed
  steps of up to ``SMALL_TOKENS`` tokens, without log-probs or cascade; ``auto`` is ``small`` on the
  CPU; an unknown set name is a ``ValueError`` naming it;
- a bucket outside the small set compiles on first use, counted, logged at INFO (no warning); a
  compile of a bucket the set holds would be a warning;
- ``stop_warmup()`` from another thread (here: the progress callback) ends the warm-up after the
  compiles in flight, and a later ``warmup`` returns at once.
"""

import logging

import pytest

from inferscale_jax import SamplingParams
from inferscale_jax.buckets import SMALL_TOKENS, StepBuckets
from tests.support.tiny_engine import make_engine


def test_small_set_is_small_and_inside_the_full_one():
    b = StepBuckets(max_rows=64, max_tokens=2048, max_pages_per_seq=256, min_table_pages=4, num_logprobs=20)
    small, full = b.warmup_keys("small"), b.warmup_keys("all")
    assert set(small) < set(full) and len(small) == 5, small
    assert all(not k.num_logprobs and not k.shared for k in small)
    assert {k.rows for k in small if not k.ragged} == {8} and {k.width for k in small if not k.ragged} == {4, 32}
    assert sorted(k.tokens for k in small if k.ragged) == [32, 64, SMALL_TOKENS]
    assert not any(k.num_logprobs for k in b.warmup_keys("all", logprobs=False))
    with pytest.raises(ValueError, match="'everything'"):
        b.warmup_keys("everything")


def test_auto_is_small_on_the_cpu_and_later_buckets_compile_quietly(caplog):
    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="buckets='some'"):
        e.warmup(buckets="some")
    info = e.warmup(progress_bar=False)
    assert info["buckets"] == len(e.runner.buckets.warmup_keys("small")) and not info["stopped"]
    assert e.stats()["warm"] and e.stats()["compiles_after_warmup"] == 0
    with caplog.at_level(logging.INFO, logger="inferscale.runner"):
        # log-probs: steps with the log-prob columns, outside the small set
        out = e.generate(prompt_token_ids=list(range(1, 40)),
                         sampling=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1))
    assert out.finish_reason == "length"
    assert e.stats()["compiles_after_warmup"] >= 1
    assert any("outside the warm-up set" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_stop_warmup_ends_it_after_the_compiles_in_flight():
    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    total = len(e.runner.buckets.warmup_keys("all"))
    seen = []

    def progress(done, n):
        seen.append(done)
        e.stop_warmup()  # as serve's shutdown does, from another thread

    info = e.warmup(progress, buckets="all", progress_bar=False)
    assert info["stopped"] and 1 <= info["buckets"] < total, (info, total)
    again = e.warmup(buckets="all", progress_bar=False)
    assert again["stopped"] and again["buckets"] == info["buckets"]  # nothing new was started


def test_a_stopped_warmup_with_an_executable_store_keeps_what_compiled(tmp_path):
    """With an executable store the compiled steps are saved on the compile pool; a stop during
    the warm-up still keeps (and saves) the compiles that finish after it, and a second engine
    over the same store loads those instead of compiling them."""
    from inferscale_jax.exe_store import ExecutableStore, fingerprint

    def engine():
        e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
        r = e.runner
        r.exe_store = ExecutableStore(str(tmp_path), fingerprint(r.params, r.cache, r.cfg, [r.device]))
        return e

    e = engine()
    info = e.warmup(lambda done, n: e.stop_warmup(), buckets="all", progress_bar=False)
    assert info["stopped"] and info["buckets"] >= 1
    store = e.runner.exe_store
    assert store.saves == info["buckets"] and store.failures == 0, (store.saves, store.failures, info)
    again = engine()
    done = again.warmup(buckets="all", progress_bar=False)
    assert again.runner.exe_store.loads == info["buckets"] and not done["stopped"]
    assert done["store_s"] > 0 and done["buckets"] >= info["buckets"]


def test_an_error_in_the_warmup_starts_no_more_compiles(monkeypatch):
    """An exception during the warm-up (Ctrl-C in precompute) cancels the compiles not started:
    the pool's exit waits only for the one running (one worker; each compile takes 2 s here, and
    the interrupt comes while the fourth bucket lowers)."""
    import time

    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    lower, started = e.runner._lower, []

    class Slow:
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self, compiler_options=None):  # (the runner passes its options: xla_options.py)
            started.append(1)
            time.sleep(2)
            return self.lowered.compile(compiler_options=compiler_options)

    def lower_then_interrupt(key, args):
        if len(lowered) == 3:
            raise KeyboardInterrupt
        lowered.append(key)
        return Slow(lower(key, args))

    lowered = []
    monkeypatch.setattr(e.runner, "_lower", lower_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        e.runner.warmup(e.runner.buckets.warmup_keys("all"), workers=1)
    assert len(lowered) == 3 and len(started) == 1, (lowered, started)


def test_first_runs_left_for_idle_time(monkeypatch):
    """``first_runs="idle"``: the warm-up compiles every bucket but leaves their first runs (on an
    accelerator; the runner is told it is on one) to ``warm_idle``, which runs one bucket at a
    time only while no request is unfinished; a bucket's first real step takes it off the list, and
    the padding runs count in no serving statistic."""
    import time
    import types

    from inferscale_jax import sharding

    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    monkeypatch.setattr(e.runner, "device", types.SimpleNamespace(platform="gpu"))
    monkeypatch.setattr(sharding, "mesh_stats", lambda mesh, device: {})  # (stats() on the stand-in device)
    with pytest.raises(ValueError, match="first_runs='later'"):
        e.warmup(first_runs="later", progress_bar=False)
    info = e.warmup(buckets="small", progress_bar=False, first_runs="idle")
    keys = e.runner.buckets.warmup_keys("small")
    assert info["buckets"] == len(keys) and info["first_runs_s"] == 0.0
    assert e.first_runs_left == len(keys) and list(e.runner.first_runs) == keys
    assert e.stats()["first_runs_left"] == len(keys)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rid = e.submit(prompt_token_ids=list(range(1, 12)), sampling=sp)
    assert not e.warm_idle() and e.first_runs_left == len(keys)  # a request unfinished: nothing runs
    ran = []
    real = e.runner.dispatch
    monkeypatch.setattr(e.runner, "dispatch", lambda plan, *a, **kw: ran.append(plan) or real(plan, *a, **kw))
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert ran and e.first_runs_left < len(keys)  # the request's own buckets ran for real
    assert e.stats()["first_runs_left"] == e.first_runs_left
    b = e.runner.buckets
    counts, left = (b.real_tokens, b.padded_tokens, b.real_rows, b.padded_rows), e.first_runs_left
    ran.clear()
    e._stepped_at = time.monotonic()  # (as if the last step had just ended: a busy machine may be slower)
    assert not e.warm_idle() and not ran  # within IDLE_QUIET_S of the last step: a next request may come
    e._stepped_at -= e.IDLE_QUIET_S
    while e.warm_idle():
        pass
    assert e.first_runs_left == 0 and len(ran) == left > 0  # one padding step per bucket left
    assert e.stats()["first_runs_left"] == 0
    assert all(not any(r.tokens) and not any(r.pages) for plan in ran for r in plan.rows)  # the null page only
    assert not e.warm_idle()
    assert (b.real_tokens, b.padded_tokens, b.real_rows, b.padded_rows) == counts
    again = e.generate(prompt_token_ids=list(range(1, 12)), sampling=sp).token_ids
    assert again == [o for out in outs if out.request_id == rid for o in out.new_token_ids]


def test_idle_first_runs_read_a_step_left_in_flight(monkeypatch):
    """A request that stops on a token leaves a step in flight with a row computed for nothing
    (overlap); ``warm_idle`` reads it first, then runs the bucket."""
    import types

    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    monkeypatch.setattr(e.runner, "device", types.SimpleNamespace(platform="gpu"))
    e.warmup(buckets="small", progress_bar=False, first_runs="idle")
    left = e.first_runs_left
    greedy = e.generate(prompt_token_ids=list(range(1, 12)),
                        sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).token_ids
    out = e.generate(prompt_token_ids=list(range(1, 12)),
                     sampling=SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[greedy[3]]))
    assert out.finish_reason == "stop" and e.loop.inflight is not None and not e.has_unfinished()
    assert 0 < e.first_runs_left < left
    e._stepped_at -= e.IDLE_QUIET_S
    while e.warm_idle():
        pass
    assert e.first_runs_left == 0 and e.loop.inflight is None


def test_the_serving_loop_runs_the_first_runs_while_idle(monkeypatch):
    """``AsyncEngine.start_warmup`` (serve's in-process path; the core process's loop does the same)
    leaves the first runs to its idle loop: they are all done soon after the warm-up with no
    request, and a request meanwhile is served as usual."""
    import asyncio
    import functools
    import time
    import types

    from inferscale_jax import AsyncEngine, Engine

    e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
    monkeypatch.setattr(e.runner, "device", types.SimpleNamespace(platform="gpu"))
    monkeypatch.setattr(e, "warmup", functools.partial(Engine.warmup, e, buckets="small", progress_bar=False))
    ae = AsyncEngine(e)
    try:
        ae.start_warmup()
        end = time.monotonic() + 120
        while (ae.warming is not None or e.first_runs_left) and time.monotonic() < end:
            time.sleep(0.05)
        assert ae.warming is None and e.first_runs_left == 0 and e.runner.warm

        async def one():
            return await ae.generate(prompt_token_ids=list(range(1, 12)),
                                     sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(asyncio.run(one()).token_ids) == 3
    finally:
        ae.shutdown()


def test_serve_first_runs_now_or_idle(monkeypatch):
    """``serve --first-runs``: ``AsyncEngine.start_warmup("now")`` makes every bucket's first run
    inside the warm-up (none left when ``/health`` would turn 200), ``"idle"`` leaves them all to the
    idle loop (here kept from running); the engine core passes its message's choice on; a bad
    value is refused by name."""
    import functools
    import time
    import types

    from inferscale_jax import AsyncEngine, Engine
    from inferscale_jax.engine_core import EngineCore

    left = {}
    for first_runs in ("idle", "now"):
        e = make_engine(pages=128, max_batch=8, max_num_batched_tokens=256)
        monkeypatch.setattr(e.runner, "device", types.SimpleNamespace(platform="gpu"))
        monkeypatch.setattr(e, "warmup", functools.partial(Engine.warmup, e, buckets="small", progress_bar=False))
        monkeypatch.setattr(e, "warm_idle", lambda: False)  # (the idle loop makes none here)
        ae = AsyncEngine(e)
        try:
            ae.start_warmup(first_runs)
            end = time.monotonic() + 120
            while ae.warming is not None and time.monotonic() < end:
                time.sleep(0.05)
            assert ae.warming is None and e.runner.warm
            left[first_runs] = e.first_runs_left
        finally:
            ae.shutdown()
    assert left["idle"] == len(e.runner.buckets.warmup_keys("small")) > 0 and left["now"] == 0, left
    with pytest.raises(ValueError, match="first_runs='later'"):
        AsyncEngine.start_warmup(types.SimpleNamespace(), "later")

    asked = []
    stub = types.SimpleNamespace(warmup=lambda progress, first_runs: asked.append(first_runs) or
                                 {"buckets": 0, "seconds": 0.0})
    core = EngineCore(stub, sock=None)
    core.handle(b"api", ["warmup", "now"])
    core.handle(b"api", ["warmup"])  # (a message without the choice: the default)
    assert asked == ["now", "idle"]


@pytest.mark.parametrize("mode", ["max", "fit", ""])
def test_every_bucket_of_the_full_set_has_a_padding_step(monkeypatch, mode):
    """The warm-up compiles a bucket by running a padding step that maps back to it; with
    ``INFERSCALE_MIXED_GROUPS=fit`` (the default) a 64-row mixed step's 64-group bucket needs 17 groups
    of padding rows (16 fit the 16-group bucket), so every bucket of the ``all`` set must still get one."""
    monkeypatch.setenv("INFERSCALE_MIXED_GROUPS", mode)
    e = make_engine(pages=128, max_batch=64, max_num_batched_tokens=256, cascade_decode=True)
    keys = e.runner.buckets.warmup_keys("all")
    assert {k.groups for k in keys if k.ragged and k.shared and k.rows == 64} == ({64} if mode == "max" else {16, 64})
    missing = [k for k in keys if e.runner._padding_rows(k) is None]
    assert not missing, missing
