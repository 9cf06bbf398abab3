"""A streaming response that finishes its body generator however the response ends.

Starlette's ``StreamingResponse`` (ASGI spec < 2.4, which uvicorn speaks) watches for the client's
disconnect beside the stream and cancels the sending when it comes. If that lands while a chunk is
being sent, the cancel hits the send, not the body generator: the generator stays suspended at its
``yield``, and its ``finally`` (for an answer: cancelling the request through the pipeline, so that
decode stops and kv-shuttle drops its leases) runs only when a garbage collection pass finds the
cycle it sits in, seconds or minutes later. :class:`ClosingStreamingResponse` closes the generator
as the response ends, so that ``finally`` runs then.
"""

from __future__ import annotations

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:  # (a no-op on a generator that finished)
                await close()
