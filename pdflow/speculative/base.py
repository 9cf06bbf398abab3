"""The interface of a proposer: what drafts tokens for speculative decoding.

Each step of a speculating batch asks its proposer for a draft per sequence (at most that
sequence's budget of tokens); the target model then verifies every draft of the batch in one
forward pass (:mod:`pdflow.speculative.verify`). A proposer that draws its tokens from a
distribution (a draft model sampling) returns that distribution too, so that rejection sampling
keeps the output the target's; one that picks them (prompt lookup, a greedy draft model) returns
none, which verification reads as all of its probability on the token picked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    import torch

    from pdflow.engine.decode import Sequence
    from pdflow.engine.loader import LoadedModel

__all__ = ["Draft", "NO_DRAFT", "Proposer"]


class Draft(NamedTuple):
    """Tokens proposed to follow a sequence's ``next_token``; ``probs`` ``(len(tokens), vocab)``:
    the distributions they were drawn from, or None where each was picked outright."""

    tokens: list[int]
    probs: "torch.Tensor | None" = None


NO_DRAFT = Draft([])


class Proposer:
    """Subclasses set :attr:`name` and :attr:`defaults` (every parameter with its default) and
    implement :meth:`propose`."""

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}

    @property
    def draft_cost(self) -> float:
        """What drafting one token costs against a one-row step of the model (0: next to nothing,
        as a lookup); adaptation weighs it with the verify row's."""
        return 0.0

    def __init__(self, loaded: "LoadedModel", **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise TypeError(f"unknown {self.name} proposer parameters {sorted(unknown)}; known: {sorted(self.defaults)}")
        self.loaded = loaded
        self.params = {**self.defaults, **params}
        self.check()

    def check(self) -> None:
        """Raise ValueError naming a parameter whose value cannot work."""

    def _positive_int(self, key: str, least: int = 1) -> int:
        value = self.params[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{self.name} proposer: {key} must be an integer >= {least}, got {value!r}")
        return value

    def propose(self, batch, seqs: "list[Sequence]", budgets: list[int]) -> list[Draft]:
        """A draft for each of ``seqs`` (of a batch ``batch``), at most ``budgets[i]`` tokens
        (0: none wanted). Sequences carry their tokens so far in ``history``."""
        raise NotImplementedError

    def forget(self, seq: "Sequence") -> None:
        """``seq`` left the batch: drop what was kept for it."""
