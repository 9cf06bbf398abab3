"""pdflow.kv.layout: offsets and sizes of one request's KV buffer, views into it, the chunk checksum."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import xxhash

from pdflow.kv.layout import KEYS, VALUES, KvLayout, checksum, dtype_name, torch_dtype

# SmolLM2-135M: 30 layers, 9 attention heads of 64 over a hidden size of 576, 3 KV heads.
SMOLLM2 = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")


def test_smollm2_sizes() -> None:
    assert SMOLLM2.itemsize == 4
    assert SMOLLM2.block_bytes(1) == 3 * 64 * 4 == 768
    assert SMOLLM2.block_bytes(17) == 17 * 768
    assert SMOLLM2.request_bytes(1) == 2 * 30 * 768 == 46_080
    assert SMOLLM2.request_bytes(100) == 4_608_000
    assert SMOLLM2.request_bytes(0) == 0


def test_smollm2_offsets_and_shapes() -> None:
    n = 17
    block = 17 * 768
    assert SMOLLM2.offset(n, 0, KEYS) == 0
    assert SMOLLM2.offset(n, 0, VALUES) == block
    assert SMOLLM2.offset(n, 1, KEYS) == 2 * block
    assert SMOLLM2.offset(n, 29, VALUES) == 59 * block == SMOLLM2.request_bytes(n) - block
    assert SMOLLM2.shape(n, KEYS) == SMOLLM2.shape(n, VALUES) == (17, 3, 64)  # token-major
    assert SMOLLM2.offset(n, 1, VALUES, token=5) == 3 * block + 5 * 768


@pytest.mark.parametrize("n", [1, 7, 128])
def test_blocks_tile_the_buffer(n: int) -> None:
    blocks = sorted(
        (SMOLLM2.offset(n, layer, kind), SMOLLM2.block_bytes(n))
        for layer in range(SMOLLM2.num_layers) for kind in (KEYS, VALUES)
    )
    assert len(blocks) == 60
    end = 0
    for start, size in blocks:
        assert start == end, "a gap or an overlap between blocks"
        assert size == torch.Size(SMOLLM2.shape(n, KEYS)).numel() * SMOLLM2.itemsize
        end = start + size
    assert end == SMOLLM2.request_bytes(n)


def _fill(layout: KvLayout, n: int, seed: int = 0) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A flat uint8 buffer with every layer's keys and values (tokens, heads, dim) written at their
    offsets, the way prefill sends them; and the originals."""
    dtype = torch_dtype(layout.dtype)
    g = torch.Generator().manual_seed(seed)
    buffer = torch.zeros(layout.request_bytes(n), dtype=torch.uint8)
    originals = []
    for layer in range(layout.num_layers):
        keys = torch.randn(layout.shape(n, KEYS), generator=g).to(dtype)
        values = torch.randn(layout.shape(n, VALUES), generator=g).to(dtype)
        for kind, tensor in ((KEYS, keys), (VALUES, values)):
            start = layout.offset(n, layer, kind)
            raw = tensor.contiguous().view(torch.uint8).flatten()
            assert raw.numel() == layout.block_bytes(n)
            buffer[start : start + raw.numel()] = raw
        originals.append((keys, values))
    return buffer, originals


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_views_give_back_keys_and_values_head_major(dtype: str) -> None:
    layout = KvLayout(30, 3, 64, dtype)
    n = 7
    buffer, originals = _fill(layout, n)
    for layer, (keys, values) in enumerate(originals):
        k, v = layout.views(buffer, n, layer)
        assert k.dtype == v.dtype == torch_dtype(dtype)
        assert k.shape == v.shape == (3, n, 64)
        assert torch.equal(k, keys.transpose(0, 1))
        assert torch.equal(v, values.transpose(0, 1))
        assert torch.equal(v[:, 4], values[4])  # token 4 of every head


def test_views_are_views_not_copies() -> None:
    n = 5
    buffer, _ = _fill(SMOLLM2, n)
    k, v = SMOLLM2.views(buffer, n, 3)
    assert k.data_ptr() == buffer.data_ptr() + SMOLLM2.offset(n, 3, KEYS)
    assert v.data_ptr() == buffer.data_ptr() + SMOLLM2.offset(n, 3, VALUES)
    k.zero_()
    v.fill_(2.0)
    start = SMOLLM2.offset(n, 3, KEYS)
    assert not buffer[start : start + SMOLLM2.block_bytes(n)].any()
    values = buffer[SMOLLM2.offset(n, 3, VALUES) :][: SMOLLM2.block_bytes(n)].view(torch.float32)
    assert torch.equal(values, torch.full_like(values, 2.0))
    # the neighbours are untouched
    k2, _ = SMOLLM2.views(buffer, n, 4)
    assert k2.abs().sum() > 0


def test_views_of_a_larger_buffer_and_one_token() -> None:
    """A pool region can be bigger than the request: views read from its start."""
    n = 1
    filled, originals = _fill(SMOLLM2, n, seed=3)
    region = torch.zeros(SMOLLM2.request_bytes(n) + 1000, dtype=torch.uint8)
    region[: filled.numel()] = filled
    k, v = SMOLLM2.views(region, n, 29)
    assert torch.equal(k, originals[29][0].transpose(0, 1)) and torch.equal(v, originals[29][1].transpose(0, 1))


def test_half_precision_itemsize() -> None:
    for dtype in ("bfloat16", "float16"):
        layout = KvLayout(30, 3, 64, dtype)
        assert layout.itemsize == 2
        assert layout.block_bytes(17) == 17 * 3 * 64 * 2
        assert layout.request_bytes(17) * 2 == SMOLLM2.request_bytes(17)
        assert layout.offset(17, 1, VALUES) * 2 == SMOLLM2.offset(17, 1, VALUES)


def test_dtype_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float16") is torch.float16
    assert [dtype_name(torch_dtype(name)) for name in ("float32", "bfloat16", "float16")] == [
        "float32", "bfloat16", "float16",
    ]
    with pytest.raises(ValueError, match="int8"):
        torch_dtype("int8")
    with pytest.raises(ValueError):
        KvLayout(30, 3, 64, "float64").itemsize


def test_from_config() -> None:
    smollm2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert KvLayout.from_config(smollm2) == SMOLLM2
    explicit = SimpleNamespace(num_hidden_layers=2, hidden_size=576, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=128)
    assert KvLayout.from_config(explicit, "bfloat16") == KvLayout(2, 3, 128, "bfloat16")
    mha = SimpleNamespace(num_hidden_layers=4, hidden_size=256, num_attention_heads=4)  # no GQA
    assert KvLayout.from_config(mha) == KvLayout(4, 4, 64)


def test_from_model_dir(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, '
                                          '"num_key_value_heads": 3, "model_type": "llama"}')
    assert KvLayout.from_model_dir(tmp_path) == SMOLLM2
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        KvLayout.from_model_dir(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        KvLayout.from_model_dir(tmp_path / "absent")


def test_checksum_is_xxh3_64() -> None:
    data = bytes(range(256)) * 40
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    assert checksum(b"") == xxhash.xxh3_64_intdigest(b"")
    assert 0 <= checksum(data) < 2**64


def test_checksum_reads_buffers_without_bytes() -> None:
    buffer, _ = _fill(SMOLLM2, 3)
    view = memoryview(buffer.numpy())
    assert checksum(view) == xxhash.xxh3_64_intdigest(buffer.numpy().tobytes())
    start, size = SMOLLM2.offset(3, 2, VALUES), SMOLLM2.block_bytes(3)
    assert checksum(view[start : start + size]) == xxhash.xxh3_64_intdigest(bytes(view[start : start + size]))


def test_checksum_changes_with_any_byte() -> None:
    data = bytearray(bytes(range(256)) * 4)
    before = checksum(data)
    for i in (0, 1, 511, len(data) - 1):
        changed = bytearray(data)
        changed[i] ^= 0x01
        assert checksum(changed) != before, i
    assert checksum(data[:-1]) != before  # and with the length
    assert checksum(bytes(data)) == before  # but not with the container
