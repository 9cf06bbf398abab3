"""The structural KV codecs: which blocks ``sink-window`` keeps, which heads ``head-prune`` prunes
(from a list or an importance file), and decode attending with what they keep: PyTorch's
attention, pdflow's kernel over a dense batch and over scattered pool blocks all give the tokens
that teacher-forced logits from the same kept KV give."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pdflow.kv.codecs import codec, from_spec
from pdflow.kv.codecs.structural import least_important, load_importance


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 200, 1000, 4097])
@pytest.mark.parametrize(("sink", "window"), [(0, 64), (4, 100), (64, 1), (130, 300)])
def test_sink_and_window_are_kept_in_whole_blocks(tokens, sink, window):
    bt = 64
    kept = codec("sink-window", sink=sink, window=window).kept_blocks(tokens, bt)
    blocks = -(-tokens // bt)
    assert kept == sorted(set(kept)) and kept[-1] == blocks - 1
    covered = {t for b in kept for t in range(b * bt, min((b + 1) * bt, tokens))}
    assert set(range(min(sink, tokens))) <= covered  # the sink, rounded up to a block
    assert set(range(max(0, tokens - window), tokens)) <= covered  # the window, from a block boundary
    assert len(covered) < min(tokens, -(-sink // bt) * bt + window + bt) + 1  # and no more than a block over
    assert all(min(bt, tokens - b * bt) == bt for b in kept[:-1])  # every kept block but the last is full
    if tokens <= -(-sink // bt) * bt + window:
        assert kept == list(range(blocks))


def test_head_prune_takes_the_least_important_heads_from_a_calibration(tmp_path):
    importance = [[0.5, 0.1, 0.9], [0.01, 0.02, 0.03], [0.2, 0.8, 0.05]]
    path = tmp_path / "importance.json"
    path.write_text(json.dumps({"importance": importance}))
    # the 4 least important of 9, never every head of a layer: 1.0, 1.1 (not 1.2: layer 1 keeps one), 2.2, 0.1
    assert least_important(importance, 4 / 9) == [(0, 1), (1, 0), (1, 1), (2, 2)]
    c = codec("head-prune", calibration=str(path), fraction=4 / 9)
    assert c.spec == "head-prune:pruned=0.1/1.0/1.1/2.2"  # self-contained: no file named in chunk headers
    assert from_spec(c.spec) == c
    assert c.kept_heads(1, 3) == [False, False, True] and c.kept_heads(5, 3) is None
    assert c.encoded_bytes(64, 0, 3, 64, 4, layer=1) == 64 * 64 * 4
    shipped = load_importance("smollm2")
    assert len(shipped) == 30 and all(len(row) == 3 for row in shipped)
    pruned = codec("head-prune", calibration="smollm2", fraction=0.2).pruned
    assert sum(map(len, pruned.values())) == 18 and all(len(heads) < 3 for heads in pruned.values())


@pytest.mark.parametrize(("params", "message"), [
    ({"pruned": "3-1"}, "layer.head pairs"),
    ({"pruned": "1.1", "calibration": "smollm2"}, "not both"),
    ({"fraction": 0.2}, "needs a calibration"),
    ({"calibration": "smollm2", "fraction": 1.5}, "fraction must be"),
    ({"calibration": "no-such-model", "fraction": 0.1}, "no importance file"),
])
def test_head_prune_parameters_that_cannot_work_are_named(params, message):
    with pytest.raises(ValueError, match=message):
        codec("head-prune", **params)


def test_head_prune_refuses_a_model_it_does_not_fit(tmp_path):
    with pytest.raises(ValueError, match="the model has 30 layers of 3 kv heads"):
        codec("head-prune", pruned="30.0").check_model(30, 3)
    with pytest.raises(ValueError, match="every kv head of layer 2"):
        codec("head-prune", pruned="2.0/2.1/2.2").check_model(30, 3)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"importance": [[1.0, 2.0], [1.0]]}))
    with pytest.raises(ValueError, match="one row of finite numbers per layer"):
        codec("head-prune", calibration=str(bad), fraction=0.1)


# ---- decode attending with what is kept (the real model, fp32 weights) ----

BT = 16
DECODE_CODECS = [("sink-window", {"sink": 4, "window": 40}), ("head-prune", {"pruned": "0.1/3.0/10.2/29.1"}),
                 ("head-prune", {"calibration": "smollm2", "fraction": 0.3})]


def _greedy_from(batch, seq, steps: int) -> list[int]:
    tokens = []
    for _ in range(steps):
        tokens.extend(token for _, token in batch.step())
    batch.remove(seq)
    return tokens


@pytest.mark.parametrize(("name", "params"), DECODE_CODECS, ids=[d[0] + str(i) for i, d in enumerate(DECODE_CODECS)])
def test_decode_attends_with_the_kept_kv_alike_in_every_batch(loaded_model, name, params):
    from pdflow.bench.kv_codecs import compressed, logits_after, prompt_kv
    from pdflow.engine import DecodeBatch, Sampler, Sequence, prefill
    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout
    from pdflow.messages import SamplingParams

    loaded, tokenizer = loaded_model
    ids = tokenizer.encode("The tide came in slowly over the flat grey sand, and the gulls " * 12)[:150]
    keys, values = prompt_kv(loaded, ids)
    past = compressed(codec(name, **params), keys, values, BT)
    kept = past.keys[0].shape[0]
    assert (kept < len(ids)) == (name == "sink-window")
    assert (past.kv_keep is not None) == (name == "head-prune")
    # the first token comes from prefill (all of the prompt); decode goes on from it
    first = prefill(loaded, ids, Sampler(SamplingParams(max_tokens=1, temperature=0)), lambda *_: None).first_token
    steps = 12

    def sequence(rid):
        return Sequence(rid, kept, first, Sampler(SamplingParams(max_tokens=100, temperature=0)),
                        skipped=len(ids) - kept)

    def layer_kv(layer):
        return past.keys[layer].transpose(0, 1), past.values[layer].transpose(0, 1)

    keep = None if past.kv_keep is None else past.kv_keep.to(torch.uint8)
    outputs = []
    for kernel in (False, True):
        batch = DecodeBatch(loaded, 1, attention_kernel=kernel)
        batch.kv_keep = keep
        seq = sequence(f"dense-{kernel}")
        batch.add(seq, layer_kv)
        outputs.append(_greedy_from(batch, seq, steps))
    pool = KvPool(ArenaLayout(loaded.layout, BT, 64))
    random.Random(3).shuffle(pool._free)  # scattered slots
    paged = PagedDecodeBatch(loaded, 1, pool)
    paged.kv_keep = keep
    seq = sequence("paged")
    paged.add_from(seq, layer_kv)
    outputs.append(_greedy_from(paged, seq, steps))
    assert pool.free_slots == 64
    # teacher-forced from the same kept KV: the greedy tokens are the argmax at every position
    logits = logits_after(loaded, past, [first] + outputs[0][:-1])
    assert outputs[0] == outputs[1] == outputs[2] == logits.argmax(-1).tolist(), outputs
    # and the codec matters: with all of the KV the logits are others
    full = logits_after(loaded, compressed(codec("none"), keys, values, BT), [first] + outputs[0][:-1])
    assert (full - logits).abs().max() > 0.1
