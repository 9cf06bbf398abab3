"""Stop strings on streamed text: emit only what can no longer turn out to be part of a stop.

OpenAI truncates the output before the first stop string (which is not included). When text
arrives in pieces, a stop string may straddle them, so the matcher holds back the longest suffix
of the text that is still the beginning of some stop string, and releases it once the next piece
rules that out (or at :meth:`flush`, when the request ends for another reason).
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed text as it is decoded; get back what is safe to emit and whether a stop matched.

    Since everything emitted is known not to start a stop string, a match can only begin in the
    held-back tail or the new text: each :meth:`feed` scans ``O(len(text) + longest stop)``.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit now, whether a stop string matched)``.

        After a match, the rest of the request's text is dropped: later feeds return ``("", True)``.
        """
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[:min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back tail at the end of the request (``""`` after a match)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self.stop) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
