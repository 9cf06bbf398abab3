"""pdflow's C kernels: built once per cache even when processes race, a clear fallback when they
cannot be built, and decode attention that reads paged, token-major blocks in place."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

from pdflow.engine import kernels

PROBE = textwrap.dedent("""
    import torch
    from pdflow.engine import kernels
    from pdflow.engine.weights import registry
    lib = kernels.library()
    packed = registry.load("int4")().pack(torch.ones(32, 64))
    print("built" if lib is not None else "fallback:" + kernels.unavailable_reason(), float(packed(torch.ones(1, 64)).sum()))
""")


def _probe(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_building_at_once_make_one_library(tmp_path):
    env = {"PDFLOW_CACHE_DIR": str(tmp_path)}
    probes = [_probe(env), _probe(env)]
    outputs = [p.communicate(timeout=300) for p in probes]
    for (out, err), probe in zip(outputs, probes):
        assert probe.returncode == 0, err
        assert out.split() == ["built", "2048.0"]
    assert len(list((tmp_path / "kernels").glob("qgemm-*.so"))) == 1


def test_without_a_working_compiler_formats_fall_back_and_say_why(tmp_path):
    for env, reason in (({"PDFLOW_NO_KERNELS": "1"}, "PDFLOW_NO_KERNELS"), ({"CC": "false"}, "false failed")):
        out, err = _probe({"PDFLOW_CACHE_DIR": str(tmp_path), **env}).communicate(timeout=300)
        assert out.startswith("fallback:") and reason in out and out.split()[-1] == "2048.0", (out, err)
        assert "unavailable" in err  # logged once, as a warning


def test_decode_attention_reads_paged_token_major_blocks():
    lib = kernels.library()
    assert lib is not None, kernels.unavailable_reason()
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block, slots = 6, 2, 32, 16, 20
    keys = torch.randn(slots, block, kv_heads, head_dim)  # token-major slots, as the store's arena
    values = torch.randn(slots, block, kv_heads, head_dim)
    lengths = torch.tensor([37, 5, 48])  # tokens after this step's own is written
    table = torch.tensor([[7, 2, 19], [11, 0, 0], [3, 4, 5]])
    query = torch.randn(3, heads, head_dim)
    new_k, new_v = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)
    out = torch.empty_like(query)
    lib.pdflow_decode_attention(query.data_ptr(), 3, heads, kv_heads, head_dim, lengths.data_ptr(), table.data_ptr(),
                                3, block, keys.data_ptr(), values.data_ptr(), block * kv_heads * head_dim,
                                kv_heads * head_dim, head_dim, new_k.data_ptr(), new_v.data_ptr(), kv_heads * head_dim,
                                kv_heads * head_dim, 0.2, out.data_ptr(), 2)
    for b in range(3):
        n = int(lengths[b])
        k = torch.cat([keys[s] for s in table[b]])[:n]  # (n, kv_heads, head_dim)
        v = torch.cat([values[s] for s in table[b]])[:n]
        torch.testing.assert_close(k[n - 1], new_k[b])  # the step's key landed at its position
        torch.testing.assert_close(v[n - 1], new_v[b])
        want = F.scaled_dot_product_attention(query[b][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                              scale=0.2, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-5)
