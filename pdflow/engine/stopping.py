"""When a request is finished, decided from its newest token (decode and prefill alike)."""

from __future__ import annotations

from pdflow.messages import SamplingParams


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
