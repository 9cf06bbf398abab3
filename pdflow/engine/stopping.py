"""When a request is finished, decided from its newest token (decode and prefill alike)."""

from __future__ import annotations

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


def after_decode_step(seq: Sequence, token: int, model: LoadedModel, now: float) -> str | None:
    """Decode just gave ``seq`` its newest ``token`` at ``now``: note the step's time in its
    timeline (``seq.extra["steps"]``) and say why it is finished, if it is (decode and the
    colocated worker alike)."""
    seq.extra["steps"].append(now)
    return finish_reason(token, seq.generated, seq.position + 1, seq.sampler.params, model.eos_token_ids,
                         model.max_context)
