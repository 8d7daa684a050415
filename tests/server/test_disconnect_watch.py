"""``serving/generation.py``'s disconnect watch: the handler's task awaits the first delta and
sends the event stream itself, and a side task cancels it when the client leaves."""

import asyncio

import pytest

from serving.generation import _all, _EventStream, _until_disconnect


class FakeRequest:
    """``receive`` answers ``http.disconnect`` once ``leave`` is set."""

    def __init__(self):
        self.leave = asyncio.Event()

    async def receive(self):
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_the_answer_comes_back_in_this_task():
    async def main():
        req = FakeRequest()
        me = asyncio.current_task()

        async def work():
            assert asyncio.current_task() is me  # no task of its own
            await asyncio.sleep(0.01)
            return 7
        got = await _until_disconnect(req, work())
        await asyncio.sleep(0.01)  # the watcher is gone: nothing cancels this task later
        return got, me.cancelling()
    assert asyncio.run(main()) == (7, 0)


def test_one_awaitable_is_awaited_in_this_task_several_in_their_own():
    async def main():
        me = asyncio.current_task()

        async def where(x):
            await asyncio.sleep(0.01 * (3 - x))  # (the last finishes first: results keep their order)
            return x, asyncio.current_task() is me
        return await _all(where(i) for i in [0]), await _all(where(i) for i in range(3))
    one, several = asyncio.run(main())
    assert one == [(0, True)] and several == [(0, False), (1, False), (2, False)]


def test_a_client_leaving_cancels_the_wait_and_answers_none():
    async def main():
        req = FakeRequest()
        closed = []

        async def work():
            try:
                await asyncio.sleep(30)
            finally:
                closed.append(True)  # (the stream's generator aborts its request here)
        asyncio.get_running_loop().call_later(0.02, req.leave.set)
        got = await _until_disconnect(req, work())  # (in this very task: its cancel count is checked)
        await asyncio.sleep(0.01)  # this task goes on: its cancellation was taken back
        return got, closed, asyncio.current_task().cancelling()
    assert asyncio.run(main()) == (None, [True], 0)


def test_a_cancellation_from_elsewhere_propagates():
    async def main():
        req = FakeRequest()
        task = asyncio.ensure_future(_until_disconnect(req, asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        task.cancel()  # (a server shutting down)
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_a_shutdown_beside_a_disconnect_still_propagates():
    """The client leaving in the same turn as a shutdown's cancel, or while the cancelled work
    cleans up: the shutdown's cancellation propagates and the clean-up is not cut short."""
    async def same_turn():
        req = FakeRequest()
        task = asyncio.ensure_future(_until_disconnect(req, asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        req.leave.set()
        await asyncio.sleep(0)  # the watcher cancels the task...
        task.cancel()  # ... and so does a shutdown, before the task runs
        with pytest.raises(asyncio.CancelledError):
            await task

    async def during_cleanup():
        req, log = FakeRequest(), []

        async def work():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(0.05)  # (closing the streams)
                log.append("cleaned up")
                raise
        task = asyncio.ensure_future(_until_disconnect(req, work()))
        await asyncio.sleep(0.01)
        task.cancel()  # shutdown
        await asyncio.sleep(0.01)
        req.leave.set()  # the connection closes meanwhile
        with pytest.raises(asyncio.CancelledError):
            await task
        return log

    asyncio.run(same_turn())
    assert asyncio.run(during_cleanup()) == ["cleaned up"]


def test_a_client_leaving_while_a_write_waits_closes_the_body():
    """A slow client's write waits for the socket to drain, and the client leaves meanwhile: the
    body's generator is closed before the response returns (its ``finally`` aborts the request)."""
    async def main():
        req, drained, ended = FakeRequest(), asyncio.Event(), []

        async def body():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0)
            finally:
                ended.append(True)
        sent = [0]

        async def send(message):
            sent[0] += 1
            if sent[0] == 5:  # the write pauses (uvicorn's drain) and the client goes away
                req.leave.set()
                await drained.wait()
        asyncio.get_running_loop().call_later(0.01, drained.set)
        response = _EventStream(body(), media_type="text/event-stream")
        await response({"type": "http"}, req.receive, send)
        return list(ended), asyncio.current_task().cancelling(), response  # (the response is still referenced)
    ended, cancelling, _ = asyncio.run(main())
    assert ended == [True] and cancelling == 0


@pytest.mark.alone  # (a time bound: conftest.py)
def test_the_event_stream_is_sent_from_this_task_and_stops_when_the_client_leaves():
    async def main():
        req = FakeRequest()
        me = asyncio.current_task()
        sent, ended = [], []

        async def body():
            try:
                for i in range(1000):
                    assert asyncio.current_task() is me
                    yield f"data: {i}\n\n"
                    if i == 2:
                        req.leave.set()
                    await asyncio.sleep(0.005)
            finally:
                ended.append(True)

        async def send(message):
            sent.append(message)

        response = _EventStream(body(), media_type="text/event-stream")
        await response({"type": "http"}, req.receive, send)
        bodies = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
        return sent[0]["type"], bodies, ended, me.cancelling()
    start, bodies, ended, cancelling = asyncio.run(main())
    assert start == "http.response.start" and ended == [True] and cancelling == 0
    assert bodies[:3] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"] and len(bodies) < 10, bodies
