"""``serving/generation.py``'s disconnect watch: the handler's task awaits the first delta and
sends the event stream itself, and a side task cancels it when the client leaves."""

import asyncio

import pytest

from serving.generation import _EventStream, _until_disconnect


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
        got = await asyncio.wait_for(_until_disconnect(req, work()), 5)
        await asyncio.sleep(0.01)  # this task goes on: its cancellation was cleared
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
