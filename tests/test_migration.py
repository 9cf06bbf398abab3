"""Migration's seam, on the text stream that ingress (or an egress stage) turns tokens into text
with (the real tokenizer): a stream cut after any token and resumed from the tokens generated so
far and the text already sent gives exactly the text of the uninterrupted stream, stop strings and
multi-byte characters across the seam included."""

from __future__ import annotations

import pytest

from pdflow.engine import load_tokenizer
from pdflow.messages import TextDelta, Tokens
from pdflow.serving.text_stream import TextStream

TEXTS = ["The keeper climbed the stairs; the lamp — naïve, 😀 bright — turned. STOP and more text after",
         "Ångström façade: déjà vu 🇫🇷 then the END of it all"]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _run(stream: TextStream, tokens: list[int], finish: str | None) -> list[TextDelta]:
    """Every token alone, in reverse order after the first (they may arrive out of order)."""
    deltas = []
    order = [0, *reversed(range(1, len(tokens)))]
    for i in order:
        last = i == len(tokens) - 1
        deltas += stream.add(Tokens(stream.request_id, i, [tokens[i]], finish if last else None))[0]
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [(), ("STOP", "END")])
def test_a_stream_resumed_after_any_token_gives_the_same_text(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    whole = _run(TextStream("w", tokenizer, stop), ids, "length")
    expected = "".join(d.text for d in whole)
    assert [t for d in whole for t in d.token_ids] == ids[:whole[-1].completion_tokens]
    for cut in range(1, whole[-1].completion_tokens):
        first = _run(TextStream("a", tokenizer, stop), ids[:cut], None)
        sent = "".join(d.text for d in first)
        generated = [t for d in first for t in d.token_ids]
        rest = ids[len(generated):]
        resumed = _run(TextStream("b", tokenizer, stop, resume_ids=generated, resume_chars=len(sent)), rest, "length")
        assert sent + "".join(d.text for d in resumed) == expected, cut
        assert resumed[-1].completion_tokens == whole[-1].completion_tokens
        assert resumed[-1].finish_reason == whole[-1].finish_reason
