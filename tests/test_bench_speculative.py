"""``pdflow bench speculative`` on a few prompts: each workload's prompts are what it says, the
report holds both runs' figures, and greedy outputs are identical with and without speculation."""

from __future__ import annotations

import argparse

from pdflow.bench import speculative


def test_the_workloads_quote_passages_shipped_with_python():
    texts = speculative.workload_texts("rag", 3)
    assert len(texts) == 3 and all("Passage: " in t and "Question: " in t for t in texts)
    passage = speculative.passages(1)[0][1]
    assert len(passage.split()) == 90 and passage in speculative.workload_texts("rewrite", 1)[0]


def test_the_report_holds_together(model_dir):
    parser = argparse.ArgumentParser()
    speculative.add_arguments(parser)
    args = parser.parse_args(["--prompts", "2", "--tokens", "12", "--batches", "1", "2",
                              "--workloads", "multiturn", "--option", "max_n=3"])
    report = speculative.run(args, progress=open("/dev/null", "w"))
    assert report["options"] == {"max_n": 3}
    rows = report["rows"]
    assert set(rows) == {"multiturn@1", "multiturn@2"}
    for row in rows.values():
        plain, spec = row["plain"], row["speculative"]
        assert row["identical"] == row["answers"] == 2  # greedy: the same tokens
        assert plain["tokens"] == spec["tokens"] > 0 and plain["seconds"] > 0 and spec["seconds"] > 0
        assert spec["accepted"] <= spec["proposed"] and spec["steps"] <= plain["steps"]
    assert rows["multiturn@1"]["speculative"]["accepted"] > 0  # repeating its own answer: drafts kept
    # the replay at the run's own row cost drafts and keeps exactly what the engine did at batch 1
    replayed, measured = report["replays"]["multiturn"][str(args.row_cost)], rows["multiturn@1"]["speculative"]
    for key in ("proposed", "accepted", "drafts", "steps", "tokens"):
        assert replayed[key] == measured[key], key
    assert list(report["replays"]["multiturn"]) == [str(args.row_cost), "0.4", "0.2", "0.1", "0.05", "0.0"]
    text = speculative.table(report)
    assert "multiturn" in text and "on/off" in text and "replayed at batch 1" in text


def test_replay_by_hand():
    """An answer that repeats its prompt, replayed with free verify rows: the first step drafts
    five tokens and keeps them (six emitted), the second drafts the two that max_tokens leaves."""
    from pdflow.bench.speculative_replay import replay
    from pdflow.speculative import Speculation, proposer

    prompt = list(range(1, 11))
    spec = Speculation(proposer("ngram", None), 5, True, row_cost=0.0)
    result = replay([prompt], [prompt], spec, max_tokens=10, max_context=4096)
    assert result == {"tokens": 9, "steps": 2, "cost": 2.0, "proposed": 7, "accepted": 7, "drafts": 2,
                      "ratio": 4.5}
    costly = replay([prompt], [prompt], Speculation(proposer("ngram", None), 5, False, row_cost=0.5), 10, 4096)
    assert costly["cost"] == 2 + 0.5 * costly["proposed"] and costly["ratio"] == 9 / costly["cost"]


def test_replay_refuses_a_proposer_that_runs_the_model():
    import pytest

    from pdflow.bench.speculative_replay import replay
    from pdflow.speculative import Speculation
    from pdflow.speculative.self_draft import SelfDraftProposer

    spec = Speculation(SelfDraftProposer(None), 5)
    with pytest.raises(ValueError, match="self-draft"):
        replay([[1, 2]], [[3, 4]], spec, 4, 4096)


def test_the_row_major_int4_weights_keep_greedy_answers_identical(model_dir):
    """With int4-a16 weights (the row-major layout the default's blocks replaced) speculation's
    answers are still the plain ones, token for token."""
    parser = argparse.ArgumentParser()
    speculative.add_arguments(parser)
    args = parser.parse_args(["--weights", "int4-a16", "--prompts", "2", "--tokens", "16", "--batches", "1",
                              "--workloads", "rewrite", "--row-costs"])
    report = speculative.run(args, progress=open("/dev/null", "w"))
    row = report["rows"]["rewrite@1"]
    assert report["weights"] == "int4-a16" and not report["replays"]
    assert row["identical"] == row["answers"] == 2 and row["speculative"]["proposed"] > 0
