"""The request's logits processors (penalties, bias, min_tokens, min_p), logprobs and guided
decoding, on hand-made logits and on the default model's tokenizer: each as vLLM and OpenAI define it."""

from __future__ import annotations

import json
import math
import sys

import jsonschema
import pytest
import torch

from pdflow.engine.logprobs import MAX_LOGPROBS, prompt_logprobs, token_logprob
from pdflow.engine.sampler import Sampler, SamplerFactory, sample_batch
from pdflow.guides import guide_error, guide_text
from pdflow.messages import SamplingParams
from pdflow.speculative.speculation import Speculation

GREEDY = {"temperature": 0.0}


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 1.5, 0.5])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, **GREEDY), prompt_ids=[0], generated=[1])
    assert sampler.adjusted(logits).tolist() == [1.0, -4.0, 1.5, 0.5]
    assert sampler.sample(logits) == 2  # token 0 fell below token 2


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    logits = torch.zeros(4)
    sampler = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, **GREEDY),
                      prompt_ids=[3, 3, 3], generated=[1, 1, 2])
    assert sampler.adjusted(logits).tolist() == [0.0, -1.25, -0.75, 0.0]  # the prompt's 3 is not penalised
    sampler.chose(2)
    assert sampler.adjusted(logits).tolist() == [0.0, -1.25, -1.25, 0.0]


def test_logit_bias_forces_and_bans() -> None:
    logits = torch.tensor([5.0, 1.0, 0.0])
    assert Sampler(SamplingParams(logit_bias={0: -100.0}, **GREEDY)).sample(logits) == 1
    assert Sampler(SamplingParams(logit_bias={2: 100.0}, **GREEDY)).sample(logits) == 2
    assert Sampler(SamplingParams(logit_bias={7: 100.0}, **GREEDY)).sample(logits) == 0  # outside: ignored


def test_min_tokens_holds_back_eos_and_stop_tokens_then_lets_them_through() -> None:
    logits = torch.tensor([0.0, 9.0, 8.0, 1.0])  # eos 1 and stop token 2 are the likeliest
    sampler = Sampler(SamplingParams(min_tokens=2, stop_token_ids=(2,), **GREEDY), eos_token_ids=[1])
    assert [sampler.sample(logits) for _ in range(3)] == [3, 3, 1]
    ignoring = Sampler(SamplingParams(min_tokens=1, ignore_eos=True, **GREEDY), eos_token_ids=[1])
    assert ignoring.sample(logits) == 1  # with ignore_eos, eos is an ordinary token
    # decode's sampler continues prefill's: one token already generated counts
    assert Sampler(SamplingParams(min_tokens=1, **GREEDY), eos_token_ids=[1], generated=[3]).sample(logits) == 1


def test_min_p_keeps_tokens_within_a_fraction_of_the_top() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = Sampler(SamplingParams(min_p=0.35, temperature=1.0, seed=0)).probabilities(probs.log())
    assert kept[2:].tolist() == [0.0, 0.0]  # 0.15 < 0.35 * 0.5
    assert kept[:2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])
    one = Sampler(SamplingParams(min_p=1.0, temperature=1.0, seed=0))
    assert {one.sample(probs.log()) for _ in range(20)} == {0}


def test_plain_samplers_only_share_the_batch_argmax() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    plain, biased = Sampler(SamplingParams(**GREEDY)), Sampler(SamplingParams(logit_bias={0: -100.0}, **GREEDY))
    assert plain.plain and not biased.plain
    assert not Sampler(SamplingParams(logprobs=0, **GREEDY)).plain
    assert sample_batch(logits, [plain, biased]) == [0, 1]
    assert plain.generated == biased.generated == 1


def test_speculation_drafts_nothing_for_a_sampler_that_is_not_plain() -> None:
    class Seq:
        def __init__(self, sampler):
            self.sampler, self.generated, self.position = sampler, 1, 10

    speculation = Speculation(proposer=None, num_tokens=4)
    speculation.wanted = lambda seq, cost: 4
    seqs = [Seq(Sampler(SamplingParams(max_tokens=50, **GREEDY))),
            Seq(Sampler(SamplingParams(max_tokens=50, presence_penalty=1.0, **GREEDY)))]
    assert speculation.budgets(seqs, max_context=1000) == [4, 0]


def test_logprobs_are_the_raw_distribution_with_the_top_alternatives() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    expected = torch.log_softmax(logits, -1)
    lp = token_logprob(logits, 2, 3)
    assert lp.logprob == pytest.approx(float(expected[2]))
    assert lp.top_ids == [1, 2, 0] and lp.top_logprobs == pytest.approx(expected[[1, 2, 0]].tolist())
    assert token_logprob(logits, 0, 0).top_ids == []
    # the sampler's logprobs ignore its processors (vLLM's raw logprobs) and are taken once
    sampler = Sampler(SamplingParams(logprobs=1, logit_bias={1: -100.0}, **GREEDY))
    assert sampler.sample(logits) == 2
    taken = sampler.take_logprobs()
    assert [t.logprob for t in taken] == pytest.approx([float(expected[2])]) and taken[0].top_ids == [1]
    assert sampler.take_logprobs() == []
    assert MAX_LOGPROBS == 20


def test_prompt_logprobs_score_each_token_by_the_row_before_it() -> None:
    torch.manual_seed(0)
    rows = torch.randn(600, 11)  # over two of its 256-row chunks
    ids = torch.randint(0, 11, (600,)).tolist()
    scored = prompt_logprobs(rows, ids, 2)
    assert len(scored) == 599
    for i in (0, 255, 256, 598):
        assert scored[i].logprob == pytest.approx(float(torch.log_softmax(rows[i], -1)[ids[i + 1]]), abs=1e-5)
        assert len(scored[i].top_ids) == 2


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def samplers(model_dir):
    from pdflow.engine import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return SamplerFactory(frozenset({tokenizer.eos_token_id}), len(tokenizer), model_dir), tokenizer


@pytest.mark.parametrize("seed", range(4))
def test_guided_sampling_from_random_logits_always_validates(samplers, seed: int) -> None:
    """Random logits are the hardest model: only the mask keeps the output valid."""
    factory, tokenizer = samplers
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, guide=guide_text("json_schema", SCHEMA))
    sampler = factory.make(params)
    gen = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < 200:
        token = sampler.sample(torch.randn(len(tokenizer), generator=gen) * 3)
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
    assert len(out) < 200, "the grammar never let the output end"
    jsonschema.validate(json.loads(tokenizer.decode(out)), SCHEMA)


def test_a_guides_mask_forbids_exactly_the_tokens_its_matcher_refuses(samplers) -> None:
    """The unpacked bitmask, token by token, against the grammar engine's own verdict on each,
    along a random walk through the grammar (a bit or byte order slip would let some token
    through or forbid an allowed one)."""
    factory, tokenizer = samplers
    guide = factory.make(SamplingParams(guide=guide_text("json_schema", SCHEMA), **GREEDY)).guide
    gen = torch.Generator().manual_seed(7)
    for step in range(12):
        scores = torch.zeros(len(tokenizer))
        guide.mask(scores)
        allowed = torch.isfinite(scores)
        assert 0 < int(allowed.sum()) < len(tokenizer)
        if step % 4 == 0:
            picks = torch.cat([allowed.nonzero()[:100, 0], (~allowed).nonzero()[::211, 0]])
            for token in picks.tolist():
                assert (guide.matcher.validate_tokens([token]) == 1) == bool(allowed[token]), (step, token)
        choice = allowed.nonzero()[:, 0]
        guide.accept(int(choice[torch.randint(len(choice), (1,), generator=gen)]))


def test_a_guide_does_not_import_llguidances_torch_module(samplers, monkeypatch) -> None:
    """Importing llguidance.torch runs torch.compile (3 s of CPU in each stage process, at the
    first guided request): a guide is made and applied without it."""
    factory, tokenizer = samplers
    monkeypatch.setitem(sys.modules, "llguidance.torch", None)  # (an import of it raises)
    sampler = factory.make(SamplingParams(guide=guide_text("json_object"), **GREEDY))
    scores = sampler.adjusted(torch.zeros(len(tokenizer)))
    assert math.isinf(float(scores[tokenizer.encode("x")[0]]))
    assert math.isfinite(float(scores[tokenizer.encode("{")[0]]))


def test_a_guide_resumes_past_the_tokens_already_chosen(samplers) -> None:
    """Decode's guide starts after the token prefill chose: its mask must match the whole run's."""
    factory, tokenizer = samplers
    text = guide_text("json_object")
    first = tokenizer.encode("{")[0]
    whole, resumed = factory.make(SamplingParams(guide=text, **GREEDY)), factory.make(
        SamplingParams(guide=text, **GREEDY), generated=[first])
    whole.chose(first)
    logits = torch.randn(len(tokenizer), generator=torch.Generator().manual_seed(1))
    assert torch.equal(whole.adjusted(logits), resumed.adjusted(logits))
    assert math.isinf(float(resumed.adjusted(logits)[tokenizer.encode("x")[0]]))  # '{' then 'x' is not JSON


@pytest.mark.parametrize("schema,fragment", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),  # not enforced: refused, not ignored
    ({"type": "string", "pattern": "(?<=a)b"}, "look-behind"),
    ({"$ref": "#/nope"}, "/nope"),
])
def test_a_schema_the_engine_cannot_enforce_whole_is_an_error(schema: dict, fragment: str) -> None:
    error = guide_error(guide_text("json_schema", schema))
    assert error is not None and fragment in error


def test_a_valid_schema_has_no_error() -> None:
    assert guide_error(guide_text("json_schema", SCHEMA)) is None
    assert guide_error(guide_text("json_object")) is None
