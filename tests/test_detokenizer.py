"""Incremental detokenization against the real SmolLM2 tokenizer, and stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdflow.serving.detokenizer import IncrementalDetokenizer
from pdflow.serving.stop_strings import StopStringMatcher

FALLBACK_DIR = Path("/root/.cache/pdflow/models/smollm2-manual")


def _tokenizer_dir() -> Path:
    try:
        from pdflow.models import model_dir  # written separately; may not exist yet

        d = Path(model_dir("smollm2"))
        if d.is_dir():
            return d
    except (ImportError, LookupError, OSError, ValueError, TypeError):
        pass
    if FALLBACK_DIR.is_dir():
        return FALLBACK_DIR
    pytest.skip("SmolLM2 tokenizer not found (pdflow.models.model_dir('smollm2') or the manual dir)")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_dir())


TEXTS = [
    "Hello, world!",
    "naïve café, déjà vu — Ångström façade",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 end",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "def f(x):\n    return  x ** 2\t# two  spaces\n\n\nprint(f(3))\n",
    "  leading and trailing spaces   ",
    "mixed: a😀b中c\u00e9\ufb01 \u200b zero-width",
]


def _groups(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", TEXTS)
def test_random_groups_match_full_decode(tokenizer, text, seed):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.add(g) for g in _groups(ids, random.Random(seed)))
    assert out + detok.flush() == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("<|im_start|>assistant\nCafé 😀<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    out = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert out == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in out) is not skip


def test_unfinished_character_is_held_then_flushed(tokenizer):
    ids = tokenizer.encode("ok 😀")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in ids[:cut]) == "ok"  # the emoji's first bytes held back
    assert detok.flush() == tokenizer.decode(ids[:cut])[len("ok"):]  # " \ufffd" at the very end


def test_each_step_decodes_a_short_window(tokenizer):
    """O(1) per step: decode never sees more than a few recent tokens, however long the text."""
    text = (" ".join(TEXTS) + " ") * 20
    ids = tokenizer.encode(text)
    assert len(ids) > 500
    sizes: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=False):
            sizes.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Spy())
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == text
    assert max(sizes) <= 8


# --- stop strings --------------------------------------------------------------------------


def _run(stop: tuple[str, ...], pieces: list[str]) -> tuple[str, bool, list[str]]:
    m = StopStringMatcher(stop)
    emitted, stopped = [], False
    for p in pieces:
        text, stopped = m.feed(p)
        emitted.append(text)
        if stopped:
            break
    return "".join(emitted) + m.flush(), stopped, emitted


def test_no_stop_strings_pass_through_without_holding():
    m = StopStringMatcher(())
    assert m.feed("abc") == ("abc", False) and m.feed("") == ("", False) and m.flush() == ""


def test_no_match_releases_everything():
    out, stopped, emitted = _run(("STOX",), ["he said S", "TO", "P-ish. ST"])
    assert (out, stopped) == ("he said STOP-ish. ST", False)
    assert emitted == ["he said ", "", "STOP-ish. "]  # "ST" held until the end


def test_stop_split_across_many_feeds():
    text = "The answer is 42.\n###\nmore text"
    for size in (1, 2, 3, 5):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        out, stopped, emitted = _run(("\n###",), pieces)
        assert (out, stopped) == ("The answer is 42.", True)
        assert "#" not in "".join(emitted)
    assert _run(("STOP",), ["he said S", "TO", "P-ish"])[:2] == ("he said ", True)


def test_stop_at_the_very_start():
    assert _run(("<end>",), ["<end>and more"])[:2] == ("", True)
    assert _run(("<end>",), ["<", "en", "d>", "x"])[:2] == ("", True)


def test_overlapping_candidates():
    # "abab": the candidate starting at 0 fails, the one at 2 ("ab") must still be held.
    out, stopped, emitted = _run(("aba c",), ["abab", "a c tail"])
    assert (out, stopped) == ("ab", True) and emitted[0] == "ab"
    assert _run(("aaab",), ["aa", "aa", "ab"])[:2] == ("aa", True)


def test_earliest_of_several_stops_wins():
    assert _run(("world", "lo"), ["hello world"])[:2] == ("hel", True)
    assert _run(("xyz", "o w", "d"), ["hel", "lo", " wor", "ld"])[:2] == ("hell", True)


def test_after_a_match_everything_is_dropped():
    m = StopStringMatcher(("!",))
    assert m.feed("hi! there") == ("hi", True)
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_stop_on_detokenized_stream(tokenizer):
    ids = tokenizer.encode("Ångström 😀 says: done😀 forever")
    detok, m = IncrementalDetokenizer(tokenizer), StopStringMatcher(("done😀",))
    out = []
    for t in ids:
        text, stopped = m.feed(detok.add([t]))
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "Ångström 😀 says: "
