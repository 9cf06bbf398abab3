"""Speculative decoding: prompt lookup drafts what followed the latest earlier occurrence,
verification keeps the greedy output token for token and the sampled output distributed as the
target's (a statistical test on a small vocabulary), budgets respect max_tokens, the context and
the batch's rows, adaptation stops drafting where drafts fail, and the engine's batches (paged
and dense, kernels and PyTorch) give the same greedy tokens with and without speculation."""

from __future__ import annotations

import random

import pytest
import torch

from pdflow.engine.decode import Sequence
from pdflow.engine.sampler import Sampler
from pdflow.messages import SamplingParams
from pdflow.speculative import Draft, Speculation, proposer, registry
from pdflow.speculative.verify import accept


def _seq(history=None, max_tokens=100, temperature=0.0, seed=None, generated=1, length=10) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    return Sequence("r", length, (history or [0])[-1], Sampler(params), generated=generated, history=history)


def test_the_builtin_proposers_are_registered():
    assert {"ngram", "self-draft"} <= set(registry.names())
    with pytest.raises(LookupError, match="unknown proposer"):
        proposer("medusa", None)
    with pytest.raises(TypeError, match="unknown ngram proposer parameters"):
        proposer("ngram", None, n=3)
    with pytest.raises(ValueError, match="max_n .* must be >= min_n"):
        proposer("ngram", None, min_n=3, max_n=2)


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    ngram = proposer("ngram", None, min_n=1, max_n=3)
    seq = _seq([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" occurred twice before: the latest was followed by 7 8 1 2 3
    assert ngram.propose(None, [seq], [4]) == [Draft([7, 8, 1, 2])]
    seq.history += [7]  # "2 3 7" and "3 7" were seen: 8 followed
    assert ngram.propose(None, [seq], [2]) == [Draft([8, 1])]
    seq.history += [4]  # "7 4", "4": never seen
    assert ngram.propose(None, [seq], [5]) == [Draft([])]
    assert ngram.propose(None, [seq], [0]) == [Draft([])]
    ngram.forget(seq)


def test_greedy_verification_keeps_the_drafts_the_target_agrees_with():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 5, 6]):
        logits[row, best] = 5.0
    greedy = Sampler(SamplingParams(temperature=0))
    assert accept(logits, Draft([3, 4, 5]), greedy) == [3, 4, 5, 6]  # all kept, and the target's next
    assert accept(logits, Draft([3, 9, 5]), greedy) == [3, 4]  # the first disagreement ends it
    assert accept(logits[:1], Draft([]), greedy) == [3]


@pytest.mark.parametrize("draft_probs", [False, True])
def test_rejection_sampling_keeps_the_targets_distribution(draft_probs):
    """Vocabulary of 5: target p from logits (temperature 0.7, top-k 4), a draft token from q
    (one-hot, as prompt lookup, or a real q); over 20,000 trials the first token emitted is
    distributed as p (chi-square over the 4 tokens p can give, 3 degrees of freedom: 0.1% critical
    value 16.27; and never a token p cannot give)."""
    logits = torch.tensor([[1.2, 0.3, -0.5, 2.0, 0.1], [0.0, 0.0, 0.0, 0.0, 0.0]])
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=4, seed=11))
    p = sampler.probabilities(logits[0])
    assert p[2] == 0  # (top-k 4 drops the least likely)
    q = torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1])
    rng = torch.Generator().manual_seed(5)
    counts = torch.zeros(5)
    trials = 20_000
    for _ in range(trials):
        if draft_probs:
            token = int(torch.multinomial(q, 1, generator=rng))
            draft = Draft([token], q[None])
        else:
            draft = Draft([1])  # a draft picked outright: often wrong (p[1] is small)
        counts[accept(logits, draft, sampler)[0]] += 1
    expected = p * trials
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert counts[~live].sum() == 0 and chi2 < 16.27, (counts, expected)


def test_budgets_respect_max_tokens_the_context_and_the_rows():
    spec = Speculation(proposer("ngram", None), num_tokens=5, adaptive=False, max_rows=8)
    seqs = [_seq(max_tokens=100), _seq(max_tokens=4, generated=2), _seq(length=2045)]
    assert spec.budgets(seqs, max_context=2048) == [2, 1, 2]  # 3 rows + 8 drafted > 8: the longest trimmed
    spec.max_rows = 64
    assert spec.budgets(seqs, max_context=2048) == [5, 1, 2]  # max_tokens, the context
    spec.max_rows = 6
    assert sum(spec.budgets(seqs, max_context=2048)) == 3
    full = [_seq() for _ in range(6)]
    assert spec.budgets(full, max_context=2048) == [0] * 6  # a full batch drafts nothing


def test_drafts_that_keep_failing_stop_and_are_probed_again():
    spec = Speculation(proposer("ngram", None), num_tokens=5, adaptive=True, row_cost=0.1, probe_every=4)
    seq = _seq()
    assert spec.wanted(seq) == 5  # hopeful at first
    for _ in range(6):
        spec.record(seq, 5, 0)
    wanted = [spec.wanted(seq) for _ in range(8)]
    assert wanted == [0, 0, 0, 1, 0, 0, 0, 1]  # nothing, then a one-token probe every 4th step
    for _ in range(6):
        spec.record(seq, 1, 1)
    assert spec.wanted(seq) >= 3  # accepted again: drafts grow back
    assert (seq.proposed, seq.accepted) == (36, 6)


# ---- the engine: the same greedy tokens with and without speculation ----

def _prompts(tokenizer) -> list[list[int]]:
    passage = ("The harbour master keeps a ledger of every ship: its name, its cargo, the day it came and "
               "the day it left. ")
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for text in (f"Repeat this passage word for word: {passage * 2}",
                         f"Quote the first sentence of this text exactly. {passage}",
                         "Write one sentence about the sea.")]


_PREFILLS: dict[tuple[int, ...], tuple[int, dict]] = {}  # prompt -> its first token and KV (batches copy it in)


def _prefilled(loaded, ids: list[int]) -> tuple[int, dict]:
    """The prompt's first greedy token and its KV, prefilled once in this module (one model)."""
    if tuple(ids) not in _PREFILLS:
        from pdflow.engine import prefill

        kv = {}
        first = prefill(loaded, ids, Sampler(SamplingParams(max_tokens=1, temperature=0)),
                        lambda layer, k, v: kv.__setitem__(layer, (k.transpose(0, 1), v.transpose(0, 1))))
        _PREFILLS[tuple(ids)] = first.first_token, kv
    return _PREFILLS[tuple(ids)]


def _run(loaded, batch, prompts, max_tokens=24):
    outputs = {}
    seqs = []
    for i, ids in enumerate(prompts):
        sampler = Sampler(SamplingParams(max_tokens=max_tokens, temperature=0))
        first_token, kv = _prefilled(loaded, ids)
        seq = Sequence(f"s{i}", len(ids), first_token, sampler, history=[*ids, first_token])
        if hasattr(batch, "add_from"):
            batch.add_from(seq, kv.__getitem__)
        else:
            batch.add(seq, kv.__getitem__)
        outputs[seq.request_id] = [first_token]
        seqs.append(seq)
    while batch.sequences:
        for seq, token in batch.step():
            if len(outputs[seq.request_id]) < max_tokens:
                outputs[seq.request_id].append(token)
        for seq in [s for s in batch.sequences if s.generated >= max_tokens]:
            batch.remove(seq)
    return [outputs[f"s{i}"] for i in range(len(prompts))], seqs


_PLAIN: dict[str, list[list[int]]] = {}  # kind of batch -> its greedy tokens without speculation (the same each time)


@pytest.mark.parametrize(("kind", "method"), [("paged", "ngram"), ("dense-torch", "ngram"), ("paged", "self-draft")])
def test_greedy_tokens_are_those_without_speculation(loaded_model, kind, method):
    from pdflow.engine import DecodeBatch
    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout

    loaded, tokenizer = loaded_model
    prompts = _prompts(tokenizer)

    def batch():
        if kind == "paged":
            pool = KvPool(ArenaLayout(loaded.layout, 16, 200))
            random.Random(1).shuffle(pool._free)
            return PagedDecodeBatch(loaded, 4, pool)
        return DecodeBatch(loaded, 4, attention_kernel=kind == "dense-kernel")

    if kind not in _PLAIN:
        _PLAIN[kind] = _run(loaded, batch(), prompts)[0]
    plain = _PLAIN[kind]
    speculating = batch()
    options = {"layers": 12} if method == "self-draft" else {}
    speculating.speculation = Speculation(proposer(method, loaded, **options), num_tokens=2 if options else 4,
                                          adaptive=False)
    drafted, seqs = _run(loaded, speculating, prompts)
    assert drafted == plain
    assert all(len(tokens) == 24 for tokens in drafted)
    counts = speculating.speculation.counts
    assert 0 < counts["accepted"] < counts["proposed"]
    if method == "ngram":
        assert counts["accepted"] > 10 and counts["steps"] < 3 * 23  # the quoting prompts took fewer steps
        assert seqs[0].accepted > seqs[2].accepted  # the repeating one kept the most


def test_self_draft_needs_fewer_layers_than_the_model(loaded_model):
    loaded, _ = loaded_model
    with pytest.raises(ValueError, match="fewer than the model's 30"):
        proposer("self-draft", loaded, layers=30)
    assert proposer("self-draft", None, layers=30).params["layers"] == 30  # (a topology's check: no model)


def test_the_package_imports_first_in_a_fresh_interpreter():
    """A topology check loads pdflow.speculative before pdflow.engine (which imports it back):
    no import cycle may break that order."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "import pdflow.speculative, pdflow.speculative.verify"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
