"""One request's tokens in, the client's text out: what ingress (by default) or an egress stage
does with the :class:`~pdflow.messages.Tokens` that prefill and decode send.

Tokens come from prefill (the first) and decode (the rest) over different sockets, so they are
put back in order by their index before they are detokenized (incrementally: a character that
spans tokens comes out once it is whole) and checked for stop strings (which may span tokens).

A request that migrated after a failure arrives with the tokens generated before
(``resume_ids``): they go through the detokenizer and the stop strings again, so that the text at
the seam is exactly what an uninterrupted stream would give, and the first ``resume_chars``
characters of what comes out, which the client already has, are not sent again.
"""

from __future__ import annotations

from typing import Any

from pdflow.messages import TextDelta, Tokens
from pdflow.serving.detokenizer import IncrementalDetokenizer
from pdflow.serving.stop_strings import StopStringMatcher


class TextStream:
    """``add(tokens)`` -> the :class:`TextDelta` messages they complete, and whether the stage
    still generating must be told to stop (a stop string matched before it finished)."""

    __slots__ = ("request_id", "detokenizer", "matcher", "next_index", "completion_tokens", "cached_tokens",
                 "pending", "unreported", "skip_chars", "pending_text", "finished", "drafts", "unreported_logprobs",
                 "prompt_logprobs", "resumed")

    def __init__(self, request_id: str, tokenizer: Any, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 resume_ids: tuple[int, ...] | list[int] = (), resume_chars: int = 0):
        self.request_id = request_id
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.matcher = StopStringMatcher(stop)
        self.next_index = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # from the first Tokens: prompt tokens whose KV came from the store
        self.pending: dict[int, Tokens] = {}  # arrived ahead of their turn, by index
        self.unreported: list[int] = []  # tokens since the last TextDelta
        self.unreported_logprobs: list = []  # their logprobs, where the request asked for them
        self.prompt_logprobs: list = []  # the prompt's (from the first Tokens), until the first TextDelta
        self.resumed = bool(resume_ids)  # (a migrated request's prompt logprobs score another prompt: dropped)
        self.skip_chars = resume_chars  # text the client already has (a migrated request)
        self.pending_text = ""  # rebuilt text of a migrated request not yet sent
        self.finished = False
        self.drafts = (0, 0)  # speculative decoding: draft tokens verified and kept, the latest totals
        if resume_ids:  # rebuild the detokenizer's and the matcher's state; send only what is new
            self.completion_tokens = len(resume_ids)
            self.pending_text = self._unsent(self.matcher.feed(self.detokenizer.add(list(resume_ids)))[0])

    def add(self, tokens: Tokens) -> tuple[list[TextDelta], bool]:
        if self.finished:
            return [], False
        self.pending[tokens.index] = tokens
        deltas, stop = [], False
        while not self.finished and self.next_index in self.pending:
            ready = self.pending.pop(self.next_index)
            self.next_index += len(ready.token_ids)
            delta, stopped = self._emit(ready)
            stop |= stopped
            if delta is not None:
                deltas.append(delta)
        return deltas, stop

    def _unsent(self, text: str) -> str:
        """``text`` less what the client already has."""
        skipped = min(self.skip_chars, len(text))
        self.skip_chars -= skipped
        return text[skipped:]

    def _emit(self, tokens: Tokens) -> tuple[TextDelta | None, bool]:
        self.completion_tokens += len(tokens.token_ids)
        self.unreported.extend(tokens.token_ids)
        self.unreported_logprobs.extend(tokens.logprobs)
        if tokens.index == 0 and tokens.prompt_logprobs and not self.resumed:
            self.prompt_logprobs = tokens.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, tokens.cached_tokens)
        self.drafts = max(self.drafts, (tokens.draft_proposed, tokens.draft_accepted))
        text, stopped = self.matcher.feed(self.detokenizer.add(tokens.token_ids))
        text = self.pending_text + self._unsent(text)
        self.pending_text = ""
        reason = tokens.finish_reason
        stop_producer = False
        if stopped:
            reason = "stop"
            stop_producer = tokens.finish_reason is None  # still generating: it must be told
        elif reason is not None:
            text += self._unsent(self.matcher.feed(self.detokenizer.flush())[0] + self.matcher.flush())
        if reason is None and not text:
            return None, False
        self.finished = reason is not None
        delta = TextDelta(self.request_id, text, self.completion_tokens, reason, tokens.timeline,
                          self.cached_tokens, self.unreported, *self.drafts, self.unreported_logprobs,
                          self.prompt_logprobs)
        self.unreported, self.unreported_logprobs, self.prompt_logprobs = [], [], []
        return delta, stop_producer
