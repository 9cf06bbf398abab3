"""egress: turns each request's tokens into text, applies stop strings, and streams to ingress.

Tokens come from prefill (the first) and decode (the rest) over different sockets, so they are
put back in order by their index before detokenizing.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from pdflow.serving.detokenizer import IncrementalDetokenizer
from pdflow.engine import load_tokenizer
from pdflow.messages import Cancel, EgressRequest, StopRequest, TextDelta, Tokens
from pdflow.runtime.stage import Stage
from pdflow.serving.stop_strings import StopStringMatcher

_FINISHED_MEMORY = 10_000


@dataclass(slots=True, eq=False)
class _Stream:
    request: EgressRequest
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    next_index: int = 0
    completion_tokens: int = 0
    pending: dict[int, Tokens] = field(default_factory=dict)


class EgressStage(Stage):
    name = "egress"

    async def setup(self) -> None:
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.ctx.model_dir)
        self.streams: dict[str, _Stream] = {}
        self.early: dict[str, list[Tokens]] = {}  # tokens that beat their EgressRequest here
        self.finished: OrderedDict[str, None] = OrderedDict()  # late tokens for these are dropped

    def handlers(self):
        return {EgressRequest: self.on_request, Tokens: self.on_tokens, Cancel: self.on_cancel}

    def in_flight(self) -> int:
        return len(self.streams)

    async def on_request(self, message: EgressRequest) -> None:
        stream = _Stream(
            message,
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=message.skip_special_tokens),
            StopStringMatcher(message.stop),
        )
        self.streams[message.request_id] = stream
        for tokens in self.early.pop(message.request_id, ()):
            await self.on_tokens(tokens)

    def on_cancel(self, message: Cancel) -> None:
        self.streams.pop(message.request_id, None)
        self.early.pop(message.request_id, None)
        self._remember_finished(message.request_id)

    def _remember_finished(self, request_id: str) -> None:
        self.finished[request_id] = None
        while len(self.finished) > _FINISHED_MEMORY:
            self.finished.popitem(last=False)

    async def on_tokens(self, message: Tokens) -> None:
        stream = self.streams.get(message.request_id)
        if stream is None:
            if message.request_id in self.finished:
                return
            self.early.setdefault(message.request_id, []).append(message)
            return
        stream.pending[message.index] = message
        while stream.next_index in stream.pending and message.request_id in self.streams:
            tokens = stream.pending.pop(stream.next_index)
            stream.next_index += len(tokens.token_ids)
            await self._emit(stream, tokens)

    async def _emit(self, stream: _Stream, tokens: Tokens) -> None:
        request = stream.request
        stream.completion_tokens += len(tokens.token_ids)
        text, stopped = stream.matcher.feed(stream.detokenizer.add(tokens.token_ids))
        reason = tokens.finish_reason
        if stopped:
            reason = "stop"
            if tokens.finish_reason is None:  # decode is still going: tell it to stop
                await self.bus.send(self.topology.decoder, request.route.decode, StopRequest(request.request_id))
        elif reason is not None:
            text += stream.matcher.feed(stream.detokenizer.flush())[0] + stream.matcher.flush()
        if reason is None and not text:
            return
        delta = TextDelta(request.request_id, text, stream.completion_tokens, reason, tokens.timeline)
        await self.bus.send("ingress", request.route.ingress, delta)
        if reason is not None:
            del self.streams[request.request_id]
            self._remember_finished(request.request_id)
