"""``pdflow bench engine``: a smoke run with tiny sizes prints every format beside its baselines."""

from __future__ import annotations

import pytest

from pdflow.bench import engine


def test_a_small_run_reports_each_format_with_its_floor_and_agreement(model_dir, capsys):
    parser = __import__("argparse").ArgumentParser()
    engine.add_arguments(parser)
    args = parser.parse_args(["--weights", "fp32", "int4", "--batch", "1", "2", "--prefill", "16", "--steps", "2",
                              "--prompts", "3", "--tokens", "4", "--context", "8"])
    report = engine.run(args)
    assert set(report["formats"]) == {"fp32", "int4"} and report["read_bandwidth"] > 1e8
    for name, row in report["formats"].items():
        assert set(row["decode"]) == {1, 2} and all(t > 0 for t in row["decode"].values())
        assert row["weight_bytes"] > 0 and row["prefill"][16] > 0
        assert set(row["decode_dense"]) == {1, 2} and row["decode"] != row["decode_dense"]  # paged, and dense beside
    int4, fp32 = report["formats"]["int4"], report["formats"]["fp32"]
    assert int4["weight_bytes"] < fp32["weight_bytes"] / 4
    assert fp32["agreement"] == 1.0 and fp32["identical_answers"] == 3
    assert int4["agreement"] >= 0.9  # SmolLM2's int4 weights are its own (Q4_1) weights
    assert len(report["compute"]) == 2 and all(c["one"] > 1e8 and c["all"] > 1e8 for c in report["compute"])
    text = engine.table(report)
    assert "GFLOP/s on 1 thread" in text
    for needed in ("transformers", "fp32", "int4", "eff. BW", "pdflow / transformers", "paged / dense"):
        assert needed in text


def test_a_llama_cpp_interpreter_that_crashes_is_named_by_its_signal(tmp_path):
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"killed by SIGSEGV.*nothing on stderr"):
        engine.llama_cpp_times(str(crashing), "model.gguf", 2, 8, 2, [16])
