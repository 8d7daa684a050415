"""Overlapped decode (EngineConfig.overlap_decode): the next decode step is dispatched before the
previous one is read, its tokens fed on the device.  Outputs must equal the synchronous
scheduler's (tokens and finish reasons exactly; logprobs within float32 rounding, since an ignored row
or a row finishing one step earlier can put a step in another batch bucket), including requests that end on a stop token (one extra row computed and
ignored), preemption (which drains the in-flight step first) and aborts while a step is in flight."""

import numpy as np

from inferscale_jax import SamplingParams
from tests.core.test_scheduler import mixed_requests, register
from tests.support.tiny_engine import assert_only_nodes_hold_pages, make_engine


def stopping_requests(rng, n=8):
    """Sampled requests with common stop ids: most end early on a stop token, mid-batch."""
    return [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, int(rng.integers(2, 20)))],
                 sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True,
                                         stop_token_ids=[3, 7, 11, 19, 23], logprobs=2))
            for i in range(n)]


def run(reqs, overlap, pages=256, segments=True):
    engine = make_engine(pages=pages, overlap_decode=overlap)
    if segments:
        register(engine)
    free0 = engine.pool.num_free
    outs = engine.generate_batch(reqs)
    return engine, outs, free0


# Another batch bucket is another matmul shape, so XLA's CPU kernels sum in another order: on an AVX-512
# host (jax 0.10.2) logprobs near -2.8 differed by 1.1e-5 (about 47 float32 ulps), past the 1e-5 this test had.
# Stale KV or a wrong row moves them by 1e-2 and more, and changes tokens, which must match exactly.
LOGPROB_TOL = 1e-4


def assert_identical(a, b):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert (a.logprobs is None) == (b.logprobs is None)
    for x, y in zip(a.logprobs or [], b.logprobs or []):
        assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < LOGPROB_TOL


def test_overlap_equals_sync_on_mixed_and_stopping_requests():
    rng = np.random.default_rng(7)
    reqs = mixed_requests(rng) + stopping_requests(rng)
    _, sync, _ = run(reqs, overlap=False)
    engine, over, _ = run(reqs, overlap=True)
    for a, b in zip(over, sync):
        assert_identical(a, b)
    reasons = [o.finish_reason for o in over]
    assert reasons.count("stop") >= 3 and "length" in reasons  # both end paths were taken
    assert_only_nodes_hold_pages(engine)  # the ignored rows of stopped requests leaked nothing
    assert engine.loop.inflight is None or all(
        o.status == "finished" for o, _, _ in engine.loop.inflight[1].entries)


def preempting_requests(seed=3):
    """Eight sampled 20 + 20-token requests: more than a 12-page pool holds (preemptions)."""
    rng = np.random.default_rng(seed)
    return [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, 20)],
                 sampling=SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True,
                                         stop_token_ids=[5]))
            for i in range(8)]


def test_overlap_with_preemption_matches_sync():
    reqs = preempting_requests()
    _, sync, _ = run(reqs, overlap=False, pages=12, segments=False)
    engine, over, free0 = run(reqs, overlap=True, pages=12, segments=False)
    for a, b in zip(over, sync):
        assert_identical(a, b)
    assert engine.stats()["preemptions"] > 0
    engine.check_invariants()
    assert engine.pool.num_free == free0  # no leak


def test_abort_while_a_step_is_in_flight_frees_pages_at_once():
    rng = np.random.default_rng(5)
    reqs = [dict(prompt_token_ids=[int(x) for x in rng.integers(1, 97, 9)],
                 sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for _ in range(3)]
    alone = make_engine(pages=64)
    want = [alone.generate(**r) for r in reqs]
    engine = make_engine(pages=64)
    free0 = engine.pool.num_free
    ids = [engine.submit(**r) for r in reqs]
    while engine.loop.inflight is None:
        engine.step()
    assert ids[1] in {o.id for o, _, _ in engine.loop.inflight[1].entries}
    before = engine.pool.num_free
    out = engine.abort(ids[1])
    assert out.finished and out.output.finish_reason == "abort"
    assert engine.pool.num_free > before  # its pages came back before the in-flight step was read
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.output
    for i in (0, 2):
        assert got[ids[i]].token_ids == want[i].token_ids
    assert ids[1] not in got  # no token or second finish for the aborted request
    engine.step()  # settles whatever is still in flight
    assert engine.pool.num_free == free0


def test_stable_input_buffers_give_the_same_outputs():
    """``ModelRunner.stable_inputs`` (the default: step inputs refilled in place, the token feed
    inside the refill) computes exactly what fresh input buffers every step compute."""
    rng = np.random.default_rng(11)
    reqs = mixed_requests(rng) + stopping_requests(rng)
    plain = make_engine(pages=256, overlap_decode=True)
    plain.runner.stable_inputs = False
    register(plain)
    ref = plain.generate_batch(reqs)
    assert not plain.runner._staged  # the fresh-buffer path ran
    engine = make_engine(pages=256, overlap_decode=True)
    assert engine.runner.stable_inputs
    register(engine)
    got = engine.generate_batch(reqs)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs
    assert engine.runner._staged  # the staged path ran
    assert_only_nodes_hold_pages(engine)
