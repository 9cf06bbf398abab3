"""The KV codecs' conformance suite: every registered codec (and the parameter settings that
change its layout) encodes block by block into the bytes it says, decodes back within its
error bound (exactly for lossless ones), decodes in place, and refuses what is malformed."""

from __future__ import annotations

import pytest
import torch

from pdflow.kv.codecs import codec, from_spec, registry
from pdflow.kv.layout import KEYS, VALUES

SETTINGS = [("none", {}), ("int8", {}), ("int8", {"symmetric": False, "key_group": 16, "value_group": 64}),
            ("int4", {}), ("int4", {"symmetric": True, "value_group": 32}), ("int4", {"value_group": 0}),
            ("head-prune", {"pruned": "0.1/2.0/2.2"}), ("sink-window", {"window": 100})]
IDS = [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in SETTINGS]
QUANTIZED = [(name, params) for name, params in SETTINGS if name in ("int8", "int4")]
QUANTIZED_IDS = [IDS[SETTINGS.index(setting)] for setting in QUANTIZED]
HEADS, DIM, BLOCK = 3, 64, 64


def kv(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HEADS, DIM, generator=g) * torch.linspace(0.2, 4.0, HEADS * DIM).view(1, HEADS, DIM)


def test_the_builtin_codecs_are_registered():
    assert {"none", "int8", "int4", "head-prune", "sink-window"} <= set(registry.names())


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
@pytest.mark.parametrize("kind", [KEYS, VALUES])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("layer", [0, 2])
def test_a_run_encodes_into_the_bytes_it_says_and_decodes_within_its_bound(name, params, kind, tokens, layer):
    c = codec(name, **params)
    x = kv(tokens, seed=tokens)
    data = c.encode_run(x, kind, BLOCK, layer)
    assert data.dtype == torch.uint8 and data.numel() == c.run_bytes(tokens, kind, HEADS, DIM, 4, BLOCK, layer)
    out = torch.full_like(x, float("nan"))
    c.decode_run(data, kind, out, BLOCK, layer)
    kept = c.kept_heads(layer, HEADS)
    if kept is not None:  # the kept heads' KV as it was, the pruned heads' zeros
        kept = torch.tensor(kept)
        assert torch.equal(out[:, kept], x[:, kept]) and not out[:, ~kept].any()
        return
    if c.lossless:
        assert torch.equal(out, x)
        return
    levels = (1 << c.bits) - (1 if c.symmetric else 0)
    span = 2 * x.abs().max() if c.symmetric else x.max() - x.min()  # no group's range exceeds this
    assert (out - x).abs().max() <= 0.51 * span / (levels - 1) + 1e-6
    # the run is its blocks' encodings one after another
    first = min(tokens, BLOCK)
    assert torch.equal(data[: c.run_bytes(first, kind, HEADS, DIM, 4, BLOCK)], c.encode_run(x[:first], kind, BLOCK))


@pytest.mark.parametrize(("name", "params"), QUANTIZED, ids=QUANTIZED_IDS)
def test_keys_are_scaled_per_channel_and_values_per_token(name, params):
    """KIVI's grouping: an outlier channel of the keys (or an outlier token of the values) gets its
    own scales, so the other channels (tokens) keep their precision."""
    c = codec(name, **params)
    x = kv(64, seed=3)
    loud = x.clone()
    loud[:, 0, 0] *= 1000.0  # one key channel
    out = torch.empty_like(x)
    c.decode_run(c.encode_run(loud, KEYS, BLOCK), KEYS, out, BLOCK)
    quiet_error = (out - loud)[:, 1:].abs().max()
    c.decode_run(c.encode_run(x, KEYS, BLOCK), KEYS, out, BLOCK)
    assert quiet_error <= 1.01 * (out - x)[:, 1:].abs().max() + 1e-6
    loud = x.clone()
    loud[5] *= 1000.0  # one value token
    c.decode_run(c.encode_run(loud, VALUES, BLOCK), VALUES, out, BLOCK)
    others = torch.cat([(out - loud)[:5], (out - loud)[6:]]).abs().max()
    c.decode_run(c.encode_run(x, VALUES, BLOCK), VALUES, out, BLOCK)
    assert others <= 1.01 * torch.cat([(out - x)[:5], (out - x)[6:]]).abs().max() + 1e-6


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
@pytest.mark.parametrize("kind", [KEYS, VALUES])
def test_a_chunk_decodes_where_it_landed(name, params, kind):
    """A receiver writes a chunk's encoded bytes at the start of the span its values belong in,
    then decodes in place."""
    c = codec(name, **params)
    x = kv(100, seed=1)
    data = c.encode_run(x, kind, BLOCK)
    expected = torch.empty_like(x)
    c.decode_run(data, kind, expected, BLOCK)
    span = torch.zeros_like(x)
    span.view(-1).view(torch.uint8)[: data.numel()].copy_(data)
    c.decode_run(span.view(-1).view(torch.uint8)[: data.numel()], kind, span, BLOCK)
    assert torch.equal(span, expected)


@pytest.mark.parametrize(("name", "params"), QUANTIZED, ids=QUANTIZED_IDS)
@pytest.mark.parametrize("kind", [KEYS, VALUES])
def test_the_kernels_give_the_bytes_of_the_pytorch_reference(name, params, kind):
    from pdflow import kernels

    if kernels.library() is None:
        pytest.skip(kernels.unavailable_reason())
    c = codec(name, **params)
    x = kv(64 * 3 + 10, seed=4)
    for blocks in (x[:192].reshape(3, 64, HEADS, DIM), x[192:][None]):
        data = c.encode_blocks(blocks, kind)
        assert torch.equal(data, c.encode_blocks_torch(blocks, kind))
        a, b = torch.empty_like(blocks), torch.empty_like(blocks)
        c.decode_blocks(data, kind, a)
        c.decode_blocks_torch(data, kind, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_bfloat16_kv_goes_through_the_same_codec(name):
    c = codec(name)
    x = kv(80, seed=5).bfloat16()
    data = c.encode_run(x, KEYS, BLOCK)
    assert data.numel() == c.run_bytes(80, KEYS, HEADS, DIM, 2, BLOCK)
    out = torch.empty_like(x)
    c.decode_run(data, KEYS, out, BLOCK)
    assert (out.float() - x.float()).abs().max() < (0.02 if name == "int8" else 0.6) * x.float().abs().max()


def test_the_byte_savings_per_block_meet_the_targets():
    """Per 64-token block of SmolLM2's shape, keys and values together: int8 >= 3.9x fewer bytes
    than fp32 (>= 1.9x fewer than fp16), int4 >= 7x."""
    def ratio(name, itemsize=4):
        c = codec(name)
        raw = 2 * BLOCK * HEADS * DIM * itemsize
        return raw / sum(c.encoded_bytes(BLOCK, kind, HEADS, DIM, itemsize) for kind in (KEYS, VALUES))

    assert ratio("int8") >= 3.9 and ratio("int8", itemsize=2) >= 1.9
    assert ratio("int4") >= 7.0
    assert ratio("none") == 1.0


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_constant_and_zero_groups_decode_exactly(name):
    c = codec(name)
    for x in (torch.zeros(64, HEADS, DIM), torch.full((64, HEADS, DIM), 0.5)):
        for kind in (KEYS, VALUES):
            out = torch.empty_like(x)
            c.decode_run(c.encode_run(x, kind, BLOCK), kind, out, BLOCK)
            torch.testing.assert_close(out, x, rtol=0, atol=1e-3 * float(x.abs().max()))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_values_a_float16_scale_cannot_hold_are_refused(name):
    c = codec(name)
    for bad in (float("nan"), float("inf"), 1e12):
        x = kv(64)
        x[3, 1, 7] = bad
        with pytest.raises(ValueError, match="float16"):
            c.encode_run(x, KEYS, BLOCK)


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
def test_encodings_of_the_wrong_length_are_refused_and_any_bytes_of_the_right_length_decode(name, params):
    """Encoded bytes come from peers: a wrong length is a ValueError, and bytes of the right length,
    whatever they hold, decode without crashing (garbage in, garbage out)."""
    c = codec(name, **params)
    out = torch.empty(70, HEADS, DIM)
    size = c.run_bytes(70, VALUES, HEADS, DIM, 4, BLOCK)
    for wrong in (size - 1, size + 1, 0):
        with pytest.raises(ValueError, match="bytes"):
            c.decode_run(torch.zeros(wrong, dtype=torch.uint8), VALUES, out, BLOCK)
    noise = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    c.decode_run(noise, VALUES, out, BLOCK)
    c.decode_run(bytes(noise.numpy()), VALUES, out, BLOCK)  # read-only bytes too


def test_a_spec_names_the_codec_and_what_differs_from_its_defaults():
    assert codec("int8").spec == "int8" and codec("none").spec == "none"
    c = codec("int4", key_group=32, symmetric=True)
    assert c.spec == "int4:key_group=32,symmetric=1"
    assert from_spec(c.spec) == c and from_spec("int8") == codec("int8")


@pytest.mark.parametrize(("spec", "message"), [
    ("zstd", "cannot decode"), ("int8:bits=3", "not a parameter"), ("int8:key_group=x", "not a int"),
    ("int8:key_group", "not a parameter"), ("int8:key_group=0", "key_group must be"),
])
def test_a_spec_this_process_cannot_decode_is_a_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        from_spec(spec)


def test_bad_parameters_are_named():
    with pytest.raises(TypeError, match="unknown int8 codec parameters"):
        codec("int8", group=3)
    with pytest.raises(ValueError, match="value_group 50 does not divide"):
        codec("int8", value_group=50).encode_run(kv(4), VALUES, BLOCK)
    with pytest.raises(ValueError, match="value_group must be even"):
        codec("int4", value_group=3).encoded_bytes(64, VALUES, 3, 64, 4)
    with pytest.raises(ValueError, match="symmetric must be"):
        codec("int4", symmetric="yes")
    with pytest.raises(LookupError, match="unknown KV codec"):
        codec("zstd")


@pytest.mark.parametrize(("name", "params"), SETTINGS, ids=IDS)
@pytest.mark.parametrize("kind", [KEYS, VALUES])
def test_a_second_trip_through_the_codec_changes_nothing(name, params, kind):
    """What a link's receiver decodes may be encoded again on the next hop (the store forwarding
    to decode): a decoded block is its own encoding, so KV is quantized once however many hops."""
    c = codec(name, **params)
    once, twice = torch.empty(150, HEADS, DIM), torch.empty(150, HEADS, DIM)
    c.decode_run(c.encode_run(kv(150, seed=8), kind, BLOCK), kind, once, BLOCK)
    c.decode_run(c.encode_run(once, kind, BLOCK), kind, twice, BLOCK)
    assert torch.equal(once, twice)
