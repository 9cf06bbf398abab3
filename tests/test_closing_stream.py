"""A streamed answer's generator is finished as the response ends, however it ends: a client that
goes while a chunk is being sent cancels its request then, not at the next garbage collection."""

from __future__ import annotations

import asyncio
import gc

import pytest
from starlette.responses import StreamingResponse

from pdflow.serving.closing_stream import ClosingStreamingResponse


def _gone_while_sending(response_class, spec_version: str) -> list[str]:
    """Serve a two-chunk stream to a client that disconnects while the first chunk is being sent;
    what the body generator did by the time the response returned (no collection pass meanwhile)."""
    events: list[str] = []

    async def body():
        try:
            yield b"first"
            await asyncio.sleep(30)
            yield b"second"
        finally:
            events.append("finally")

    async def main() -> list[str]:
        response = response_class(body(), media_type="text/event-stream")
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message.get("body") == b"first":
                gone.set()
                await asyncio.sleep(0.05)  # the disconnect lands while this chunk is on its way
                if spec_version == "2.4":
                    raise OSError("connection reset")

        with pytest.raises(Exception) if spec_version == "2.4" else _nothing():
            await response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)
        return [*events, "returned"]  # (asyncio.run finishes any generator left when it ends)

    gc.disable()
    try:
        return asyncio.run(main())
    finally:
        gc.enable()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_client_gone_mid_chunk_finishes_the_generator_before_the_response_returns(spec_version):
    assert _gone_while_sending(ClosingStreamingResponse, spec_version) == ["finally", "returned"]


def test_starlettes_own_response_leaves_it_suspended_the_case_this_guards():
    """If Starlette ever closes the generator itself, this fails and the subclass can go."""
    assert _gone_while_sending(StreamingResponse, "2.3") == ["returned"]


def test_a_stream_that_ends_normally_is_served_whole():
    sent: list[bytes] = []

    async def body():
        yield b"a"
        yield b"b"

    async def main() -> None:
        async def receive():
            await asyncio.sleep(30)

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        await ClosingStreamingResponse(body())({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(main())
    assert sent == [b"a", b"b", b""]
