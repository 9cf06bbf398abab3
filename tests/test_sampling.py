"""pdflow.engine.sampler and pdflow.engine.stopping on hand-made logits: no model involved.

Every random test uses a fixed seed, so it draws the same tokens on every run and cannot flake;
the tolerances are still those of a real statistical test (chi-square at p = 0.001).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pdflow.engine.sampler import Sampler, sample_batch
from pdflow.engine.stopping import finish_reason
from pdflow.messages import SamplingParams

CHI2_CRITICAL_P001 = {1: 10.83, 2: 13.82, 3: 16.27}  # chi-square critical values at p = 0.001, by df


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def draw(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(logits) for _ in range(n)]


def chi_square(samples: list[int], probs: list[float]) -> float:
    counts, n = Counter(samples), len(samples)
    assert set(counts) <= {i for i, p in enumerate(probs) if p > 0}, f"drew a token of probability 0: {counts}"
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


def test_temperature_zero_is_argmax() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=1))
    assert sampler.greedy and sampler.generator is None
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(1000, generator=g)
        assert sampler.sample(logits) == int(torch.argmax(logits))
    assert sampler.sample(torch.tensor([-5.0, -1.0, -3.0])) == 1  # all negative: still the largest


def test_top_k_one_is_argmax() -> None:
    logits = logits_of([0.3, 0.25, 0.45])  # the argmax is far from certain without top_k
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3))
    assert not sampler.greedy
    assert {sampler.sample(logits) for _ in range(300)} == {2}
    assert set(draw(SamplingParams(temperature=1.0, seed=3), logits, 300)) == {0, 1, 2}  # and without it


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.tensor([1.0, 1.1, 0.9, 1.05, 0.95])  # nearly uniform
    assert set(draw(SamplingParams(temperature=1.0, top_p=1e-6, seed=5), logits, 300)) == {1}
    assert set(draw(SamplingParams(temperature=1.5, top_p=1e-6, seed=5), logits, 300)) == {1}


def test_top_p_keeps_the_smallest_set_over_p() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    samples = draw(SamplingParams(temperature=1.0, top_p=0.7, seed=11), logits_of(probs), 2000)
    # 0.5 < 0.7, so the second token is needed to get over p; the third is not
    assert chi_square(samples, [0.625, 0.375, 0.0, 0.0]) < CHI2_CRITICAL_P001[1]


def test_top_k_renormalises_over_the_k_best() -> None:
    probs = [0.05, 0.3, 0.15, 0.5]
    samples = draw(SamplingParams(temperature=1.0, top_k=2, seed=12), logits_of(probs), 2000)
    assert chi_square(samples, [0.0, 0.375, 0.0, 0.625]) < CHI2_CRITICAL_P001[1]


def test_same_seed_same_samples_different_seed_different_samples() -> None:
    logits = torch.zeros(16)  # uniform: every draw is a coin with 16 sides
    params = SamplingParams(temperature=1.0, seed=1234)
    first, second = draw(params, logits, 100), draw(params, logits, 100)
    assert first == second
    assert len(set(first)) > 8  # it really is random, not a constant
    other = draw(SamplingParams(temperature=1.0, seed=4321), logits, 100)
    assert other != first
    # no seed: each request gets its own random generator
    assert draw(SamplingParams(temperature=1.0), logits, 100) != draw(SamplingParams(temperature=1.0), logits, 100)


def test_a_request_generator_advances() -> None:
    """One sampler draws a sequence, not the same token again and again."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=99))
    assert len({sampler.sample(torch.zeros(1000)) for _ in range(20)}) > 1


def test_samples_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    samples = draw(SamplingParams(temperature=1.0, seed=2024), logits_of(probs), 4000)
    assert chi_square(samples, probs) < CHI2_CRITICAL_P001[3]
    assert chi_square(samples, [0.25] * 4) > 100  # the test can tell distributions apart


def test_temperature_flattens_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    samples = draw(SamplingParams(temperature=2.0, seed=2025), logits_of(probs), 4000)
    root = [math.sqrt(p) for p in probs]
    tempered = [r / sum(root) for r in root]  # softmax(log p / 2) = sqrt(p), normalised
    assert chi_square(samples, tempered) < CHI2_CRITICAL_P001[3]
    assert chi_square(samples, probs) > 50


def test_half_precision_logits() -> None:
    logits = logits_of([0.1, 0.2, 0.3, 0.4]).to(torch.bfloat16)
    samples = draw(SamplingParams(temperature=1.0, seed=7), logits, 2000)
    assert chi_square(samples, [0.1, 0.2, 0.3, 0.4]) < CHI2_CRITICAL_P001[3]
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == 3


def test_sample_batch_mixes_greedy_and_sampled_rows() -> None:
    minus_inf = float("-inf")
    logits = torch.tensor([
        [0.1, 0.5, 0.2, 0.0, 0.3, 0.0, 0.0, 0.0],  # greedy: 1
        [minus_inf, minus_inf, 0.0, minus_inf, minus_inf, 0.0, minus_inf, minus_inf],  # sampled: 2 or 5
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0],  # greedy: 6
        [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],  # sampled with top_k = 1: 7
    ])
    samplers = [
        Sampler(SamplingParams(temperature=0.0)),
        Sampler(SamplingParams(temperature=1.0, seed=42)),
        Sampler(SamplingParams(temperature=0.0, seed=42)),
        Sampler(SamplingParams(temperature=0.8, top_k=1, seed=42)),
    ]
    twin = Sampler(SamplingParams(temperature=1.0, seed=42))  # what row 1's sampler should draw
    rows = [sample_batch(logits, samplers) for _ in range(200)]
    assert all(len(r) == 4 for r in rows)
    assert {r[0] for r in rows} == {1}
    assert {r[2] for r in rows} == {6}
    assert {r[3] for r in rows} == {7}
    assert [r[1] for r in rows] == [twin.sample(logits[1]) for _ in range(200)]
    assert {r[1] for r in rows} == {2, 5}  # sampled, not the argmax every time


def test_sample_batch_all_greedy_and_empty() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    greedy = [Sampler(SamplingParams(temperature=0.0)) for _ in range(5)]
    assert sample_batch(logits, greedy) == torch.argmax(logits, dim=-1).tolist()
    assert sample_batch(torch.empty(0, 100), []) == []


# --- pdflow.engine.stopping ------------------------------------------------------------------

EOS = frozenset({2, 49152})


def reason(token: int, generated: int = 1, total_len: int = 11, max_context: int = 100, **params) -> str | None:
    return finish_reason(token, generated, total_len, SamplingParams(**params), EOS, max_context)


def test_eos_stops() -> None:
    assert reason(2) == "stop"
    assert reason(49152) == "stop"
    assert reason(2, generated=16, max_tokens=16) == "stop"  # stop wins over length


def test_ignore_eos() -> None:
    assert reason(2, ignore_eos=True) is None
    assert reason(2, generated=16, max_tokens=16, ignore_eos=True) == "length"


def test_stop_token_ids() -> None:
    assert reason(7, stop_token_ids=(7, 8)) == "stop"
    assert reason(8, stop_token_ids=(7, 8), ignore_eos=True) == "stop"  # ignore_eos is about eos only
    assert reason(9, stop_token_ids=(7, 8)) is None


def test_max_tokens_is_length() -> None:
    assert reason(5, generated=15, max_tokens=16) is None
    assert reason(5, generated=16, max_tokens=16) == "length"
    assert reason(5, generated=1, max_tokens=1) == "length"


def test_context_limit_is_length() -> None:
    assert reason(5, generated=3, total_len=99, max_context=100, max_tokens=1000) is None
    assert reason(5, generated=3, total_len=100, max_context=100, max_tokens=1000) == "length"
    assert reason(2, total_len=100, max_context=100) == "stop"


@pytest.mark.parametrize("token", [0, 1, 3, 49151, 49153])
def test_otherwise_none(token: int) -> None:
    assert reason(token, generated=1, total_len=11, max_context=2048, max_tokens=16) is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=5e-324),  # rounds to 0 in float32
    SamplingParams(temperature=1e-300),  # divides to inf
    SamplingParams(temperature=2.0, top_p=5e-324, top_k=1),
    SamplingParams(temperature=2.0, top_k=2**31 - 1, seed=2**64 - 1),
    SamplingParams(temperature=1.0, seed=-(2**63)),
])
def test_edge_values_the_api_accepts_always_sample(params: SamplingParams) -> None:
    """Every value the HTTP API accepts gives a token, never a sampler error."""
    logits = torch.tensor([1.0, 1.1, 0.9, 1.05, 0.95]) * 1e4  # large logits: overflow if not shifted
    tokens = draw(params, logits, 20)
    assert all(0 <= t < 5 for t in tokens)
    if params.top_p < 1e-300 or params.temperature < 1e-5:
        assert set(tokens) == {1}  # the argmax, as greedy would pick


def test_logits_that_are_not_finite_fall_back_to_the_argmax() -> None:
    logits = torch.tensor([0.0, float("inf"), 1.0, float("nan")])
    assert Sampler(SamplingParams(temperature=1.0, seed=1)).sample(logits) in range(4)
    assert Sampler(SamplingParams(temperature=1.0, seed=1)).sample(torch.tensor([0.0, float("inf"), 1.0])) == 1
