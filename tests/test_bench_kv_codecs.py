"""``pdflow bench kv-codecs`` on a few prompts: the numbers it reports hold together (lossless
`none` is the reference itself; lossy codecs save what they say and cost something measurable)."""

from __future__ import annotations

import argparse
import math

from pdflow.bench import kv_codecs


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kv_codecs.add_arguments(parser)
    args = parser.parse_args(["--prompts", "3", "--tokens", "6", "--windows", "1", "--context", "160",
                              "--scored", "24", "--codecs", "none", "int8", "int4:symmetric=1",
                              "head-prune:pruned=1.0/4.2", "sink-window:sink=4,window=20"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_report_holds_together(model_dir, capsys):
    report = kv_codecs.run(_args(), progress=open("/dev/null", "w"))
    rows = report["codecs"]
    none, int8, int4 = rows["none"], rows["int8"], rows["int4:symmetric=1"]
    assert none["agreement"] == 1.0 and none["kl_mean"] == 0.0 and none["same"] == 3
    assert none["bytes_per_token"] == none["fp32_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert none["fp32_bytes_per_token"] / int8["bytes_per_token"] >= 3.9
    assert none["fp32_bytes_per_token"] / int4["bytes_per_token"] >= 7.0
    for row in (int8, int4):
        assert row["positions"] == 3 * 5 and 0 <= row["agreement"] <= 1 and row["kl_mean"] > 0
        assert math.isfinite(row["ppl"]["160"]) and row["both_gbs"] > 0
    assert int4["kl_mean"] > int8["kl_mean"]  # 4 bits cost more than 8
    assert none["agreement_at"]["160"] == 1.0 and none["kl_mean_at"]["160"] == 0.0
    # head pruning: 2 of 90 kv heads' bytes saved, at a cost; sink + window: blocks of the 160-token
    # past dropped (its first 64-token block and the window from token 128 kept), at a cost there only
    pruned, window = rows["head-prune:pruned=1.0/4.2"], rows["sink-window:sink=4,window=20"]
    assert pruned["bytes_per_token"] * 90 == none["bytes_per_token"] * 88 and pruned["kl_mean"] > 0
    assert window["bytes_per_token"] * 32 == none["bytes_per_token"]  # of a 4,096-token prompt: 2 blocks kept
    assert window["kl_mean_at"]["160"] > 0 and window["agreement_at"]["160"] <= 1
    text = kv_codecs.table(report)
    assert "int4:symmetric=1" in text and "ppl@160" in text and "agree@160" in text


def test_the_held_out_text_is_english_prose_shipped_with_python():
    text = kv_codecs.held_out_text()
    assert len(text) > 100_000 and " the " in text
