"""egress: turns each request's tokens into text, applies stop strings, and streams the text on.

Tokens come from prefill (the first) and decode (the rest) over different sockets, so they are
put back in order by their index before detokenizing. The text goes to output ``text`` (ingress,
unless a pipeline puts a stage in between); a stop string that matches while decode is still
going tells output ``stop`` (the stage that decodes) to stop.

A request that migrated after a failure (see ingress) arrives with the tokens generated before
(``resume_ids``): they go through the detokenizer and the stop strings again, so that the text at
the seam is exactly what an uninterrupted stream would give, and the first ``resume_chars``
characters of what comes out, which the client already has, are not sent again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdflow.engine import load_tokenizer
from pdflow.messages import EgressRequest, StopRequest, TextDelta, Tokens
from pdflow.runtime.stage import Stage, Submission
from pdflow.serving.detokenizer import IncrementalDetokenizer
from pdflow.serving.stop_strings import StopStringMatcher


@dataclass(slots=True, eq=False)
class _Stream:
    request: EgressRequest
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    next_index: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # from the first Tokens: prompt tokens whose KV came from the store
    pending: dict[int, Tokens] = field(default_factory=dict)
    unreported: list[int] = field(default_factory=list)  # tokens since the last TextDelta
    skip_chars: int = 0  # text the client already has (a migrated request)
    pending_text: str = ""  # rebuilt text of a migrated request not yet sent

    @property
    def route(self):
        return self.request.route


class EgressStage(Stage):
    kind = "egress"
    outputs = {"text": "ingress", "stop": "decode"}
    opens = (EgressRequest,)

    @classmethod
    def admission(cls, submission: Submission, name: str) -> EgressRequest:
        s = submission
        return EgressRequest(s.request_id, len(s.prompt_ids), s.sampling.max_tokens, s.stop,
                             s.skip_special_tokens, s.route, list(s.resume_ids), s.resume_chars)

    async def setup(self) -> None:
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.ctx.model_dir)

    def handlers(self):
        return {EgressRequest: self.on_request, Tokens: self.on_tokens}

    def on_request(self, message: EgressRequest) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=message.skip_special_tokens)
        stream = _Stream(message, detokenizer, StopStringMatcher(message.stop), skip_chars=message.resume_chars)
        if message.resume_ids:  # rebuild the detokenizer's and the matcher's state; send only what is new
            stream.completion_tokens = len(message.resume_ids)
            stream.pending_text = self._unsent(stream, stream.matcher.feed(detokenizer.add(message.resume_ids))[0])
        self.requests.open(message.request_id, stream)

    @staticmethod
    def _unsent(stream: _Stream, text: str) -> str:
        """``text`` less what the client already has."""
        skipped = min(stream.skip_chars, len(text))
        stream.skip_chars -= skipped
        return text[skipped:]

    async def on_tokens(self, message: Tokens) -> None:
        stream: _Stream = self.requests.get(message.request_id)
        stream.pending[message.index] = message
        while stream.next_index in stream.pending and message.request_id in self.requests:
            tokens = stream.pending.pop(stream.next_index)
            stream.next_index += len(tokens.token_ids)
            await self._emit(stream, tokens)

    async def _emit(self, stream: _Stream, tokens: Tokens) -> None:
        request = stream.request
        stream.completion_tokens += len(tokens.token_ids)
        stream.unreported.extend(tokens.token_ids)
        stream.cached_tokens = max(stream.cached_tokens, tokens.cached_tokens)
        text, stopped = stream.matcher.feed(stream.detokenizer.add(tokens.token_ids))
        text = stream.pending_text + self._unsent(stream, text)
        stream.pending_text = ""
        reason = tokens.finish_reason
        if stopped:
            reason = "stop"
            if tokens.finish_reason is None:  # decode is still going: tell it to stop
                await self.send_output("stop", request.route, StopRequest(request.request_id))
        elif reason is not None:
            text += self._unsent(stream, stream.matcher.feed(stream.detokenizer.flush())[0] + stream.matcher.flush())
        if reason is None and not text:
            return
        if reason is not None:
            self.finish(request.request_id)
        delta = TextDelta(request.request_id, text, stream.completion_tokens, reason, tokens.timeline,
                          stream.cached_tokens, stream.unreported)
        stream.unreported = []
        await self.send_output("text", request.route, delta)
