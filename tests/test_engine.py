"""The engine's greedy output equals transformers' own generate(), alone and in a running batch."""

from __future__ import annotations

import pytest
import torch

from pdflow.engine import DecodeBatch, Sampler, Sequence, prefill
from pdflow.messages import SamplingParams

NEW_TOKENS = 16
PROMPTS = [
    "What is the capital of France?",
    "hi",
    "Write a haiku about the sea and the wind blowing over waves at night.",
    "Explain, step by step, how a transformer language model turns a prompt into an answer. "
    + "Cover tokenization, embeddings, attention, the feed-forward layers and sampling. " * 6,
]


@pytest.fixture(scope="module")
def engine(loaded_model):
    loaded, tokenizer = loaded_model
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for p in PROMPTS
    ]
    return loaded, prompts


@pytest.fixture(scope="module")
def reference(engine, transformers_model):
    """transformers' generate()'s greedy tokens, cut after the first end-of-sequence token."""
    loaded, prompts = engine
    out = []
    for ids in prompts:
        generated = transformers_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = generated[0, len(ids):].tolist()
        for i, t in enumerate(tokens):
            if t in loaded.eos_token_ids:
                tokens = tokens[: i + 1]
                break
        out.append(tokens)
    return out


def _greedy() -> Sampler:
    return Sampler(SamplingParams(max_tokens=NEW_TOKENS, temperature=0))


# (model, prompt) -> the model and the prompt's first token and KV: the tests of decoding take each
# prompt's prefill from here (a batch copies the KV in), computed once a model (50 prefills -> 8);
# each entry holds its model, so that the model's id in the key cannot be another's later
_PREFILLS: dict[tuple[int, tuple[int, ...]], tuple[object, int, dict]] = {}


def _prefilled(loaded, ids, request_id, fresh: bool = False):
    """Prefill one prompt (``fresh``: computed now, not taken from earlier tests'); return its
    Sequence and a layer -> (keys, values) function."""
    key = (id(loaded), tuple(ids))
    if fresh or key not in _PREFILLS:
        kv = {}

        def sink(layer, keys, values):
            kv[layer] = (keys.transpose(0, 1), values.transpose(0, 1))

        result = prefill(loaded, ids, _greedy(), sink)
        if fresh:
            return Sequence(request_id, len(ids), result.first_token, _greedy()), kv.__getitem__
        _PREFILLS[key] = (loaded, result.first_token, kv)
    _, first_token, kv = _PREFILLS[key]
    return Sequence(request_id, len(ids), first_token, _greedy()), kv.__getitem__


def _decode(loaded, prompts, join_after: dict[int, int] | None = None, attention_kernel: bool = True,
            batch=None, fresh_prefills: bool = False) -> list[list[int]]:
    """Decode all prompts in one batch (``batch``, or a dense one); prompt i joins after
    ``join_after[i]`` steps (default 0). ``fresh_prefills``: each prompt prefilled now."""
    join_after = join_after or {}
    batch = DecodeBatch(loaded, max_batch=8, attention_kernel=attention_kernel) if batch is None else batch
    add = getattr(batch, "add_from", batch.add)  # a paged batch: the KV copied into its pool's slots
    outputs: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    step = 0
    while waiting or len(batch):
        for i in [i for i in waiting if join_after.get(i, 0) <= step]:
            seq, layer_kv = _prefilled(loaded, prompts[i], str(i), fresh_prefills)
            add(seq, layer_kv)
            outputs[i] = [seq.next_token]
            waiting.remove(i)
        for seq, token in batch.step():
            outputs[int(seq.request_id)].append(token)
        for seq in list(batch.sequences):
            if seq.generated >= NEW_TOKENS or seq.next_token in loaded.eos_token_ids:
                batch.remove(seq)
        step += 1
    return [outputs[i] for i in range(len(prompts))]


# decode attends with pdflow's kernel where it runs, else with PyTorch's sdpa and a mask: both
# (alone and all at once are the kernel's only; joining a running batch covers both for each path)
ATTENTION = pytest.mark.parametrize("attention_kernel", [True, False], ids=["kernel", "sdpa"])


def test_each_prompt_alone_equals_generate(engine, reference):
    loaded, prompts = engine
    for ids, expected in zip(prompts, reference):
        assert _decode(loaded, [ids]) == [expected]


def test_batched_equals_generate(engine, reference):
    loaded, prompts = engine
    assert _decode(loaded, prompts) == reference


@ATTENTION
def test_requests_joining_a_running_batch_equal_generate(engine, reference, attention_kernel):
    loaded, prompts = engine
    assert _decode(loaded, prompts, join_after={1: 3, 2: 5, 3: 9}, attention_kernel=attention_kernel) == reference


@ATTENTION
def test_uninitialised_batch_memory_never_reaches_attention(engine, reference, monkeypatch, attention_kernel):
    """The batch buffers (and prefill's) are allocated uninitialised: poisoned with NaN instead,
    joins, leaves and growth must still give generate()'s tokens (a NaN read anywhere would spread)."""
    import pdflow.engine.decode as decode_module

    def poisoned(*shape, **kwargs):
        return torch.full(*shape, float("nan"), **kwargs) if len(shape) == 1 else torch.full(shape, float("nan"), **kwargs)

    monkeypatch.setattr(decode_module.torch, "empty", poisoned)
    loaded, prompts = engine
    assert _decode(loaded, prompts, join_after={1: 3, 2: 5, 3: 9}, attention_kernel=attention_kernel,
                   fresh_prefills=True) == reference


def test_france_answer(engine, reference, loaded_model):
    tokenizer = loaded_model[1]
    assert "Paris" in tokenizer.decode(reference[0])


def test_prefill_hands_out_every_layer_in_order_with_the_models_own_kv(engine, transformers_model):
    loaded, prompts = engine
    ids = prompts[2]
    seen = []

    def sink(layer, keys, values):
        seen.append((layer, keys.clone(), values.clone()))

    prefill(loaded, ids, _greedy(), sink)
    layout = loaded.layout
    assert [layer for layer, _, _ in seen] == list(range(layout.num_layers))
    with torch.inference_mode():
        cache = transformers_model(torch.tensor([ids]), use_cache=True).past_key_values
    for layer, keys, values in seen:
        assert keys.shape == layout.shape(len(ids), 0) and keys.is_contiguous()
        assert values.shape == layout.shape(len(ids), 1) and values.is_contiguous()
        expected_k = cache.layers[layer].keys[0]
        expected_v = cache.layers[layer].values[0]
        # the fused projections add in another order: equal up to float rounding of values that
        # reach ~12 (an fp32 ulp there is ~1e-6; sums of 576 products differ by a few ulps)
        torch.testing.assert_close(keys.transpose(0, 1), expected_k, rtol=1e-5, atol=5e-5)
        torch.testing.assert_close(values.transpose(0, 1), expected_v, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_then_decode_equals_generate(engine, reference, chunk):
    from pdflow.engine.chunked import ChunkedPrefill

    loaded, prompts = engine
    ids, expected = prompts[3], reference[3]
    prefill_run = ChunkedPrefill(loaded, ids, _greedy())
    first = None
    while first is None:
        first = prefill_run.run(chunk)
    batch = DecodeBatch(loaded, max_batch=2)
    seq = Sequence("0", len(ids), first, prefill_run.sampler)
    batch.add(seq, prefill_run.layer_kv)
    tokens = [first]
    while len(tokens) < len(expected):
        tokens.append(batch.step()[0][1])
    assert tokens == expected


def test_sequences_join_and_leave_after_the_buffers_grew_during_a_step(engine):
    """Growth inside step() makes the buffers inference tensors; add/remove must still work."""
    loaded, _ = engine
    layout = loaded.layout
    batch = DecodeBatch(loaded, max_batch=4)

    def seq(name: str, length: int):
        kv = torch.randn(layout.num_kv_heads, length, layout.head_dim)
        one_token = Sampler(SamplingParams(max_tokens=1, temperature=0))  # reserves no room ahead
        return Sequence(name, length, 100, one_token), lambda layer: (kv, kv)

    batch.add(*seq("a", 254))
    for _ in range(4):  # 254 -> 258 cached tokens: the buffers grow past 256 inside step()
        batch.step()
    batch.add(*seq("b", 10))
    batch.remove(batch.sequences[0])
    batch.add(*seq("c", 300))
    assert [s.request_id for s in batch.sequences] == ["b", "c"]
    assert len(batch.step()) == 2


def _kv_of(loaded, ids):
    """Prefill ``ids``; per layer, its keys and values token-major, and the first token."""
    keys, values = [None] * loaded.num_layers, [None] * loaded.num_layers

    def sink(layer, k, v):
        keys[layer], values[layer] = k.clone(), v.clone()

    result = prefill(loaded, ids, _greedy(), sink)
    return keys, values, result.first_token


@pytest.mark.parametrize("cached", [64, 128])
def test_prefill_after_a_cached_prefix_gives_the_same_kv_and_output(engine, reference, cached):
    """A prompt prefilled after ``cached`` tokens whose KV comes from elsewhere (the store): the new
    tokens' KV matches a whole prefill within float tolerance, and greedy decode equals generate()."""
    loaded, prompts = engine
    ids, expected = prompts[3], reference[3]
    keys, values, first = _kv_of(loaded, ids)
    tail_keys, tail_values = [None] * loaded.num_layers, [None] * loaded.num_layers
    asked = []

    def past(layer):
        asked.append(layer)
        return keys[layer][:cached], values[layer][:cached]

    def sink(layer, k, v):
        assert k.shape[0] == len(ids) - cached
        tail_keys[layer], tail_values[layer] = k.clone(), v.clone()

    sampler = _greedy()
    result = prefill(loaded, ids, sampler, sink, past=past, start=cached)
    assert asked == list(range(loaded.num_layers))
    assert result.first_token == first
    for layer in range(loaded.num_layers):
        torch.testing.assert_close(tail_keys[layer], keys[layer][cached:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tail_values[layer], values[layer][cached:], rtol=1e-4, atol=1e-4)
    full_keys = [torch.cat([keys[i][:cached], tail_keys[i]]) for i in range(loaded.num_layers)]
    full_values = [torch.cat([values[i][:cached], tail_values[i]]) for i in range(loaded.num_layers)]
    batch = DecodeBatch(loaded, max_batch=2)
    seq = Sequence("0", len(ids), result.first_token, sampler)
    batch.add(seq, lambda layer: (full_keys[layer].transpose(0, 1), full_values[layer].transpose(0, 1)))
    tokens = [result.first_token]
    while len(tokens) < len(expected):
        tokens.append(batch.step()[0][1])
    assert tokens == expected
    exported_keys, exported_values = batch.export(seq, cached, len(ids) + 3)
    assert exported_keys[5].shape == (len(ids) + 3 - cached, 3, 64)
    torch.testing.assert_close(exported_keys[5][: len(ids) - cached], tail_keys[5], rtol=0, atol=0)


@pytest.mark.parametrize("prompt,cached", [(0, 0), (3, 0), (3, 16), (0, 16)],
                         ids=["few-rows", "many-rows", "many-rows-after-a-prefix", "few-rows-after-a-prefix"])
def test_prefill_computing_into_scattered_blocks_gives_the_same_kv(engine, prompt, cached):
    """Prefill with ``targets`` and ``attended`` (the KV store's blocks, as prefill over shm computes
    them): each layer's keys and values land in the blocks named, bit for bit what a plain prefill
    hands out, whether the rows go through pdflow's kernels (few) or PyTorch (many), in runs of
    slots that are not consecutive; after a cached prefix read where it is, within float tolerance
    (the new rows are computed in another shape) and with the same first token."""
    from pdflow.kv.arena import ArenaLayout, anonymous_memory, runs

    loaded, prompts = engine
    ids = prompts[prompt]
    keys, values, first = _kv_of(loaded, ids)
    bt = 8
    arena = ArenaLayout(loaded.layout, bt, 64)
    blocks = arena.view(torch.frombuffer(anonymous_memory(arena.nbytes), dtype=torch.uint8))
    scattered = [7, 8, 3, 40, 41, 42, 9, 10, 11, 12, 13, 50, 30, 31]
    slots = (scattered + [s for s in range(64) if s not in scattered])[: -(-len(ids) // bt)]
    spans = [(r.token_start - cached, r.token_end - cached, r.slot, r.count)
             for r in runs(slots[cached // bt :], cached, len(ids), bt)]
    assert len(spans) >= 2
    kv = loaded.layout
    for i, slot in enumerate(slots[: cached // bt]):  # the cached prefix, in its blocks
        blocks[:, 0, slot] = torch.stack([keys[layer][i * bt : (i + 1) * bt] for layer in range(loaded.num_layers)])
        blocks[:, 1, slot] = torch.stack([values[layer][i * bt : (i + 1) * bt] for layer in range(loaded.num_layers)])

    def attended(layer):
        return tuple(blocks[layer, kind, torch.tensor(slots)].reshape(-1, kv.num_kv_heads, kv.head_dim)[: len(ids)]
                     for kind in (0, 1))

    def targets(layer):
        return [(a, b, *(blocks[layer, kind, slot : slot + count].view(-1, kv.num_kv_heads, kv.head_dim)[: b - a]
                         for kind in (0, 1))) for a, b, slot, count in spans]

    handed = {}
    result = prefill(loaded, ids, _greedy(), lambda layer, k, v: handed.__setitem__(layer, (k, v)), start=cached,
                     targets=targets, attended=attended)
    assert result.first_token == first
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if cached else {"rtol": 0, "atol": 0}
    for layer in range(loaded.num_layers):
        for kind, expected in ((0, keys[layer]), (1, values[layer])):
            stored = blocks[layer, kind, torch.tensor(slots)].reshape(-1, kv.num_kv_heads, kv.head_dim)[: len(ids)]
            torch.testing.assert_close(stored, expected, **tolerance)
            torch.testing.assert_close(handed[layer][kind], expected[cached:], **tolerance)


def test_targets_too_small_for_their_rows_are_refused_not_written_past(engine):
    """The kernels write a run's keys unchecked: memory that cannot hold the run is a ValueError."""
    loaded, prompts = engine
    ids = prompts[0]  # few rows: pdflow's fused rotary step
    kv = loaded.layout
    small = torch.empty(len(ids) - 1, kv.num_kv_heads, kv.head_dim)

    def targets(layer):
        return [(0, len(ids), small, torch.empty(len(ids), kv.num_kv_heads, kv.head_dim))]

    with pytest.raises(ValueError, match="cannot go into"):
        prefill(loaded, ids, _greedy(), lambda *_: None, targets=targets)


def test_chunked_prefill_from_a_cached_prefix_equals_generate(engine, reference):
    from pdflow.engine.chunked import ChunkedPrefill

    loaded, prompts = engine
    ids, expected = prompts[3], reference[3]
    keys, values, _ = _kv_of(loaded, ids)
    run = ChunkedPrefill(loaded, ids, _greedy(), past=([k[:96] for k in keys], [v[:96] for v in values]))
    assert run.remaining == len(ids) - 96
    first = None
    while first is None:
        first = run.run(16)
    batch = DecodeBatch(loaded, max_batch=2)
    batch.add(Sequence("0", len(ids), first, run.sampler), run.layer_kv)
    tokens = [first]
    while len(tokens) < len(expected):
        tokens.append(batch.step()[0][1])
    assert tokens == expected
    tail_keys, _ = run.token_major(96, len(ids))
    torch.testing.assert_close(tail_keys[7], keys[7][96:], rtol=1e-4, atol=1e-4)


def test_decode_steps_run_wholly_in_c_equal_the_layer_by_layer_path(engine, served_model, monkeypatch):
    """With the served (quantized) weights, a decode step runs every layer in one call into the
    kernels; the same kernels called layer by layer from Python give the same logits, alone and
    with sequences joining a running batch."""
    import pdflow.engine.decode as decode

    loaded, _ = served_model
    _, prompts = engine
    assert loaded.model.native_layers is not None, "the default weights have a C form"
    seen: list[torch.Tensor] = []
    real_sample = decode.sample_batch

    def keep(logits, samplers):
        seen.append(logits.clone())
        return real_sample(logits, samplers)

    monkeypatch.setattr(decode, "sample_batch", keep)
    whole = _decode(loaded, prompts, join_after={1: 3, 2: 5, 3: 9})
    whole_logits = list(seen)
    seen.clear()
    monkeypatch.setattr(loaded.model, "native_layers", None)
    by_layer = _decode(loaded, prompts, join_after={1: 3, 2: 5, 3: 9})
    assert whole == by_layer
    assert len(whole_logits) == len(seen) > 10
    for a, b in zip(whole_logits, seen):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- paged KV: the batch attends from the blocks the KV landed in ---------------------------------


def _decode_paged(loaded, prompts, join_after: dict[int, int], block_tokens: int, seed: int = 0) -> list[list[int]]:
    """As ``_decode``, each prompt's KV in scattered slots of a pool and the batch attending from there."""
    import random

    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout

    pool = KvPool(ArenaLayout(loaded.layout, block_tokens, 400))
    random.Random(seed).shuffle(pool._free)  # no sequence's blocks are consecutive slots
    outputs = _decode(loaded, prompts, join_after, batch=PagedDecodeBatch(loaded, 8, pool))
    assert pool.free_slots == 400  # every slot came back
    return outputs


@pytest.mark.parametrize("block_tokens", [16, 64])
def test_a_paged_batch_equals_generate_with_scattered_blocks(engine, reference, block_tokens):
    loaded, prompts = engine
    assert _decode_paged(loaded, prompts, {1: 3, 2: 5, 3: 9}, block_tokens) == reference


def test_a_paged_batch_equals_the_dense_one_with_the_served_weights(engine, served_model):
    """The default (quantized) weights, whole steps in C: the same tokens as the dense batch, and
    the answer's KV read back from the blocks equals the dense batch's copy."""
    from pdflow.engine.paged import KvPool, PagedDecodeBatch
    from pdflow.kv.arena import ArenaLayout

    loaded, _ = served_model
    _, prompts = engine
    assert _decode_paged(loaded, prompts, {1: 3, 2: 5, 3: 9}, 16) == _decode(loaded, prompts, {1: 3, 2: 5, 3: 9})
    dense = DecodeBatch(loaded, 2)
    pool = KvPool(ArenaLayout(loaded.layout, 16, 50))
    pool._free.reverse()  # the sequence's blocks in descending slots
    paged = PagedDecodeBatch(loaded, 2, pool)
    seq_d, kv = _prefilled(loaded, prompts[0], "d")
    seq_p, _ = _prefilled(loaded, prompts[0], "p")
    dense.add(seq_d, kv)
    paged.add_from(seq_p, kv)
    for _ in range(20):  # across block boundaries
        assert [t for _, t in dense.step()] == [t for _, t in paged.step()]
    # the prompt's KV (copied in) exactly; the steps' within float tolerance (the kernel's runs of
    # tokens follow the blocks, so its sums go in another order, and quantizing the activations
    # to int16 per group turns last-bit differences into a step of 1/32767: measured 1e-4 relative)
    prompt = len(prompts[0])
    start, end = prompt - 10, seq_d.length - 1
    for a, b in zip(dense.export(seq_d, start, end), paged.export(seq_p, start, end)):
        for x, y in zip(a, b):
            assert torch.equal(x[:10], y[:10])
            assert float((x - y).norm() / x.norm()) < 1e-3
    with pytest.raises(ValueError, match="cannot hold"):
        paged.add(Sequence("x", 40, 1, _greedy()), [0, 1])
