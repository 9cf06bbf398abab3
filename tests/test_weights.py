"""Weight formats: the conformance suite every registered format passes, int4's exactness on a
Q4_1 grid, and the compact engine against transformers on small models of each supported type."""

from __future__ import annotations

import pytest
import torch

from pdflow.plugins import DEFAULT_WEIGHTS
from pdflow.engine.weights import BUILTIN, WeightFormat, registry
from pdflow.engine.weights.formats import quantize_int4

# relative error of x @ W.T that each built-in format stays within on Gaussian data
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "int8": 2e-2, "int4": 0.15, "int8-a16": 2e-2, "int4-a16": 0.15,
             "int8-a8": 3e-2, "int4-a8": 0.15, "int4-a16-blocked": 0.15}
# bits per weight: per 32 weights, int8 an fp32 scale, int4 a scale and a minimum
BITS = {"fp32": 32, "bf16": 16, "int8": 9, "int4": 6, "int8-a16": 9, "int4-a16": 6, "int8-a8": 9, "int4-a8": 6,
        "int4-a16-blocked": 6}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.fixture(params=sorted(BUILTIN))
def weight_format(request) -> WeightFormat:
    return registry.load(request.param)()


def test_every_format_multiplies_like_fp32(weight_format):
    torch.manual_seed(0)
    weight, bias = torch.randn(192, 256), torch.randn(192)
    packed = weight_format.pack(weight, bias)
    assert (packed.out_features, packed.in_features) == (192, 256)
    for shape in [(1, 256), (7, 256), (2, 5, 256), (100, 256)]:  # 100 rows: past the kernels' tiles
        x = torch.randn(shape)
        got = packed(x)
        assert got.shape == (*shape[:-1], 192) and got.dtype == torch.float32
        assert _relative_error(got, x @ weight.T + bias) < TOLERANCE[weight_format.name]
    assert packed.nbytes <= 192 * 256 * BITS[weight_format.name] / 8 * 1.2  # scales are a small part
    assert weight_format.kernel


def test_every_format_keeps_bfloat16_activations(weight_format):
    torch.manual_seed(1)
    weight = torch.randn(64, 128)
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = weight_format.pack(weight)(x)
    assert got.dtype == torch.bfloat16
    assert _relative_error(got, x.float() @ weight.T) < TOLERANCE[weight_format.name] + 2e-2


def test_the_output_projection_may_keep_more_bits(weight_format):
    weight = torch.randn(128, 64)
    assert weight_format.pack(weight, output=True).nbytes >= weight_format.pack(weight).nbytes


def test_int4_gives_back_a_q4_1_grid_exactly():
    """GGUF Q4_1: per 32 inputs, w = q * d + m with q in 0..15 spanning the group's min and max."""
    torch.manual_seed(2)
    q = torch.randint(0, 16, (96, 8, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    d, m = torch.rand(96, 8, 1) * 0.1 + 0.01, torch.randn(96, 8, 1)
    weight = (q * d + m).reshape(96, 256)
    codes, step, low = quantize_int4(weight)
    back = (codes.reshape(96, 8, 32).float() * step[..., None] + low[..., None]).reshape(96, 256)
    torch.testing.assert_close(back, weight, rtol=0, atol=1e-6)
    packed = registry.load("int4")().pack(weight)
    torch.testing.assert_close(packed.dequantized(), weight, rtol=0, atol=1e-6)
    x = torch.randn(4, 256)
    torch.testing.assert_close(packed(x), x @ weight.T, rtol=1e-5, atol=1e-4)


def test_int8_gives_back_a_q8_0_grid_exactly():
    """GGUF Q8_0: per 32 inputs, w = q * d with q in -127..127 and the largest |q| 127."""
    torch.manual_seed(4)
    q = torch.randint(-127, 128, (64, 4, 32)).float()
    q[..., 0] = 127
    weight = (q * (torch.rand(64, 4, 1) * 0.01 + 0.001)).reshape(64, 128)
    packed = registry.load("int8")().pack(weight)
    torch.testing.assert_close(packed.dequantized(), weight, rtol=0, atol=0)
    x = torch.randn(3, 128)
    torch.testing.assert_close(packed(x), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_kernels_and_their_pytorch_fallback_agree(name, monkeypatch):
    from pdflow import kernels

    assert kernels.library() is not None, kernels.unavailable_reason()  # this machine has a compiler
    torch.manual_seed(5)
    packed = registry.load(name)().pack(torch.randn(80, 320), torch.randn(80))
    x = torch.randn(5, 320)
    with_kernels = packed(x)
    monkeypatch.setattr(kernels, "library", lambda: None)
    torch.testing.assert_close(packed(x), with_kernels, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int8-a16", "int4-a16", "int8-a8", "int4-a8", "int4-a16-blocked"])
def test_quantized_activations_are_what_the_format_says(name):
    """x is quantized per group of 32 to 16 or 8 bits (scale = the group's largest magnitude /
    32767 or 127, nearest, ties to even) and multiplied by the packed weights: the kernels equal
    that computation done in PyTorch (up to float order), for one row and for tiles of rows, with an
    even number of groups (one row of int4-a16 then takes two groups at a time) and an odd one."""
    from pdflow import kernels

    assert kernels.library() is not None, kernels.unavailable_reason()
    torch.manual_seed(6)
    top_code = 32767 if "a16" in name else 127
    for k in (320, 288):
        packed = registry.load(name)().pack(torch.randn(80, k) * 0.05, torch.randn(80))
        weight = packed.dequantized()
        for rows in (1, 6, 64):
            x = torch.randn(rows, k) * torch.linspace(0.1, 10, k)  # groups of very different ranges
            x[0, :32] = 0  # an all-zero group
            groups = x.view(rows, -1, 32)
            top = groups.abs().amax(-1, keepdim=True)
            inverse = torch.where(top > 0, top_code / top, torch.zeros_like(top))
            step = top / top_code
            quantized = (torch.round(groups * inverse) * step).view(rows, k)
            want = quantized.double() @ weight.double().T + packed.bias.double()
            torch.testing.assert_close(packed(x).double(), want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))
            exact = x.double() @ weight.double().T + packed.bias.double()
            assert _relative_error(packed(x), exact) < (1e-3 if top_code == 32767 else 3e-2)


def test_quantized_formats_on_another_device_never_reach_the_cpu_kernels(monkeypatch):
    """The kernels take CPU pointers: a weight elsewhere (a GPU; here a meta tensor standing in)
    is dequantized by PyTorch on its own device instead."""
    from pdflow import kernels

    calls = []
    monkeypatch.setattr(kernels, "library", lambda: calls.append(1))
    for name in ("int8", "int4"):
        packed = registry.load(name)().pack(torch.randn(64, 128, device="meta"))
        assert packed(torch.randn(2, 128, device="meta")).device.type == "meta"
    assert not calls


def test_a_matrix_without_groups_of_32_inputs_stays_fp32():
    for name in ("int8", "int4"):
        packed = registry.load(name)().pack(torch.randn(10, 40))
        assert packed.nbytes == 10 * 40 * 4


def test_unknown_formats_name_the_known_ones():
    problem = registry.availability("int3")
    assert "int3" in problem and all(name in problem for name in BUILTIN)


# --- the compact engine on small random models of each supported type ------------------------

@pytest.fixture(autouse=True)
def _no_packed_copies(monkeypatch):
    """The small random models here are not worth keeping (tests/test_packed_cache.py tests that)."""
    monkeypatch.setenv("PDFLOW_PACKED_CACHE", "0")


def _tiny(model_type: str, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=model_type == "llama")
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_compact_engine_equals_transformers_logits(model_type, tmp_path):
    from pdflow.engine import load_model
    from pdflow.engine.forward import TransformersForward
    from pdflow.engine.llama import CompactLlama

    reference = _tiny(model_type, tmp_path)
    loaded = load_model(tmp_path, weights="fp32")
    assert isinstance(loaded.model, CompactLlama)
    ids = torch.randint(0, 256, (2, 20))
    positions = torch.arange(20)[None].expand(2, 20)
    with torch.inference_mode():
        want = reference(ids).logits[:, -1]

    class Keep:
        def update(self, keys, values, layer, **_):
            return keys, values

    torch.testing.assert_close(loaded.model(ids, positions, None, Keep()), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(TransformersForward(reference)(ids, positions, None, Keep()), want,
                               rtol=1e-5, atol=1e-6)


def test_a_model_the_compact_engine_cannot_run_says_why(tmp_path):
    from pdflow.engine import load_model
    from pdflow.engine.llama import unsupported_reason

    reference = _tiny("llama", tmp_path)
    reference.config.hidden_act = "gelu"
    assert "activation" in unsupported_reason(reference.config)
    reference.config.save_pretrained(tmp_path)
    chosen = next(name for name in BUILTIN if name not in ("fp32", DEFAULT_WEIGHTS))
    with pytest.raises(ValueError, match=f"{chosen}.*activation"):
        load_model(tmp_path, weights=chosen)
    for quiet in ("fp32", DEFAULT_WEIGHTS):  # transformers' own layers run it
        assert load_model(tmp_path, weights=quiet).weights == "fp32"


@pytest.mark.parametrize("weights", ["int4-a16", "int4-a16-blocked"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: biases on the fused QKV product
def test_a_decode_step_wholly_in_c_equals_the_layer_by_layer_path(model_type, weights, tmp_path, monkeypatch):
    import pdflow.engine.decode as decode
    from pdflow.engine import DecodeBatch, Sampler, Sequence, load_model, prefill
    from pdflow.messages import SamplingParams

    model = _tiny(model_type, tmp_path)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):  # initialised to zeros
                parameter.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, weights=weights)
    assert loaded.model.native_layers is not None
    seen: list[torch.Tensor] = []
    real_sample = decode.sample_batch
    monkeypatch.setattr(decode, "sample_batch", lambda logits, samplers: (seen.append(logits.clone()),
                                                                           real_sample(logits, samplers))[1])

    def run() -> list[torch.Tensor]:
        seen.clear()
        batch = DecodeBatch(loaded, max_batch=4)
        for i, length in enumerate((5, 17, 40)):
            kv = {}
            sampler = Sampler(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            result = prefill(loaded, list(range(3 + i, 3 + i + length)), sampler,
                             lambda layer, k, v: kv.__setitem__(layer, (k.transpose(0, 1), v.transpose(0, 1))))
            batch.add(Sequence(str(i), length, result.first_token, sampler), kv.__getitem__)
            batch.step()
        for _ in range(6):
            batch.step()
        return list(seen)

    whole = run()
    monkeypatch.setattr(loaded.model, "native_layers", None)
    by_layer = run()
    assert len(whole) == len(by_layer) == 9
    for a, b in zip(whole, by_layer):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_decode_step_past_the_models_positions_is_refused_not_read_out_of_bounds(tmp_path, monkeypatch):
    from pdflow.engine import DecodeBatch, Sampler, Sequence, load_model, prefill
    from pdflow.messages import SamplingParams

    _tiny("llama", tmp_path)  # 128 positions
    loaded = load_model(tmp_path, weights="int4-a16")
    for native in (loaded.model.native_layers, None):
        monkeypatch.setattr(loaded.model, "native_layers", native)
        kv = {}
        sampler = Sampler(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        result = prefill(loaded, list(range(3, 131)), sampler,
                         lambda layer, k, v: kv.__setitem__(layer, (k.transpose(0, 1), v.transpose(0, 1))))
        batch = DecodeBatch(loaded, max_batch=1)
        batch.add(Sequence("0", 128, result.first_token, sampler), kv.__getitem__)
        with pytest.raises(IndexError):
            batch.step()


BLOCKED_PATHS = {1: "plain C", 2: "AVX-512 VNNI", 3: "AMX tiles", 4: "AVX2 (a build without AVX-512)"}


@pytest.mark.parametrize("path", sorted(BLOCKED_PATHS))
def test_blocked_int4_sums_the_same_on_every_path_and_with_any_rows_beside(path):
    """int4-a16-blocked's products (q4blocked.c): every path this CPU can run gives the plain C
    path's results bit for bit, and a row's result is the same alone as among 2..64 rows, or 100
    (a prefill chunk, where the CPU has AMX tiles or AVX-512 VNNI; AMX takes 16 rows at a time,
    VNNI 4, AVX2 2): what keeps a speculative verify pass equal to a plain step, and a prefill equal
    to its prompt computed in chunks. (The AVX2 path is in builds without AVX-512:
    tests/test_kernels.py builds one.)"""
    from pdflow import kernels

    lib = kernels.library()
    assert lib is not None, kernels.unavailable_reason()
    if not lib.pdflow_q4b_paths() & (1 << path):
        pytest.skip(f"this CPU or build has no {BLOCKED_PATHS[path]}")
    torch.manual_seed(9)
    weight = torch.randn(96, 288) * 0.05  # 9 groups: an odd number
    matrices = [registry.load("int4-a16-blocked")().pack(weight)]
    if path != 4:  # int8 (the output projection) has no AVX2 path
        from pdflow.engine.weights.formats import _Blocked, block_int8, quantize_int8

        matrices.append(_Blocked(*block_int8(*quantize_int8(weight)), None, 96, 288, None))
    # prefill's rows: on AMX tiles at once, or 64 at a time on VNNI (else sgemm on a dequantized copy)
    many = (100,) if lib.pdflow_q4b_paths() & (1 << 3 | 1 << 2) else ()
    for packed in matrices:
        for rows in (1, 2, 5, 16, 17, 64, *many):
            x = torch.randn(rows, 288) * torch.linspace(0.1, 10, 288)
            got = packed.matmul(x, path)
            assert torch.equal(got, packed.matmul(x, 1)), rows
            alone = torch.cat([packed.matmul(x[i : i + 1], path) for i in range(rows)])
            assert torch.equal(got, alone), rows


def test_blocked_int4_holds_int4s_weights_in_another_order():
    """The same codes, scales and minimums as int4 (so the same dequantized weight), laid out in
    blocks of 16 outputs; the output projection is int8's weights in the same blocks where the
    kernels have AVX-512 VNNI (row-major int8 elsewhere); a matrix whose outputs are not a multiple
    of 16 stays row-major int8."""
    from pdflow.engine.weights.formats import _blocked_int8_pays, _Blocked, _Grouped, unpack_blocked

    torch.manual_seed(10)
    weight = torch.randn(48, 96)
    blocked, plain = registry.load("int4-a16-blocked")().pack(weight), registry.load("int4")().pack(weight)
    assert isinstance(blocked, _Blocked)
    torch.testing.assert_close(blocked.dequantized(), plain.dequantized(), rtol=0, atol=0)
    codes, _, _ = quantize_int4(weight)
    assert torch.equal(unpack_blocked(blocked.q, 48, 96), codes)
    assert blocked.nbytes == plain.nbytes
    head = registry.load("int4-a16-blocked")().pack(weight, output=True)
    assert head.lows is None and isinstance(head, _Blocked if _blocked_int8_pays() else _Grouped)
    torch.testing.assert_close(head.dequantized(), registry.load("int8")().pack(weight).dequantized(), rtol=0, atol=0)
    packed = registry.load("int4-a16-blocked")().pack(torch.randn(40, 96))
    assert isinstance(packed, _Grouped) and packed.lows is None
