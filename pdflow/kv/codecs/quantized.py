"""Integer KV codecs (``int8``, ``int4``): each value becomes an integer code with a scale (and,
asymmetric, a minimum) shared by a group of values, as KIVI groups them: keys per channel (a
group is one channel over ``key_group`` consecutive tokens of the block: outlier channels get
their own scale), values per token (a group is ``value_group`` consecutive channels of one
token; 0: all of the token's channels).

Encoded block: the codes (int8: one byte each; int4: two per byte, even channel in the low
nibble), then the scales as float16, then (asymmetric) the minimums as float16. Symmetric:
``x ~ q * scale`` with ``q`` in ``[-(2^(b-1) - 1), 2^(b-1) - 1]``; asymmetric: ``x ~ q * scale +
minimum`` with ``q`` in ``[0, 2^b - 1]``. Codes are computed against the float16-rounded scales,
so what is decoded is what was meant.

fp32 KV is encoded and decoded by pdflow's C kernels (``kvquant.c``, one pass over the values);
other dtypes, or a machine without a C compiler, take the PyTorch path here, which gives the same
bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdflow.kv.codecs.base import KEYS, KvCodec

if TYPE_CHECKING:  # torch is imported where KV is encoded, not where a topology is checked
    import torch

__all__ = ["Int4", "Int8", "Quantized"]

_FP16_MAX = 65504.0
_MAX_CHANNELS = 8192  # the C kernels' row buffers


class Quantized(KvCodec):
    bits: int = 8

    def check(self) -> None:
        for key in ("key_group", "value_group"):
            value = self.params[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "key_group" else 0):
                raise ValueError(f"{self.name} codec: {key} must be an integer >= {1 if key == 'key_group' else 0}, "
                                 f"got {value!r}")
        if not isinstance(self.params["symmetric"], bool):
            raise ValueError(f"{self.name} codec: symmetric must be true or false, got {self.params['symmetric']!r}")

    @property
    def symmetric(self) -> bool:
        return self.params["symmetric"]

    def _value_group(self, channels: int) -> int:
        group = self.params["value_group"] or channels
        if channels % group:
            raise ValueError(f"{self.name} codec: value_group {group} does not divide the {channels} channels "
                             f"of a token (kv_heads x head_dim)")
        if self.bits == 4 and group % 2:
            raise ValueError(f"int4 codec: value_group must be even (two codes a byte), got {group}")
        return group

    def _scale_count(self, tokens: int, kind: int, channels: int) -> int:
        if kind == KEYS:
            return -(-tokens // self.params["key_group"]) * channels
        return tokens * (channels // self._value_group(channels))

    def encoded_bytes(self, tokens: int, kind: int, kv_heads: int, head_dim: int, itemsize: int,
                      layer: int = 0) -> int:
        channels = kv_heads * head_dim
        if self.bits == 4 and channels % 2:
            raise ValueError(f"int4 codec needs an even number of channels per token, not {channels}")
        codes = tokens * channels * self.bits // 8
        return codes + self._scale_count(tokens, kind, channels) * 2 * (1 if self.symmetric else 2)

    # ---- grouping: x (n, tokens, channels) <-> (n, groups, group size), reduced over the last axis ----

    def _grouped(self, x: torch.Tensor, kind: int) -> torch.Tensor:
        import torch

        n, tokens, channels = x.shape
        if kind == KEYS:
            g = self.params["key_group"]
            padded = -(-tokens // g) * g
            if padded != tokens:  # repeat the last token: changes no group's range
                x = torch.cat([x, x[:, -1:].expand(n, padded - tokens, channels)], dim=1)
            return x.view(n, padded // g, g, channels).transpose(2, 3)  # (n, token groups, channels, g)
        g = self._value_group(channels)
        return x.view(n, tokens, channels // g, g)

    def _ungrouped(self, grouped: torch.Tensor, kind: int, tokens: int) -> torch.Tensor:
        n = grouped.shape[0]
        if kind == KEYS:
            return grouped.transpose(2, 3).reshape(n, -1, grouped.shape[2])[:, :tokens]
        return grouped.reshape(n, tokens, -1)

    def _levels(self) -> tuple[float, float]:
        """(lowest, highest) code."""
        top = (1 << (self.bits - 1)) - 1
        return (-top, top) if self.symmetric else (0, (1 << self.bits) - 1)

    def _native(self, tensor: torch.Tensor, channels: int):
        """The C kernels if they can take ``tensor`` (fp32, on the CPU), else None."""
        import torch

        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or channels > _MAX_CHANNELS:
            return None
        from pdflow import kernels

        return kernels.library()

    def _group(self, kind: int, channels: int) -> int:
        return self.params["key_group"] if kind == KEYS else self._value_group(channels)

    def encode_blocks(self, blocks: torch.Tensor, kind: int, layer: int = 0) -> torch.Tensor:
        import torch

        n, tokens = blocks.shape[:2]
        channels = blocks[0, 0].numel() if n and tokens else 0
        lib = self._native(blocks, channels) if n and tokens else None
        if lib is not None:
            x = blocks.contiguous()
            size = self.encoded_bytes(tokens, kind, 1, channels, 4)
            out = torch.empty(n, size, dtype=torch.uint8)
            if lib.pdflow_kv_encode(x.data_ptr(), n, tokens, channels, int(kind == KEYS), self._group(kind, channels),
                                    self.bits, int(self.symmetric), out.data_ptr(), size):
                raise ValueError(f"{self.name} codec: KV values that are not finite or beyond float16's range "
                                 f"(±{_FP16_MAX:g}; scales are float16) cannot be encoded")
            return out
        return self.encode_blocks_torch(blocks, kind)

    def encode_blocks_torch(self, blocks: torch.Tensor, kind: int) -> torch.Tensor:
        """:meth:`encode_blocks` in PyTorch operations (any dtype; the C kernels' reference)."""
        import torch

        n, tokens = blocks.shape[:2]
        x = blocks.reshape(n, tokens, -1).float()
        grouped = self._grouped(x, kind)
        low_code, high_code = self._levels()
        if self.symmetric:
            scale = (grouped.abs().amax(dim=-1) / high_code).half()
            minimum = None
        else:
            lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
            minimum = lo.half()
            scale = ((hi - minimum.float()) / high_code).half()
        if not (torch.isfinite(scale).all() and (minimum is None or torch.isfinite(minimum).all())
                and not torch.isnan(grouped).any()):
            raise ValueError(f"{self.name} codec: KV values that are not finite or beyond float16's range "
                             f"(±{_FP16_MAX:g}; scales are float16) cannot be encoded")
        s = scale.float().unsqueeze(-1)
        inverse = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        shifted = grouped if minimum is None else grouped - minimum.float().unsqueeze(-1)
        codes = torch.round(shifted * inverse).clamp_(low_code, high_code)
        codes = self._ungrouped(codes, kind, tokens)  # (n, tokens, channels)
        if self.bits == 8:
            packed = codes.to(torch.int8).view(torch.uint8) if self.symmetric else codes.to(torch.uint8)
        else:
            nibbles = (codes + (8 if self.symmetric else 0)).to(torch.uint8).view(n, tokens, -1, 2)
            packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
        parts = [packed.reshape(n, -1), scale.reshape(n, -1).view(torch.uint8)]
        if minimum is not None:
            parts.append(minimum.reshape(n, -1).view(torch.uint8))
        return torch.cat(parts, dim=1)

    def decode_blocks(self, data: torch.Tensor, kind: int, out: torch.Tensor, layer: int = 0) -> None:
        n, tokens, kv_heads, head_dim = out.shape
        channels = kv_heads * head_dim
        lib = self._native(out, channels) if n and tokens else None
        if lib is not None and out.is_contiguous() and data.is_contiguous():
            lib.pdflow_kv_decode(data.data_ptr(), data.shape[1], n, tokens, channels, int(kind == KEYS),
                                 self._group(kind, channels), self.bits, int(self.symmetric), out.data_ptr())
            return
        self.decode_blocks_torch(data, kind, out)

    def decode_blocks_torch(self, data: torch.Tensor, kind: int, out: torch.Tensor) -> None:
        """:meth:`decode_blocks` in PyTorch operations (any dtype)."""
        import torch

        n, tokens, kv_heads, head_dim = out.shape
        channels = kv_heads * head_dim
        code_bytes = tokens * channels * self.bits // 8
        count = self._scale_count(tokens, kind, channels)
        packed = data[:, :code_bytes]
        scale = data[:, code_bytes : code_bytes + 2 * count].contiguous().view(torch.float16).float()
        if self.bits == 8:
            codes = (packed.view(torch.int8) if self.symmetric else packed).float()
        else:
            codes = torch.stack([packed & 15, packed >> 4], dim=-1).float()
            if self.symmetric:
                codes -= 8
        grouped = self._grouped(codes.view(n, tokens, channels), kind)
        shape = grouped.shape[:-1] + (1,)
        values = grouped * scale.view(shape)
        if not self.symmetric:
            minimum = data[:, code_bytes + 2 * count :].contiguous().view(torch.float16).float()
            values += minimum.view(shape)
        out.view(n, tokens, channels).copy_(self._ungrouped(values, kind, tokens))


class Int8(Quantized):
    """8-bit codes, symmetric by default (for 8 bits a minimum buys little and costs bytes)."""

    name = "int8"
    bits = 8
    defaults = {"key_group": 64, "value_group": 0, "symmetric": True}


class Int4(Quantized):
    """4-bit codes, two per byte, asymmetric by default (KIVI's choice at low bit widths)."""

    name = "int4"
    bits = 4
    defaults = {"key_group": 64, "value_group": 64, "symmetric": False}
