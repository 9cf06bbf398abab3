"""Incremental detokenization: token ids in, only the new text out, in O(1) per step.

Decoding one token at a time is wrong for byte-level BPE, where one character can span several
tokens (each alone decodes to "\\ufffd"), and decoding the whole sequence each step is O(n).
The prefix/read offset method (vLLM's ``detokenize_incrementally``) decodes only a short window:

    ids:  ... | prefix_offset ... read_offset | new ids
               `-- already emitted, kept as context --'

``prefix_text = decode(ids[prefix:read])``, ``full = decode(ids[prefix:])``; when ``full``
grows past ``prefix_text`` and does not end in a replacement char (an unfinished character),
``full[len(prefix_text):]`` is new and the window slides forward. Otherwise the new ids are held
until a later token completes the character. The window always starts on a character boundary,
so decoding it alone gives the same text as decoding the whole sequence.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting each character exactly once.

    ``"".join(add(...) for each group) + flush()`` equals
    ``tokenizer.decode(all_ids, skip_special_tokens=...)`` for tokenizers whose decode of a
    window starting on a character boundary is the matching slice of the whole (byte-level BPE,
    without ``clean_up_tokenization_spaces``).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the text they complete (possibly ``""``)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if full.endswith("\ufffd"):
            return ""  # a character is still unfinished: wait for its remaining bytes
        new = full[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the request: release held-back ids as they decode (with "\\ufffd")."""
        full = self._decode(self.ids[self._prefix_offset:])
        new = full[len(self._decode(self.ids[self._prefix_offset:self._read_offset])):]
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += new
        return new
