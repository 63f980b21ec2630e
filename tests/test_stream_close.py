"""A streamed answer whose client hangs up closes its generator at once.

Starlette ends a stream on a hang-up by cancelling the sending (or by the send failing) and
leaves the body generator suspended at its `yield`: the request's end (`_sse`'s `finally`) and
`_merged`'s per-choice tasks then waited for the garbage collector, and a choice's ClientGone
was logged as an ERROR traceback ("Task exception was never retrieved") for an ordinary
hang-up of a streamed n > 1 request.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from kvguard.daemon.openai_api import ClientGone, _ClosingStreamingResponse, _merged


def _scope(spec: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "headers": []}


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
def test_a_hung_up_stream_closes_its_body_at_once(spec: str) -> None:
    """ASGI < 2.4: the hang-up comes as http.disconnect on receive while a send is stuck on
    the slow client, and Starlette cancels the sending; 2.4: the send fails. Either way the
    body, suspended at its `yield`, has run its `finally` when the response returns, not
    whenever the garbage collector (or the loop's shutdown) gets to it."""
    closed: list[bool] = []

    async def body() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
            yield "data: 3\n\n"
        finally:
            closed.append(True)

    async def run() -> list[bool]:
        first = asyncio.Event()
        chunks = 0

        async def receive() -> dict[str, Any]:
            await first.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal chunks
            if message["type"] == "http.response.body" and message.get("body"):
                chunks += 1
                first.set()
                if chunks == 2:  # the client is gone: its socket takes nothing more
                    if spec == "2.4":
                        raise OSError("connection reset by peer")
                    await asyncio.Event().wait()

        response = _ClosingStreamingResponse(body(), media_type="text/event-stream")
        try:
            await response(_scope(spec), receive, send)
        except ClientDisconnect:
            assert spec == "2.4"
        return list(closed)  # before the loop's shutdown closes what was left open

    assert asyncio.run(run()) == [True], "the body generator was left suspended"


class _Output:
    finished = False


class _Choice:
    """A choice's outputs as `_merged` reads them: the first choice has an output at once,
    the others wait, and fail with ClientGone when the client hangs up."""

    def __init__(self, index: int, gone: asyncio.Event) -> None:
        self.index, self.gone = index, gone

    async def get(self) -> Any:
        if self.index == 0:
            return _Output()
        await self.gone.wait()
        raise ClientGone()


def test_a_choice_left_waiting_logs_no_unretrieved_client_gone() -> None:
    """A streamed n > 1 request's generator left at its `yield` (the sending was cancelled)
    while its other choices' waits fail with ClientGone, then dropped: nothing is logged as
    an error when their tasks are collected."""
    errors: list[str] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, ctx: errors.append(ctx["message"])
        )
        gone = asyncio.Event()
        gen = _merged([_Choice(i, gone) for i in range(3)])  # type: ignore[misc]
        assert (await gen.__anext__())[0] == 0
        gone.set()  # the hang-up: the waiting choices fail, nobody awaits them
        for _ in range(5):
            await asyncio.sleep(0)
        # dropped in a reference cycle, as the daemon's stream is (its generator, frames and
        # context refer to each other): the collector finalises the choices' tasks before
        # the generator's own `finally` could cancel them
        cycle: list[Any] = [gen]
        cycle.append(cycle)
        del gen, cycle
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(run())
    assert not [e for e in errors if "never retrieved" in e], errors
