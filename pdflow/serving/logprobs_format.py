"""Token logprobs in OpenAI's two shapes.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...], "refusal": null}``;
- completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
  "text_offset": [...]}``, where ``top_logprobs`` also holds the chosen token (as vLLM) and an
  echoed prompt's first token has ``null`` for both (nothing predicts it).

A token's text is what it decodes to alone (vLLM's choice; a token that is part of a UTF-8
character shows as U+FFFD, its ``bytes`` as they decode).
"""

from __future__ import annotations

from collections import OrderedDict

from pdflow.messages import TokenLogprob

_CACHED = 65536


class TokenTexts:
    """Each token id's text alone, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: OrderedDict[int, str] = OrderedDict()

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._texts[token_id] = text
            if len(self._texts) > _CACHED:
                self._texts.popitem(last=False)
        return text


def _finite(value: float) -> float:
    return value if value > -1e38 else -9999.0  # JSON has no -inf (OpenAI and vLLM send -9999.0)


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, lp in zip(token_ids, logprobs):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """One choice's completion logprobs, built delta by delta (the text offsets run on)."""

    def __init__(self, texts: TokenTexts, offset: int = 0):
        self.texts, self.offset = texts, offset

    def part(self, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> dict:
        """The logprobs of ``token_ids`` (None: a token nothing scores, an echoed prompt's first)."""
        tokens, chosen, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs):
            text = self.texts(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if lp is None:
                chosen.append(None)
                tops.append(None)
                continue
            chosen.append(_finite(lp.logprob))
            top = {self.texts(i): _finite(v) for i, v in zip(lp.top_ids, lp.top_logprobs)}
            top.setdefault(text, _finite(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def joined(parts: list[dict]) -> dict:
    """Completion logprobs parts (as :meth:`CompletionLogprobs.part` made them) as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [v for part in parts for v in part[key]] for key in keys}
