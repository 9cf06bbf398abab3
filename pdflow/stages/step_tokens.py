"""Mixed into the stages that run a decode batch (decode, the colocated worker): each step's
tokens on to their requests.

The stage gives each sequence of its batch a context (``seq.context``) with the request's
``route`` and its output ``tokens`` so far, and provides ``running`` (request id -> sequence),
``model``, ``send_output`` and ``last_token(seq, now)``: what the stage does when a sequence's
token finishes it, returning the timeline its last message carries.
"""

from __future__ import annotations

import time

from pdflow.engine import Sequence
from pdflow.engine.stopping import after_decode_step, in_order
from pdflow.messages import Tokens


class SendsStepTokens:
    async def send_step_tokens(self, results: list[tuple[Sequence, int]], leaving: set[str]) -> None:
        """Send a step's ``(sequence, token)`` pairs as :class:`~pdflow.messages.Tokens`, noting
        the step in each sequence's timeline. ``leaving``: the request ids that leave the batch
        before the next step; a sequence among them (or no longer running) gets nothing more, and
        one whose token finishes it joins them."""
        now = time.monotonic()
        for seq, token, behind in in_order(results):
            if seq.request_id not in self.running or seq.request_id in leaving:
                continue
            reason = after_decode_step(seq, token, self.model, now, behind)
            context = seq.context
            context.tokens.append(token)
            timeline = {}
            if reason is not None:
                leaving.add(seq.request_id)
                timeline = self.last_token(seq, now)
            message = Tokens(seq.request_id, seq.generated - 1 - behind, [token], reason, timeline,
                             draft_proposed=seq.proposed, draft_accepted=seq.accepted,
                             logprobs=seq.sampler.take_logprobs())
            await self.send_output("tokens", context.route, message)
