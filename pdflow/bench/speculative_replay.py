"""What speculation would give where a verified row costs something else: the same proposer and
the same adaptation replayed over the plain greedy answers, under a cost model of the step.

Greedy verification keeps a draft token exactly when it is the target's argmax, and with
speculation the greedy answers are the plain ones (``pdflow bench speculative`` checks it). So
the plain answers say what every verify pass would return, and the real
:meth:`~pdflow.speculative.Speculation.step` can run without the model: its forward pass is
replaced by logits whose argmax is the answer's next token at each row's place. The drafts,
budgets, accept lengths and counts are then the real ones (for a lookup proposer, which reads only
the tokens so far), and only the time is modelled: a step verifying ``d`` draft tokens costs
``1 + row_cost * d`` one-row steps (the model the adaptation itself uses), so the tokens per
second of speculation over plain decoding are the tokens emitted over that cost.

Where this machine's row cost is measured (0.4 here: docs/benchmarks.md), the replay at that
cost can be set beside the measured ratio; at other costs (a GPU's verify rows cost a few percent
of a memory-bound step) it says what the workload's answers allow. Batch 1; the model ignores
attention's growth with the drafts and the proposer's own time. One place is not known from the
answers: what the target would say after an answer's end of sequence (drafts past it are counted
as rejected there).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["replay"]


def replay(prompts: list[list[int]], answers: list[list[int]], speculation, max_tokens: int,
           max_context: int) -> dict:
    """Replay ``speculation`` (a fresh :class:`~pdflow.speculative.Speculation`, its
    ``row_cost`` the cost modelled) over each prompt's plain greedy ``answers`` (the first token
    from prefill), one sequence at a time, as ``pdflow bench speculative`` decodes at batch 1.

    Returns the totals: ``tokens`` (generated after the first: as many plain steps), ``steps``,
    ``cost`` (in one-row steps: ``1 + row_cost * drafted`` a step), ``proposed``, ``accepted``,
    ``drafts``, and ``ratio`` (plain steps over cost: speculation's tokens per second over plain
    decoding's under the model)."""
    from pdflow.engine.decode import Sequence
    from pdflow.engine.sampler import Sampler
    from pdflow.messages import SamplingParams

    if speculation.proposer.draft_cost:
        raise ValueError(f"replay needs a proposer that only looks tokens up; {speculation.proposer.name!r} "
                         "runs the model to draft")
    vocab = 1 + max(max(ids) for ids in [*prompts, *answers])  # logits wide enough for every token seen
    totals = {"tokens": 0, "steps": 0, "cost": 0.0}
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        seq = Sequence(str(i), len(prompt), answer[0], Sampler(SamplingParams(max_tokens=max_tokens, temperature=0)),
                       history=[*prompt, answer[0]])
        while seq.generated < len(answer):
            proposed = speculation.counts["proposed"]
            speculation.step(None, [seq], _answers_forward(seq, answer, vocab), max_context)
            totals["steps"] += 1
            totals["cost"] += 1 + speculation.row_cost * (speculation.counts["proposed"] - proposed)
        totals["tokens"] += len(answer) - 1  # and as many plain steps
        speculation.forget(seq)
    counts = speculation.counts
    return {**totals, "proposed": counts["proposed"], "accepted": counts["accepted"], "drafts": counts["drafts"],
            "ratio": totals["tokens"] / totals["cost"] if totals["cost"] else 1.0}


def _answers_forward(seq, answer: list[int], vocab: int) -> Callable:
    """A forward pass for one step of ``seq``: row ``r`` (``offsets[r]`` places after the
    sequence's next token) gets logits whose argmax is the answer's token there."""
    at = seq.generated  # answer[at] follows seq.next_token (answer[at - 1])
    beyond = answer[-1]  # past the answer's end: not known; a repeat of its last token

    def forward(owners, offsets, tokens):
        logits = torch.zeros(len(offsets), vocab)
        for row, offset in enumerate(offsets):
            place = at + offset
            logits[row, answer[place] if place < len(answer) else beyond] = 1.0
        return logits

    return forward
