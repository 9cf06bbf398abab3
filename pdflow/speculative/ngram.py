"""``ngram``: prompt lookup (vLLM's n-gram proposer). The last ``max_n`` .. ``min_n`` tokens of a
sequence are looked up among its earlier tokens (the prompt and what it generated); the tokens
that followed their latest earlier occurrence are the draft. Free to compute and right where the
output repeats the input: answers quoting a passage, summaries, code edits, chat that repeats
itself. Each sequence's n-grams are indexed as its tokens arrive (a dict per n, updated with
each accepted token), so a proposal costs a few dict lookups whatever the context's length."""

from __future__ import annotations

from pdflow.speculative.base import NO_DRAFT, Draft, Proposer

__all__ = ["NgramProposer"]


class _Index:
    """The n-grams of one sequence's tokens, each mapped to the position after its latest
    occurrence, for n-grams ending before the last token (so the suffix never finds itself)."""

    __slots__ = ("maps", "upto")

    def __init__(self, sizes: range):
        self.maps = {n: {} for n in sizes}
        self.upto = 0  # n-grams ending before this position are in

    def catch_up(self, history: list[int]) -> None:
        end = len(history) - 1  # the last token's n-grams wait until a token follows them
        for i in range(self.upto, end):
            for n, found in self.maps.items():
                if i + 1 >= n:
                    found[tuple(history[i + 1 - n : i + 1])] = i + 1
        self.upto = max(self.upto, end)


class NgramProposer(Proposer):
    name = "ngram"
    defaults = {"min_n": 1, "max_n": 4}

    def check(self) -> None:
        if self._positive_int("max_n") < self._positive_int("min_n"):
            raise ValueError(f"ngram proposer: max_n ({self.params['max_n']}) must be >= min_n ({self.params['min_n']})")
        self._indexes: dict[int, _Index] = {}

    def propose(self, batch, seqs, budgets):
        sizes = range(self.params["max_n"], self.params["min_n"] - 1, -1)
        drafts = []
        for seq, budget in zip(seqs, budgets):
            history = seq.history
            if budget <= 0 or history is None:
                drafts.append(NO_DRAFT)
                continue
            index = self._indexes.get(id(seq))
            if index is None:
                index = self._indexes[id(seq)] = _Index(sizes)
            index.catch_up(history)
            draft = NO_DRAFT
            for n in sizes:
                if n > len(history):
                    continue
                at = index.maps[n].get(tuple(history[-n:]))
                if at is not None:
                    draft = Draft(history[at : at + budget])
                    break
            drafts.append(draft)
        return drafts

    def forget(self, seq) -> None:
        self._indexes.pop(id(seq), None)
