"""pdflow.engine.packed_cache: the compact engine's packed weights kept on disk, read back at the
next load without transformers, named by everything they depend on, repacked when unreadable."""

from __future__ import annotations

import os

import pytest
import torch

from pdflow.engine import loader, packed_cache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setenv("PDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, eos_token_id=7)
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _logits(loaded) -> torch.Tensor:
    class Keep:
        def update(self, keys, values, layer, **_):
            return keys, values

    ids = torch.arange(3, 19)[None]
    return loaded.model(ids, torch.arange(16)[None], None, Keep())


def _no_transformers(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("packed again")
    monkeypatch.setattr(loader, "load_transformers_model", refuse)


@pytest.mark.parametrize("weights", ["fp32", "int4-a16", "int4-a16-blocked"])
def test_the_second_load_reads_the_packed_copy_and_computes_the_same(tiny, monkeypatch, weights):
    first = loader.load_model(tiny, weights=weights)
    path = packed_cache.path_for(tiny, weights, torch.float32)
    assert path.is_file() and oct(path.stat().st_mode & 0o777) == "0o600"
    _no_transformers(monkeypatch)
    second = loader.load_model(tiny, weights=weights)
    assert torch.equal(_logits(first), _logits(second))
    assert (second.layout, second.eos_token_ids, second.max_context, second.weights) == \
           (first.layout, first.eos_token_ids, first.max_context, first.weights)
    assert second.eos_token_ids == frozenset({7})


def test_a_model_changed_on_disk_or_another_format_is_packed_anew(tiny):
    before = packed_cache.path_for(tiny, "int4-a16", torch.float32)
    assert packed_cache.path_for(tiny, "int8", torch.float32) != before
    assert packed_cache.path_for(tiny, "int4-a16", torch.bfloat16) != before
    weights_file = next(tiny.glob("*.safetensors"))
    stat = weights_file.stat()
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert packed_cache.path_for(tiny, "int4-a16", torch.float32) != before


def test_an_unreadable_copy_is_packed_again(tiny, monkeypatch, caplog):
    want = _logits(loader.load_model(tiny, weights="int4-a16"))
    path = packed_cache.path_for(tiny, "int4-a16", torch.float32)
    path.write_bytes(b"not a checkpoint")
    again = loader.load_model(tiny, weights="int4-a16")
    assert "unreadable" in caplog.text and torch.equal(_logits(again), want)
    _no_transformers(monkeypatch)  # and the copy written this time is whole
    assert torch.equal(_logits(loader.load_model(tiny, weights="int4-a16")), want)


def test_the_cache_can_be_turned_off_and_keeps_only_the_latest_copies(tiny, monkeypatch):
    monkeypatch.setenv("PDFLOW_PACKED_CACHE", "0")
    loader.load_model(tiny, weights="int8")
    assert not packed_cache.path_for(tiny, "int8", torch.float32).exists()
    monkeypatch.delenv("PDFLOW_PACKED_CACHE")
    monkeypatch.setattr(packed_cache, "KEEP", 2)
    for weights in ("fp32", "int8", "int4"):
        loader.load_model(tiny, weights=weights)
    kept = sorted(p.name for p in packed_cache.path_for(tiny, "fp32", torch.float32).parent.glob("*.pt"))
    assert len(kept) == 2 and not any("-fp32-" in name for name in kept)
