"""`pdflow plan`: KV sizes from model shapes, transfer times, a trace's hit ratio against store
capacity, and a P:D split; each figure checked against a computation done another way (the
codec's own encoding, a step-by-step simulation of layer streaming, a plain LRU store)."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from pdflow import cli
from pdflow.plan import capacity, kv_bytes, ratio, shapes, transfer

EXCERPT = Path(__file__).parent / "data" / "conversation_trace_excerpt.jsonl"


# --- shapes and bytes ----------------------------------------------------------------------

def test_llama_3_70b_keeps_320_kib_a_token_in_fp16_and_40_gib_for_128k_tokens():
    shape = shapes.lookup("Llama-3-70B")
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (80, 8, 128)
    fp16 = kv_bytes.size_of(shape, "fp16")
    assert fp16.bytes_per_token == 80 * 8 * 128 * 2 * 2 == 320 * 1024
    assert fp16.bytes_for(128 * 1024) == 40 * 2**30
    assert kv_bytes.size_of(shape, "fp8").bytes_per_token == 160 * 1024


def test_the_served_models_config_gives_the_tables_shape(model_dir):
    from_file = shapes.from_config(model_dir / "config.json")
    known = shapes.KNOWN["smollm2-135m"]
    assert (from_file.layers, from_file.kv_heads, from_file.head_dim) == (known.layers, known.kv_heads, known.head_dim)


def test_a_config_without_head_dim_or_kv_heads_takes_them_from_hidden_size_and_heads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}))  # plain multi-head
    shape = shapes.from_config(tmp_path)
    assert (shape.kv_heads, shape.head_dim) == (32, 128) and shape.name == tmp_path.name


def test_mla_is_sized_from_its_latent_and_the_codecs_say_they_do_not_cover_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "num_attention_heads": 128,
                                                      "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    shape = shapes.from_config(tmp_path)
    assert shape.attention == "mla"
    assert shape.elements_per_token == 61 * 576 == shapes.KNOWN["deepseek-v3"].elements_per_token
    assert kv_bytes.size_of(shape, "bf16").bytes_per_token == 61 * 576 * 2
    int8 = kv_bytes.size_of(shape, "int8")
    assert int8.bytes_per_token is None and "MLA" in int8.note


def test_a_bad_config_is_named_with_its_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": "many"}))
    with pytest.raises(ValueError, match=r"config\.json: num_hidden_layers must be a positive integer"):
        shapes.from_config(tmp_path)
    with pytest.raises(ValueError, match="unknown model 'gpt-9'.*llama-3-70b"):
        shapes.lookup("gpt-9")
    with pytest.raises(ValueError, match="unknown KV dtype 'fp7'"):
        kv_bytes.size_of(shapes.KNOWN["llama-3-8b"], "fp7")


@pytest.mark.parametrize("name", kv_bytes.CODECS)
def test_codec_rows_are_the_bytes_the_codec_writes(name):
    import torch

    from pdflow.kv.codecs import codec
    from pdflow.kv.kinds import KEYS, VALUES

    shape = shapes.KNOWN["smollm2-135m"]
    block, tokens = 64, 256
    encoder = codec(name)
    kv = torch.randn(tokens, shape.kv_heads, shape.head_dim)
    written = sum(encoder.encode_run(kv, kind, block).numel() for kind in (KEYS, VALUES)) * shape.layers
    assert kv_bytes.size_of(shape, name, block).bytes_for(tokens) == written


# --- transfer ------------------------------------------------------------------------------

def test_link_speeds_are_decimal():
    assert transfer.bytes_per_s(400) == 50e9  # not 6.25 MB/s
    move = transfer.transfer(50e9, 80, 400)
    assert move.whole_s == pytest.approx(1.0) and move.per_layer_s == pytest.approx(1 / 80)
    with pytest.raises(ValueError, match="> 0 Gbit/s"):
        transfer.bytes_per_s(0)


def test_the_streamed_tail_is_what_sending_each_layer_as_it_is_computed_gives():
    rng = random.Random(1)
    for _ in range(200):
        layers, total = rng.randint(1, 100), rng.uniform(1e6, 1e10)
        gbit, prefill_s, latency = rng.choice([1, 10, 25, 100, 400]), rng.uniform(0.001, 5), rng.uniform(0, 1e-3)
        move = transfer.transfer(total, layers, gbit, prefill_s, latency)
        per_layer = total / layers / transfer.bytes_per_s(gbit)
        link_free = 0.0
        for i in range(1, layers + 1):  # layer i is computed at prefill_s * i / layers
            link_free = max(link_free, prefill_s * i / layers) + per_layer
        assert move.streamed_tail_s == pytest.approx(link_free - prefill_s + latency, rel=1e-9, abs=1e-12)
        assert move.whole_s == pytest.approx(total / transfer.bytes_per_s(gbit) + latency)
        assert move.streamed_tail_s <= move.whole_s + 1e-12


# --- capacity ------------------------------------------------------------------------------

def _lru_hit_ratio(rows: list[dict], capacity_blocks: int, block_tokens: int) -> float:
    """A plain LRU store, request by request: the leading run of held blocks is hit, and every
    block of the prompt is then touched (read, or computed and stored)."""
    store: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for row in rows:
        remaining, prefix = row["input_length"], True
        total += remaining
        for block in row["hash_ids"]:
            tokens = min(block_tokens, max(remaining, 0))
            remaining -= block_tokens
            prefix = prefix and block in store
            hit += tokens if prefix else 0
            store[block] = None
            store.move_to_end(block)
            while len(store) > capacity_blocks:
                store.popitem(last=False)
    return hit / total


def test_the_hit_curve_is_a_plain_lru_store_at_every_capacity():
    rows = capacity.read_trace(EXCERPT)
    curve = capacity.hit_curve(rows, 512)
    assert curve.requests == 40 and 0 < curve.unbounded < 1
    for blocks in (1, 2, 5, 10, 30, 100, 200, curve.distinct_blocks, 10**6):
        assert curve.at(blocks) == pytest.approx(_lru_hit_ratio(rows, blocks, 512)), blocks
    assert curve.at(10**6) == curve.unbounded
    assert curve.at(curve.blocks_for(0.9)) >= 0.9 * curve.unbounded > curve.at(curve.blocks_for(0.9) - 1)


def test_a_synthetic_trace_with_shared_prefixes_and_evictions():
    rng = random.Random(7)
    rows = []
    for n in range(300):
        conversation = rng.randrange(12)
        turns = rng.randint(1, 6)
        ids = [conversation * 1000 + k for k in range(turns)] + [10**6 + n]  # its own last block
        rows.append({"timestamp": n, "input_length": len(ids) * 16 - rng.randrange(16), "hash_ids": ids})
    curve = capacity.hit_curve(rows, 16)
    for blocks in (1, 3, 8, 20, 50, 90, 400):
        assert curve.at(blocks) == pytest.approx(_lru_hit_ratio(rows, blocks, 16)), blocks


def test_a_malformed_trace_line_is_named(tmp_path):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"input_length": 5}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: hash_ids must be a list of integers"):
        capacity.read_trace(bad)


# --- ratio ---------------------------------------------------------------------------------

def test_the_split_covers_each_pool_within_its_utilization():
    s = ratio.split(rate=2, input_tokens=12000, output_tokens=340, prefill_capacity=9000,
                    decode_capacity=600, hit_ratio=0.375, utilization=0.8)
    assert s.prefill_tokens_per_s == pytest.approx(15000) and s.decode_tokens_per_s == 680
    assert (s.prefill, s.decode) == (3, 2)  # 15000 / 7200 -> 3; 680 / 480 -> 2
    assert s.prefill_utilization <= 0.8 and s.decode_utilization <= 0.8 and s.ratio == "3:2"
    with pytest.raises(ValueError, match="hit_ratio"):
        ratio.split(1, 1, 1, 1, 1, hit_ratio=1.0)


def test_capacities_from_an_engine_report():
    report = {"context": 256, "formats": {"bf16": {"prefill": {"512": 0.25, "2048": 1.6},
                                                   "decode": {"1": 0.014, "8": 0.02, "32": 0.05}}}}
    prefill, decode, used = ratio.capacities_from_engine_report(report, input_tokens=1800, tbt_slo_s=0.03)
    assert prefill == 2048 / 1.6 and decode == 8 / 0.02 and "batch 8" in used
    with pytest.raises(ValueError, match="no measured decode batch meets"):
        ratio.capacities_from_engine_report(report, 100, tbt_slo_s=0.001)


# --- the command -----------------------------------------------------------------------------

def test_the_command_prints_tables_and_json(capsys, tmp_path):
    assert cli.main(["plan", "kv", "--model", "llama-3-70b", "--tokens", "131072"]) == 0
    out = capsys.readouterr().out
    assert "320 KiB" in out and "40.0 GiB" in out
    assert cli.main(["plan", "transfer", "--model", "llama-3-70b", "--tokens", "8192", "--gbit", "400",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["links"][0]["whole_s"] == pytest.approx(8192 * 327680 / 50e9)
    assert cli.main(["plan", "capacity", "--trace", str(EXCERPT), "--model", "smollm2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 40 and report["curve"][-1]["hit_ratio"] == report["unbounded_hit_ratio"]
    assert cli.main(["plan", "ratio", "--rate", "1", "--trace", str(EXCERPT), "--prefill-tokens-per-s", "5000",
                     "--decode-tokens-per-s", "500"]) == 0
    assert "P:D = " in capsys.readouterr().out


def test_the_command_names_what_is_wrong(capsys):
    assert cli.main(["plan", "kv", "--model", "gpt-9"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err
    assert cli.main(["plan", "transfer", "--model", "deepseek-v3", "--kv", "int8"]) == 2
    assert "MLA latent is not covered" in capsys.readouterr().err
    assert cli.main(["plan", "ratio", "--rate", "1", "--input", "10", "--output", "5"]) == 2
    assert "--prefill-tokens-per-s" in capsys.readouterr().err
