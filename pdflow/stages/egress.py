"""egress: an optional stage that turns each request's tokens into text, applies stop strings and
streams the text on: detokenizing moved off ingress, or text that must pass through stages of
its own (a redactor) before it reaches the client.

By default there is none: prefill and decode send their tokens straight to ingress, which
detokenizes them itself (one control hop per token). A pipeline with a stage of kind ``egress``
sends them here instead (:func:`pdflow.config.pipeline.route_tokens_through`): output ``text``
goes to ingress, unless a pipeline puts a stage in between; a stop string that matches while
decode is still going tells output ``stop`` (the stage that decodes) to stop. The work itself,
migration's seam included, is :class:`pdflow.serving.text_stream.TextStream`'s.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdflow.tokenizing import load_serving_tokenizer
from pdflow.messages import EgressRequest, StopRequest, Tokens
from pdflow.runtime.stage import Stage, Submission
from pdflow.serving.text_stream import TextStream


@dataclass(slots=True, eq=False)
class _Stream:
    request: EgressRequest
    text: TextStream

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
        self.tokenizer, why = await asyncio.to_thread(load_serving_tokenizer, self.ctx.model_dir)
        if why:
            self.log.info("tokenizer.transformers", reason=why)

    def handlers(self):
        return {EgressRequest: self.on_request, Tokens: self.on_tokens}

    def on_request(self, message: EgressRequest) -> None:
        text = TextStream(message.request_id, self.tokenizer, message.stop, message.skip_special_tokens,
                          message.resume_ids, message.resume_chars)
        self.requests.open(message.request_id, _Stream(message, text))

    async def on_tokens(self, message: Tokens) -> None:
        stream: _Stream = self.requests.get(message.request_id)
        deltas, stop = stream.text.add(message)
        route = stream.request.route
        if stop:
            await self.send_output("stop", route, StopRequest(message.request_id))
        for delta in deltas:
            if delta.finish_reason is not None:
                self.finish(message.request_id)
            await self.send_output("text", route, delta)
