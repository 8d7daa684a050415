"""``AsyncEngine.stream``: text deltas that concatenate to the final text, and prompt/segment text
tokenized before the engine loop sees the request."""

import asyncio
import copy
import threading

import pytest

from inferscale_jax import AsyncEngine, Engine, EngineConfig, SamplingParams
from inferscale_jax.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(None, EngineConfig(dtype="float32", hbm_pages=256))


def _stream(ae, **request):
    async def main():
        deltas = []
        async for d in ae.stream(**request):
            deltas.append(d)
        return deltas
    return asyncio.run(main())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_deltas_concatenate_to_the_output_text(engine, seed):
    ae = AsyncEngine(engine)
    try:
        sp = SamplingParams(max_tokens=40, temperature=1.0, seed=seed)
        deltas = _stream(ae, prompt="Q: Ünïcödé ✓ and the warranty? A:", sampling=sp)
        out = deltas[-1].output
        assert "".join(d.text for d in deltas) == out.text
        assert len(out.token_ids) > 1 and sum(bool(d.text) for d in deltas) > 1  # incremental, not all at the end
        assert not any(d.text.endswith("\ufffd") for d in deltas[:-1]) or out.text.count("\ufffd")
    finally:
        ae.shutdown()


def test_text_deltas_never_show_a_stop_string_the_output_cuts(engine):
    ae = AsyncEngine(engine)
    try:
        sp = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
        free = _stream(ae, prompt="Once", sampling=sp)[-1].output.text
        stop = free[len(free) // 2: len(free) // 2 + 3]  # a string the unconstrained output contains
        assert len(stop) == 3
        sp = SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop=[stop])
        deltas = _stream(ae, prompt="Once", sampling=sp)
        out = deltas[-1].output
        assert out.finish_reason == "stop" and stop not in out.text
        assert "".join(d.text for d in deltas) == out.text
    finally:
        ae.shutdown()


def test_incremental_detokenizer_matches_whole_decoding_byte_by_byte(engine):
    tok = engine.tokenizer
    ids = tok.encode("héllo wörld ✓✓ 日本語 ok", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a multi-byte character is never split


def test_prompt_and_segment_text_are_tokenized_off_the_engine_loop(engine, monkeypatch):
    ae = AsyncEngine(engine)
    seen = []
    real_submit, real_register = engine.submit, engine.register_segment

    def submit(**kw):
        seen.append(("submit", threading.current_thread().name, set(kw)))
        return real_submit(**kw)

    def register(*a, **kw):
        seen.append(("register", threading.current_thread().name, set(kw)))
        return real_register(*a, **kw)
    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "register_segment", register)
    try:
        asyncio.run(ae.register_segment("kb", text="Warranty: three years. " * 20, tenant="t"))
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        streamed = _stream(ae, prompt="Q: how long? A:", segments=["kb"], tenant="t", sampling=sp)[-1].output
    finally:
        ae.shutdown()
    # the engine thread received token ids, never text
    assert seen[0][0] == "register" and "token_ids" in seen[0][2] and "text" not in seen[0][2]
    assert seen[1][0] == "submit" and "prompt_token_ids" in seen[1][2] and "prompt" not in seen[1][2]
    assert {s[1] for s in seen} == {"inferscale-engine"}
    monkeypatch.undo()
    direct = engine.generate(prompt="Q: how long? A:", segments=["kb"], tenant="t", sampling=sp)
    assert streamed.token_ids == direct.token_ids
    engine.delete_segment("kb", tenant="t")


def test_deltas_carry_their_tokens_logprobs(engine):
    ae = AsyncEngine(engine)
    try:
        deltas = _stream(ae, prompt="Q: A:", sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=3))
    finally:
        ae.shutdown()
    out = deltas[-1].output
    streamed = [lp for d in deltas for lp in (d.logprobs or [])]
    assert streamed == out.logprobs and len(streamed) == len(out.token_ids)
    assert all(len(d.logprobs) == len(d.new_token_ids) for d in deltas if d.new_token_ids)


def _outputs(engine, prompt, sp):
    """The engine's own per-step outputs of one request (``Engine.step``), and its final output."""
    rid = engine.submit(prompt=prompt, sampling=sp)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs, outs[-1].output


@pytest.mark.parametrize("case", ["lag in the middle", "lag to the end", "error behind outputs"])
def test_a_lagging_reader_gets_the_waiting_outputs_merged(engine, case):
    """``Deltas``: outputs already on the queue when the reader comes back are one delta (ids in
    order, their log-probs, the text they make; a finished one ends it); a reader that keeps up
    gets one delta per output; an exception queued behind outputs is raised on the next read."""
    from inferscale_jax.detokenize import Deltas

    sp = SamplingParams(max_tokens=14, temperature=1.0, seed=9, logprobs=2, stop=["\n\n"])
    outs, final = _outputs(engine, "Q: Ünïcödé and the warranty? A:", sp)
    assert len(outs) >= 10 and final.token_ids and outs[-1].finished
    # the reader takes the first output, then lags: `lagged` is all on the queue at its next read;
    # then it keeps up with `after`, one output per read
    lost = RuntimeError("lost")
    lagged, after = {"lag in the middle": (outs[1:-3], outs[-3:]), "lag to the end": (outs[1:], []),
                     "error behind outputs": (outs[1:6] + [lost], [])}[case]

    async def read():
        q = asyncio.Queue()
        def put(o):  # (a copy: a merge extends its first output in place)
            q.put_nowait(o if isinstance(o, BaseException) else copy.copy(o))
        deltas = Deltas(q, IncrementalDetokenizer(engine.tokenizer, sp.stop, sp))

        async def next_delta():
            try:
                return await deltas.__anext__()
            except RuntimeError as e:
                return e

        put(outs[0])
        got = [await next_delta()]
        for o in lagged:
            put(o)
        got.append(await next_delta())
        for o in after:
            put(o)
            got.append(await next_delta())
        if case == "error behind outputs":  # the error comes on the read after the merged delta
            got.append(await next_delta())
        return got

    got = asyncio.run(read())
    merged_from = [o for o in lagged if not isinstance(o, BaseException)]
    assert got[0].new_token_ids == outs[0].new_token_ids and not got[0].finished
    assert got[1].new_token_ids == [t for o in merged_from for t in o.new_token_ids]
    assert got[1].logprobs == [lp for o in merged_from for lp in o.logprobs]
    assert len(got[1].new_token_ids) >= 4
    if case == "error behind outputs":
        assert len(got) == 3 and not got[1].finished and got[2] is lost
        return
    assert len(got) == 2 + len(after) and got[-1].finished and got[-1].output is final
    assert got[1].finished == (case == "lag to the end")
    assert [t for d in got for t in d.new_token_ids] == final.token_ids
    assert [lp for d in got for lp in d.logprobs] == final.logprobs
    assert "".join(d.text for d in got) == final.text


def test_a_steps_first_and_last_outputs_wake_their_streams_first():
    """``put_in_order``: of one step's outputs, streams' first outputs and last ones (and errors)
    wake their readers before the step's middle tokens, each stream's own outputs in order."""
    from inferscale_jax.detokenize import StreamQueue, put_in_order
    from inferscale_jax.request import RequestOutput

    fresh = StreamQueue()  # a queue that never had an output: its first is urgent, its middle ones not
    assert fresh.urgent(RequestOutput("x", [1], False)) and fresh.started
    assert not fresh.urgent(RequestOutput("x", [1], False)) and fresh.urgent(RequestOutput("x", [1], True))

    async def main():
        names = ["mid", "new", "last", "mid2", "err", "twice"]
        queues = {n: StreamQueue() for n in names}
        for n in names:
            queues[n].started = n != "new"  # every stream but "new" had its first output in an earlier step
        woke = []

        async def reader(name):
            while True:
                item = await queues[name].get()
                woke.append((name, "error" if isinstance(item, BaseException) else item.new_token_ids[0]))

        tasks = [asyncio.create_task(reader(n)) for n in names]
        await asyncio.sleep(0)  # every reader waits on its queue
        put_in_order([(queues["mid"], RequestOutput("mid", [2], False)),
                      (queues["new"], RequestOutput("new", [1], False)),
                      (queues["twice"], RequestOutput("twice", [2], False)),  # held back: so is its last one
                      (queues["twice"], RequestOutput("twice", [3], True)),
                      (queues["last"], RequestOutput("last", [9], True)),
                      (queues["mid2"], RequestOutput("mid2", [2], False)),
                      (queues["err"], RuntimeError("lost"))])
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        return woke

    woke = asyncio.run(main())
    # the first output, the last one and the error before every middle token; the rest in step order
    assert woke[:3] == [("new", 1), ("last", 9), ("err", "error")], woke
    assert sorted(woke[3:], key=lambda w: w[0]) == [("mid", 2), ("mid2", 2), ("twice", 2), ("twice", 3)], woke
    assert woke[3:].index(("twice", 2)) < woke[3:].index(("twice", 3)), woke


def test_a_new_stream_with_several_outputs_in_one_step_keeps_their_order():
    from inferscale_jax.detokenize import StreamQueue, put_in_order
    from inferscale_jax.request import RequestOutput

    async def main():
        old, new = StreamQueue(), StreamQueue()
        old.started = True
        put_in_order([(old, RequestOutput("o", [5], False)), (new, RequestOutput("n", [1], False)),
                      (new, RequestOutput("n", [2], False)), (new, RequestOutput("n", [3], True))])
        return [old.get_nowait().new_token_ids], [new.get_nowait().new_token_ids for _ in range(3)]
    assert asyncio.run(main()) == ([[5]], [[1], [2], [3]])
