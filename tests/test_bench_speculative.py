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
    text = speculative.table(report)
    assert "multiturn" in text and "on/off" in text
