"""Every exported kernel's outputs from this checkout's build and another's, on the same inputs,
compared bit for bit (``torch.equal``, not a tolerance): a refactoring of the C sources that
should change no float is held to it.

    .venv/bin/python experiments/compare_kernel_outputs.py OLD_COMMIT   # its sources, built here
    .venv/bin/python experiments/compare_kernel_outputs.py /tmp/old.so

What runs, on random inputs (seeded) of SmolLM2's shapes and of odd ones:
- every weight format of ``pdflow.engine.weights``' registry with a kernel, through the format's
  own dispatch (so what the engine calls): 1 to 65 rows (past 64: the dequantized copy), and for
  ``int4-a16-blocked`` each path this CPU runs (plain C, AVX2, AVX-512 VNNI, AMX);
- pdflow_quantize16, pdflow_rms_norm, pdflow_rope, pdflow_silu_mul, pdflow_argmax_rows;
- pdflow_decode_attention over paged token-major blocks and a head-major buffer, with and
  without a pruned kv head, 1 and 2 threads (the split of each sequence's tokens);
- pdflow_decode_layers: layers of each format with a C form, attention over paged blocks;
- pdflow_kv_encode / pdflow_kv_decode: 8 and 4 bits, symmetric or not, keys and values.
Prints one line per kernel and exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
import zlib
from collections import defaultdict

import torch

from compare_kernel_builds import other_build
from pdflow import kernels
from pdflow.engine.weights import registry

GROUPED = ("int8", "int4", "int8-a16", "int4-a16", "int8-a8", "int4-a8")
FORMATS = (*GROUPED, "int4-a16-blocked")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (96, 288), (48, 96)]  # (outputs, inputs)
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 64, 65)


@contextlib.contextmanager
def kernels_of(lib: ctypes.CDLL):
    """pdflow's own callers (the weight formats) use ``lib`` within the block."""
    saved, kernels._loaded = kernels._loaded, lib
    try:
        yield
    finally:
        kernels._loaded = saved


class Comparison:
    """Outputs of the two builds, counted per kernel: cases run and cases that differ."""

    def __init__(self, builds: dict[str, ctypes.CDLL]):
        self.builds = builds
        self.cases: dict[str, int] = defaultdict(int)
        self.differ: dict[str, list[str]] = defaultdict(list)

    def check(self, kernel: str, case: str, run) -> None:
        """``run(lib)`` returns a tensor (or tensors); the builds' must be equal, bit for bit."""
        outputs = []
        for lib in self.builds.values():
            torch.manual_seed(zlib.crc32(f"{kernel} {case}".encode()))  # the same inputs for both builds
            result = run(lib)
            outputs.append(result if isinstance(result, (tuple, list)) else (result,))
        self.cases[kernel] += 1
        if not all(torch.equal(a, b) for a, b in zip(*outputs)):
            self.differ[kernel].append(case)

    def report(self) -> bool:
        for kernel, count in self.cases.items():
            differ = self.differ.get(kernel, [])
            verdict = f"DIFFER in {len(differ)}: {', '.join(differ[:5])}" if differ else "equal"
            print(f"{kernel:<36} {count:>4} cases  {verdict}")
        total = sum(self.cases.values())
        bad = sum(len(v) for v in self.differ.values())
        print(f"{total} cases, {total - bad} bit for bit equal, {bad} differ")
        return bad == 0


def compare_products(c: Comparison) -> None:
    for name in FORMATS:
        fmt = registry.load(name)()
        for n, k in SHAPES:
            torch.manual_seed(n * 7919 + k)
            packed = fmt.pack(torch.randn(n, k) * 0.05, torch.randn(n) if n == 96 else None)
            for rows in ROWS:
                x = torch.randn(rows, k)

                def product(lib, packed=packed, x=x):
                    with kernels_of(lib):
                        return packed(x)

                c.check(f"{name} product", f"{n}x{k}, {rows} rows", product)
            this = next(iter(c.builds.values()))
            paths = [p for p in (1, 2, 3, 4) if name == "int4-a16-blocked" and this.pdflow_q4b_paths() & (1 << p)]
            for path in paths:
                for rows in (1, 3, 8, 17):
                    x = torch.randn(rows, k)

                    def blocked(lib, packed=packed, x=x, path=path):
                        with kernels_of(lib):
                            return packed.matmul(x, path)

                    c.check(f"{name} product, path {path}", f"{n}x{k}, {rows} rows", blocked)

            def dequantized(lib, packed=packed):
                with kernels_of(lib):
                    return packed.dequantized()

            c.check(f"{name} dequantize", f"{n}x{k}", dequantized)


def compare_layer_ops(c: Comparison) -> None:
    for rows, dim in ((1, 576), (8, 576), (3, 100), (5, 1536)):
        def quantize16(lib, rows=rows, k=dim - dim % 32):  # (whole groups)
            x = torch.randn(rows, k) * 3
            xq, xs = torch.empty(rows, k, dtype=torch.int16), torch.empty(2, rows, k // 32)
            lib.pdflow_quantize16(x.data_ptr(), rows, k, xq.data_ptr(), xs[0].data_ptr(), xs[1].data_ptr())
            return xq, xs

        def rms_norm(lib, rows=rows, dim=dim):
            x, w, out = torch.randn(rows, dim) * 2, torch.randn(dim), torch.empty(rows, dim)
            lib.pdflow_rms_norm(x.data_ptr(), w.data_ptr(), rows, dim, 1e-5, out.data_ptr())
            return out

        def silu_mul(lib, rows=rows, dim=dim):
            gate_up, out = torch.randn(rows, 2 * dim) * 4, torch.empty(rows, dim)
            lib.pdflow_silu_mul(gate_up.data_ptr(), rows, dim, out.data_ptr())
            return out

        def argmax(lib, rows=rows, dim=dim):
            x, out = torch.randn(rows, dim * 37), (ctypes.c_int64 * rows)()
            x[0, 5] = x[0, -1] = 99.0
            lib.pdflow_argmax_rows(x.data_ptr(), rows, dim * 37, out)
            return torch.tensor(list(out))

        for kernel, run in (("pdflow_quantize16", quantize16), ("pdflow_rms_norm", rms_norm),
                            ("pdflow_silu_mul", silu_mul), ("pdflow_argmax_rows", argmax)):
            c.check(kernel, f"{rows}x{dim}", run)
    for rows, heads, kv_heads, head_dim in ((1, 9, 3, 64), (8, 9, 3, 64), (3, 6, 2, 48), (2, 4, 4, 128)):
        def rope(lib, rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim):
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
            cos, sin = torch.randn(rows, head_dim), torch.randn(rows, head_dim)
            q, k = torch.empty(rows, heads, head_dim), torch.empty(rows, kv_heads, head_dim)
            lib.pdflow_rope(qkv.data_ptr(), rows, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                            q.data_ptr(), k.data_ptr())
            return q, k

        c.check("pdflow_rope", f"{rows} rows, {heads}/{kv_heads} heads of {head_dim}", rope)


def _paged(batch: int, kv_heads: int, head_dim: int, lengths: list[int], block: int, layers: int = 1):
    """Token-major pool blocks (slots, block, kv_heads, head_dim) per layer, a scattered table."""
    width = max(-(-n // block) for n in lengths)
    slots = batch * width + 3
    order = torch.randperm(slots)
    table = order[: batch * width].view(batch, width).contiguous()
    keys = [torch.randn(slots, block, kv_heads, head_dim) * 0.5 for _ in range(layers)]
    values = [torch.randn(slots, block, kv_heads, head_dim) * 0.5 for _ in range(layers)]
    return table, keys, values


def compare_attention(c: Comparison) -> None:
    cases = [(9, 3, 64, [1, 37, 300, 1030], 64), (6, 2, 32, [5, 17], 16), (16, 2, 64, [70, 129], 16),
             (6, 2, 128, [200], 64), (4, 2, 48, [33, 2], 16)]
    for heads, kv_heads, head_dim, lengths, block in cases:
        for pruned in (False, True):
            for threads in (1, 2):
                def attention(lib, heads=heads, kv_heads=kv_heads, head_dim=head_dim, lengths=lengths, block=block,
                              pruned=pruned, threads=threads):
                    batch = len(lengths)
                    table, (keys,), (values,) = _paged(batch, kv_heads, head_dim, lengths, block)
                    q = torch.randn(batch, heads, head_dim)
                    new_k, new_v = torch.randn(batch, kv_heads, head_dim), torch.randn(batch, kv_heads, head_dim)
                    keep = torch.ones(kv_heads, dtype=torch.uint8)
                    keep[-1] = 0
                    out, lengths_ = torch.empty_like(q), torch.tensor(lengths)  # (tensors alive through the call)
                    lib.pdflow_decode_attention(
                        q.data_ptr(), batch, heads, kv_heads, head_dim, lengths_.data_ptr(),
                        table.data_ptr(), table.shape[1], block, keys.data_ptr(), values.data_ptr(),
                        block * kv_heads * head_dim, kv_heads * head_dim, head_dim, new_k.data_ptr(),
                        new_v.data_ptr(), kv_heads * head_dim, kv_heads * head_dim, head_dim ** -0.5,
                        keep.data_ptr() if pruned else None, out.data_ptr(), threads)
                    return out, keys, values

                c.check("pdflow_decode_attention (token-major)",
                        f"{heads}/{kv_heads}x{head_dim}, {lengths}, pruned {pruned}, {threads} threads", attention)

        def head_major(lib, heads=heads, kv_heads=kv_heads, head_dim=head_dim, lengths=lengths):
            batch, capacity = len(lengths), max(lengths) + 3  # one slot per sequence: (kv_heads, capacity, head_dim)
            keys = torch.randn(batch, kv_heads, capacity, head_dim)
            values = torch.randn(batch, kv_heads, capacity, head_dim)
            q, out = torch.randn(batch, heads, head_dim), torch.empty(batch, heads, head_dim)
            new_k, new_v = torch.randn(batch, kv_heads, head_dim), torch.randn(batch, kv_heads, head_dim)
            lengths_, table = torch.tensor(lengths), torch.arange(batch)
            lib.pdflow_decode_attention(
                q.data_ptr(), batch, heads, kv_heads, head_dim, lengths_.data_ptr(), table.data_ptr(), 1, capacity,
                keys.data_ptr(), values.data_ptr(), kv_heads * capacity * head_dim, head_dim, capacity * head_dim,
                new_k.data_ptr(), new_v.data_ptr(), kv_heads * head_dim, kv_heads * head_dim, head_dim ** -0.5, None,
                out.data_ptr(), 2)
            return out, keys, values

        c.check("pdflow_decode_attention (head-major)", f"{heads}/{kv_heads}x{head_dim}, {lengths}", head_major)


def compare_decode_layers(c: Comparison) -> None:
    shapes = [(576, 9, 3, 64, 1536, [12, 300, 65]), (96, 6, 2, 16, 160, [3, 40])]  # SmolLM2's, and odd
    for name in FORMATS:
        for dim, heads, kv_heads, head_dim, inter, lengths in shapes:
            if name == "int4-a16-blocked" and head_dim * (heads + 2 * kv_heads) % 16:
                continue
            torch.manual_seed(dim + heads)
            fmt, n_layers, width = registry.load(name)(), 3, (heads + 2 * kv_heads) * head_dim
            packs = [[fmt.pack(torch.randn(n, k) * 0.05, torch.randn(n) * 0.1 if n == width else None)
                      for n, k in ((width, dim), (dim, heads * head_dim), (2 * inter, dim), (dim, inter))]
                     for _ in range(n_layers)]
            norms = [(torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) for _ in range(n_layers)]
            layers = (kernels.Layer * n_layers)(*[kernels.Layer(a.data_ptr(), b.data_ptr(), *[p.native() for p in ps])
                                                  for (a, b), ps in zip(norms, packs)])
            for pruned in (False, True):
                def step(lib, name=name, dim=dim, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter,
                         lengths=lengths, layers=layers, pruned=pruned):
                    batch, block = len(lengths), 16
                    table, keys, values = _paged(batch, kv_heads, head_dim, lengths, block, layers=len(layers))
                    hidden, lengths_ = torch.randn(batch, dim), torch.tensor(lengths)
                    positions = lengths_ - 1
                    cos, sin = torch.randn(max(lengths), head_dim), torch.randn(max(lengths), head_dim)
                    keep = torch.ones(len(layers), kv_heads, dtype=torch.uint8)
                    keep[1, 0] = 0
                    pointers = ctypes.c_void_p * len(layers)
                    lib.pdflow_decode_layers(
                        layers, len(layers), hidden.data_ptr(), batch, dim, heads, kv_heads, head_dim, inter, 1e-5,
                        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), lengths_.data_ptr(),
                        table.data_ptr(), table.shape[1], block, pointers(*(k.data_ptr() for k in keys)),
                        pointers(*(v.data_ptr() for v in values)), block * kv_heads * head_dim, kv_heads * head_dim,
                        head_dim, head_dim ** -0.5, keep.data_ptr() if pruned else None, 2)
                    return (hidden, *keys, *values)

                c.check("pdflow_decode_layers", f"{name}, dim {dim}, {lengths}, pruned {pruned}", step)


def compare_kv_codecs(c: Comparison) -> None:
    for bits in (8, 4):
        for symmetric in (0, 1):
            for keys in (0, 1):
                for tokens, channels, group in ((16, 192, 16), (64, 64, 32), (5, 96, 32)):
                    def codec(lib, bits=bits, symmetric=symmetric, keys=keys, tokens=tokens, channels=channels,
                              group=group):
                        n, stride = 3, tokens * channels * 3
                        x = torch.randn(n, tokens, channels) * 2
                        data = torch.zeros(n, stride, dtype=torch.uint8)
                        failed = lib.pdflow_kv_encode(x.data_ptr(), n, tokens, channels, keys, group, bits, symmetric,
                                                      data.data_ptr(), stride)
                        out = torch.empty(n, tokens, channels)
                        lib.pdflow_kv_decode(data.data_ptr(), stride, n, tokens, channels, keys, group, bits, symmetric,
                                             out.data_ptr())
                        return data, out, torch.tensor(failed)

                    c.check("pdflow_kv_encode + decode",
                            f"{bits} bits, symmetric {symmetric}, keys {keys}, {tokens}x{channels}/{group}", codec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="a git revision whose kernels to build, or a shared library built before")
    opts = parser.parse_args()
    this = kernels.library()
    if this is None:
        raise SystemExit(f"pdflow's kernels are not available: {kernels.unavailable_reason()}")
    torch.set_num_threads(2)
    comparison = Comparison({"this checkout": this, opts.other: other_build(opts.other)})
    for compare in (compare_products, compare_layer_ops, compare_attention, compare_decode_layers, compare_kv_codecs):
        compare(comparison)
    print(f"this checkout against {opts.other}:")
    return 0 if comparison.report() else 1


if __name__ == "__main__":
    sys.exit(main())
