"""When a request is finished, decided from its newest token (decode and prefill alike)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdflow.messages import SamplingParams

if TYPE_CHECKING:
    from pdflow.engine.decode import Sequence
    from pdflow.engine.loader import LoadedModel


def finish_reason(
    token: int,
    generated: int,
    total_len: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    max_context: int,
) -> str | None:
    """``generated``: output tokens so far, this one included; ``total_len``: prompt + output."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if generated >= params.max_tokens or total_len >= max_context:
        return "length"
    return None


def after_decode_step(seq: Sequence, token: int, model: LoadedModel, now: float, behind: int = 0) -> str | None:
    """Decode just gave ``seq`` its ``token`` at ``now``, with ``behind`` more of its tokens after
    it from the same step (speculative decoding keeps several): note the step's time in its
    timeline (``seq.steps``) and say why it is finished, if it is (decode and the
    colocated worker alike)."""
    seq.steps.append(now)
    return finish_reason(token, seq.generated - behind, seq.position + 1 - behind, seq.sampler.params,
                         model.eos_token_ids, model.max_context)


def in_order(results: list[tuple[Sequence, int]]) -> Iterator[tuple[Sequence, int, int]]:
    """A step's ``(sequence, token)`` pairs as ``(sequence, token, behind)``: ``behind``, how many
    of the sequence's tokens from the same step come after this one (its index in the output is
    ``seq.generated - 1 - behind``)."""
    left: dict[int, int] = {}
    for seq, _ in results:
        left[id(seq)] = left.get(id(seq), 0) + 1
    for seq, token in results:
        left[id(seq)] -= 1
        yield seq, token, left[id(seq)]
