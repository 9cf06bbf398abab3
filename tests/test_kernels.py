"""pdflow's C kernels: built once per cache even when processes race, a clear fallback when they
cannot be built, and decode attention that reads paged, token-major blocks in place."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pdflow import kernels

PROBE = textwrap.dedent("""
    import torch
    from pdflow import kernels
    from pdflow.engine.weights import registry
    lib = kernels.library()
    packed = registry.load("int4")().pack(torch.ones(32, 64))
    print("built" if lib is not None else "fallback:" + kernels.unavailable_reason(), float(packed(torch.ones(1, 64)).sum()))
""")


def _probe(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _unoptimizing_compiler(tmp_path) -> str:
    """A cc that builds at -O0 (a quarter of -O3's CPU): what is tested is the build's lock and
    cache, not the code's speed."""
    wrapper = tmp_path / "cc-O0"
    wrapper.write_text('#!/usr/bin/env bash\nargs=()\nfor arg in "$@"; do [ "$arg" = -O3 ] && arg=-O0; args+=("$arg"); done\n'
                       'exec cc "${args[@]}"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_two_processes_building_at_once_make_one_library(tmp_path):
    env = {"PDFLOW_CACHE_DIR": str(tmp_path), "CC": _unoptimizing_compiler(tmp_path)}
    probes = [_probe(env), _probe(env)]
    outputs = [p.communicate(timeout=300) for p in probes]
    for (out, err), probe in zip(outputs, probes):
        assert probe.returncode == 0, err
        assert out.split() == ["built", "2048.0"]
    assert len(list((tmp_path / "kernels").glob("pdflow-kernels-*.so"))) == 1


def test_without_a_working_compiler_formats_fall_back_and_say_why(tmp_path):
    for env, reason in (({"PDFLOW_NO_KERNELS": "1"}, "PDFLOW_NO_KERNELS"), ({"CC": "false"}, "false failed")):
        out, err = _probe({"PDFLOW_CACHE_DIR": str(tmp_path), **env}).communicate(timeout=300)
        assert out.startswith("fallback:") and reason in out and out.split()[-1] == "2048.0", (out, err)
        assert "unavailable" in err  # logged once, as a warning


@pytest.mark.parametrize("pruned", [None, 1])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (6, 2, 32),  # on AVX-512: a kv head's 3 query heads in registers together, 2 vectors each
    (9, 3, 64),  # SmolLM2's shape
    (16, 2, 64),  # 8 query heads a kv head: two rounds of 4
    (6, 2, 128),  # 8 vectors a head: 2 query heads, then 1
    (4, 2, 48),  # 3 vectors a head: no AVX-512 case, the 256-bit path
])
def test_decode_attention_reads_paged_token_major_blocks(pruned, heads, kv_heads, head_dim):
    """... and with a kv head pruned (``kv_keep``), that head's query heads put out zeros, its
    step's keys and values are written as zeros, and the other heads are as without."""
    lib = kernels.library()
    assert lib is not None, kernels.unavailable_reason()
    torch.manual_seed(0)
    block, slots = 16, 20
    keys = torch.randn(slots, block, kv_heads, head_dim)  # token-major slots, as the store's arena
    values = torch.randn(slots, block, kv_heads, head_dim)
    lengths = torch.tensor([37, 5, 48])  # tokens after this step's own is written
    table = torch.tensor([[7, 2, 19], [11, 0, 0], [3, 4, 5]])
    query = torch.randn(3, heads, head_dim)
    new_k, new_v = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)
    out = torch.empty_like(query)
    keep = torch.ones(kv_heads, dtype=torch.uint8)
    if pruned is not None:
        keep[pruned] = 0
    lib.pdflow_decode_attention(query.data_ptr(), 3, heads, kv_heads, head_dim, lengths.data_ptr(), table.data_ptr(),
                                3, block, keys.data_ptr(), values.data_ptr(), block * kv_heads * head_dim,
                                kv_heads * head_dim, head_dim, new_k.data_ptr(), new_v.data_ptr(), kv_heads * head_dim,
                                kv_heads * head_dim, 0.2, None if pruned is None else keep.data_ptr(), out.data_ptr(), 2)
    kept = keep.bool()
    for b in range(3):
        n = int(lengths[b])
        k = torch.cat([keys[s] for s in table[b]])[:n]  # (n, kv_heads, head_dim)
        v = torch.cat([values[s] for s in table[b]])[:n]
        torch.testing.assert_close(k[n - 1, kept], new_k[b, kept])  # the step's key landed at its position
        torch.testing.assert_close(v[n - 1, kept], new_v[b, kept])
        assert not k[n - 1, ~kept].any() and not v[n - 1, ~kept].any()
        want = F.scaled_dot_product_attention(query[b][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                              scale=0.2, enable_gqa=True)[0, :, 0]
        group = heads // kv_heads
        query_kept = kept.repeat_interleave(group)
        torch.testing.assert_close(out[b, query_kept], want[query_kept], rtol=1e-5, atol=1e-5)
        assert not out[b, ~query_kept].any()


def test_silu_gated_product_matches_pytorch_over_the_whole_float_range():
    """The vectorized SiLU (sigmoid from exp(-|g|), so neither side overflows) against PyTorch's,
    on ordinary activations, large magnitudes of both signs, zeros and a tail that is not a
    multiple of the vector width."""
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.unavailable_reason())
    torch.manual_seed(3)
    inter = 1541  # 192 vectors of 8 and a tail of 5
    gate = torch.randn(2, inter) * 4
    gate[0, :12] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0, 100.0, -100.0, 1e4, -1e4])
    gate[1, -5:] = torch.tensor([-3.0, 3.0, 50.0, -50.0, 0.5])
    up = torch.randn(2, inter)
    gate_up = torch.cat([gate, up], dim=1).contiguous()
    out = torch.empty(2, inter)
    lib.pdflow_silu_mul(gate_up.data_ptr(), 2, inter, out.data_ptr())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-30)


def test_greedy_argmax_is_torch_argmax_on_ties_nans_infinities_and_tails():
    """The kernel's argmax (what greedy decoding picks) gives torch.argmax's index on every row:
    the first of equal maxima, the first NaN where there is one, all -inf, and widths that leave a
    tail past the vector loop."""
    if kernels.library() is None:
        pytest.skip(kernels.unavailable_reason())
    torch.manual_seed(11)
    for width in (1, 7, 8, 9, 17, 49152, 49153):
        x = torch.randn(6, width)
        x[1, width // 2] = x[1].max() + 1
        x[1, -1] = x[1, width // 2]  # a tie: the first one wins
        x[2, -1] = float("nan")
        x[2, width // 3] = float("nan")
        x[3] = float("-inf")
        x[4, -1] = float("inf")
        x[5] = 0.0
        x[5, -1] = -0.0
        assert kernels.argmax_rows(x) == torch.argmax(x, dim=-1).tolist(), width
    wide = torch.randn(3, 100, dtype=torch.float64)  # not the kernel's dtype: torch.argmax
    assert kernels.argmax_rows(wide) == torch.argmax(wide, dim=-1).tolist()


def test_the_portable_c_products_compute_what_the_vector_ones_do(tmp_path):
    """On a CPU without AVX2 the same files compile to plain C loops: built here with AVX2 turned
    off, every product gives the vectorized build's results (up to float order)."""
    import ctypes
    import shutil

    import pytest

    from pdflow.engine.weights import registry

    lib = kernels.library()
    compiler = kernels._compiler()
    if lib is None or compiler is None or not shutil.which(compiler):
        pytest.skip(kernels.unavailable_reason() or "no compiler")
    target = tmp_path / "portable.so"
    kernels.compile_library(compiler, kernels.SOURCES, target, flags=("-O2", "-mno-avx2", "-fopenmp", "-shared", "-fPIC"))
    portable = kernels.declare(ctypes.CDLL(str(target)))
    torch.manual_seed(7)
    products = {"int4": "pdflow_q4_gemm", "int8": "pdflow_q8_gemm", "int4-a16": "pdflow_q4a16_gemm",
                "int8-a16": "pdflow_q8a16_gemm", "int4-a8": "pdflow_q4a8_gemm", "int8-a8": "pdflow_q8a8_gemm"}
    for name, function in products.items():
        packed = registry.load(name)().pack(torch.randn(96, 320))
        for rows in (1, 7):
            x = torch.randn(rows, 320)
            results = []
            for library in (portable, lib):
                y = torch.empty(rows, 96)
                lows = [] if packed.lows is None else [packed.lows.data_ptr()]
                getattr(library, function)(x.data_ptr(), rows, 320, packed.q.data_ptr(), packed.scales.data_ptr(),
                                           *lows, 96, y.data_ptr(), 2)
                results.append(y)
            torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-4, msg=f"{name}, {rows} rows")
    _same_blocked_sums(portable, lib, 96, 320, (1, 7))  # q4blocked.c: the very same sums
    logits = torch.randn(3, 1001)
    logits[0, 5] = logits[0, 900] = 9.0  # a tie
    logits[1, 77] = float("nan")
    picks = (ctypes.c_int64 * 3)()
    portable.pdflow_argmax_rows(logits.data_ptr(), 3, 1001, picks)
    assert list(picks) == torch.argmax(logits, dim=-1).tolist()


def test_a_rows_product_does_not_depend_on_the_rows_beside_it(served_model):
    """The int4 and int8 products with 16-bit activations share each weight load across tiles of
    rows, each row summed in the order it is alone: a row's result is bit for bit the same alone
    or among others (a speculative verify pass and a plain step agree)."""
    loaded, _ = served_model
    torch.manual_seed(4)
    layer = loaded.model.layers[3]
    for name, matrix, inputs in (("gate_up", layer.gate_up, 576), ("down", layer.down, 1536),
                                 ("lm_head", loaded.model.lm_head, 576)):
        x = torch.randn(7, inputs)
        together = matrix(x)
        alone = torch.cat([matrix(x[i : i + 1]) for i in range(7)])
        assert torch.equal(together, alone), name


def test_a_build_without_avx512_sums_blocked_int4_the_same(tmp_path):
    """int4-a16-blocked on a CPU with AVX2 but no AVX-512 (here: these files built with AVX-512 and
    AMX turned off) takes its AVX2 path, and gives this machine's results bit for bit."""
    import ctypes
    import shutil

    lib = kernels.library()
    compiler = kernels._compiler()
    if lib is None or compiler is None or not shutil.which(compiler):
        pytest.skip(kernels.unavailable_reason() or "no compiler")
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    target = tmp_path / "avx2.so"
    kernels.compile_library(compiler, kernels.SOURCES, target, flags=("-O2", "-march=native", "-mno-avx512f",
                                                                      "-mno-amx-tile", "-mno-amx-int8", "-fopenmp",
                                                                      "-shared", "-fPIC"))
    avx2 = kernels.declare(ctypes.CDLL(str(target)))
    assert avx2.pdflow_q4b_paths() == (1 << 1) | (1 << 4)  # plain C and AVX2
    torch.manual_seed(8)
    _same_blocked_sums(avx2, lib, 64, 288, (1, 2, 5))


def _same_blocked_sums(other, lib, n_out: int, k: int, row_counts) -> None:
    """int4-a16-blocked's products (int4, and the int8 of its output projection) from two builds
    of the kernels: the same floats, bit for bit."""
    from pdflow.engine.weights import registry
    from pdflow.engine.weights.formats import _Blocked, block_int8, quantize_int8

    weight = torch.randn(n_out, k) * 0.05
    blocked = registry.load("int4-a16-blocked")().pack(weight)
    head = _Blocked(*block_int8(*quantize_int8(weight)), None, n_out, k, None)
    for rows in row_counts:
        x = torch.randn(rows, k)
        results, heads = [], []
        for library in (other, lib):
            y = torch.empty(rows, n_out)
            assert library.pdflow_q4b_gemm(x.data_ptr(), rows, k, blocked.q.data_ptr(), blocked.scales.data_ptr(),
                                           blocked.lows.data_ptr(), n_out, y.data_ptr(), 2, 0) == 0
            results.append(y)
            y = torch.empty(rows, n_out)
            assert library.pdflow_q8b_gemm(x.data_ptr(), rows, k, head.q.data_ptr(), head.scales.data_ptr(), n_out,
                                           y.data_ptr(), 2, 0) == 0
            heads.append(y)
        assert torch.equal(results[0], results[1]), f"int4-a16-blocked, {rows} rows"
        assert torch.equal(heads[0], heads[1]), f"int4-a16-blocked's int8, {rows} rows"
