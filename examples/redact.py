"""A plug-in stage: redacts a word list from the text stream on its way from egress to ingress.

Words may be split across two deltas ("Par" + "is"), so the stage holds back the end of the
text that could still become a listed word, and lets it go once it cannot (or the request ends).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from pdflow import Stage
from pdflow.messages import Route, TextDelta


@dataclass(slots=True)
class _Held:
    text: str = ""  # received, not yet passed on


class RedactStage(Stage):
    kind = "redact"
    outputs = {"text": "ingress"}
    opens = (TextDelta,)  # the first delta of a request opens it here

    async def setup(self) -> None:
        words = [str(w) for w in self.config.options.get("words", [])]
        self.mask = str(self.config.options.get("mask", "[redacted]"))
        self.pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE) if words else None
        self.longest = max(map(len, words), default=0)

    def handlers(self):
        return {TextDelta: self.on_text}

    async def on_text(self, delta: TextDelta) -> None:
        rid = delta.request_id
        held = self.requests.get(rid) or self.requests.open(rid, _Held())
        text = held.text + delta.text
        if delta.finish_reason is None:  # keep back what may be the start of a listed word
            cut = max(0, len(text) - self.longest)
            while cut > 0 and text[cut - 1].isalnum():
                cut -= 1
            text, held.text = text[:cut], text[cut:]
        else:
            self.finish(rid)
        if self.pattern is not None:
            text = self.pattern.sub(self.mask, text)
        if text or delta.finish_reason is not None:
            # TextDelta carries no route: its one reader, ingress, has a single replica (0);
            # the rest of the delta (token counts, the tokens themselves) passes on as it came
            await self.send_output("text", Route(), msgspec.structs.replace(delta, text=text))
