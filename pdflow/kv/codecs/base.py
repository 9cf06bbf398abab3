"""The interface of a KV codec: how one layer's keys (or values) of a run of blocks are encoded
for a link or a store tier, and decoded back.

A codec works block by block: a run of tokens that starts on a block boundary is cut into blocks
of ``block_tokens`` tokens (the last may be shorter), each encoded on its own into a fixed number
of bytes for its token count (:meth:`KvCodec.encoded_bytes`), and the run's encoding is those
blocks' encodings one after another. So a stored block is self-contained (a store tier can hold
it in a slot of :meth:`KvCodec.encoded_bytes` bytes), a chunk of consecutive slots on the wire is
one span, and a receiver finds every block's bytes without a table.

The tensors are token-major ``(tokens, kv_heads, head_dim)`` in the KV dtype, as in the store's
slots (:mod:`pdflow.kv.arena`), of one layer (``layer``: a codec may treat layers differently).

Two kinds of codec: those that change how KV is written (``int8``, ``int4``: every token and head
arrives, approximated), and *structural* ones (:attr:`KvCodec.structural`) that drop part of it:
kv heads (:meth:`KvCodec.kept_heads`, ``head-prune``) or prompt tokens (:meth:`KvCodec.kept_blocks`,
``sink-window``). Decode must then attend with what is kept only, so a structural codec is only
for the link into decode (the store and prefill need all of the KV: prefill computes on from it). Encoded bytes come from peers: :meth:`KvCodec.decode_run` checks
their length and never reads past it; a codec's parameters travel in chunk headers as
:meth:`KvCodec.spec`, from which :func:`pdflow.kv.codecs.from_spec` rebuilds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pdflow.kv.kinds import KEYS, VALUES

if TYPE_CHECKING:  # torch is imported where KV is encoded, not where a topology is checked
    import torch

__all__ = ["KEYS", "VALUES", "KvCodec"]


class KvCodec:
    """One encoding of KV. Subclasses set :attr:`name` and :attr:`defaults` (every parameter
    with its default) and implement :meth:`encoded_bytes`, :meth:`encode_blocks` and
    :meth:`decode_blocks`; the run-level methods are written once, here."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False  # its encoding is the KV's own bytes (what is sent is exact)
    structural: ClassVar[bool] = False  # it drops kv heads or tokens (see the module doc)
    drops_tokens: ClassVar[bool] = False  # it drops prompt tokens (kept_blocks)
    path_params: ClassVar[tuple[str, ...]] = ()  # parameters naming files (relative to a topology's folder)
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise TypeError(f"unknown {self.name} codec parameters {sorted(unknown)}; known: {sorted(self.defaults)}")
        self.params = {**self.defaults, **params}
        self.check()

    def check(self) -> None:
        """Raise ValueError naming a parameter whose value cannot work."""

    @property
    def spec(self) -> str:
        """The codec and every parameter, as chunk headers and block-id salts carry it:
        ``"int8"``, or ``"int8:key_group=32,symmetric=1"`` where a parameter is not its default."""
        changed = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(self.params.items())
                   if v != self.defaults[k]]
        return self.name + (":" + ",".join(changed) if changed else "")

    def __repr__(self) -> str:
        return f"<KvCodec {self.spec}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KvCodec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    # ---- one block (what subclasses write) ----

    def encoded_bytes(self, tokens: int, kind: int, kv_heads: int, head_dim: int, itemsize: int,
                      layer: int = 0) -> int:
        """Bytes of one block of ``tokens`` tokens of ``kind`` encoded (``itemsize``: the KV
        dtype's, for codecs that keep it)."""
        raise NotImplementedError

    def encode_blocks(self, blocks: torch.Tensor, kind: int, layer: int = 0) -> torch.Tensor:
        """``blocks`` ``(n, tokens, kv_heads, head_dim)`` -> uint8 ``(n, encoded_bytes)``."""
        raise NotImplementedError

    def decode_blocks(self, data: torch.Tensor, kind: int, out: torch.Tensor, layer: int = 0) -> None:
        """uint8 ``data`` ``(n, encoded_bytes)`` into ``out`` ``(n, tokens, kv_heads, head_dim)``."""
        raise NotImplementedError

    # ---- what is kept (structural codecs override these) ----

    def check_model(self, num_layers: int, kv_heads: int) -> None:
        """Raise ValueError if this codec cannot apply to a model of this shape."""

    def kept_heads(self, layer: int, kv_heads: int) -> list[bool] | None:
        """Which kv heads of ``layer`` decode attends with: None, all of them."""
        return None

    def kept_blocks(self, tokens: int, block_tokens: int) -> list[int]:
        """The blocks of a ``tokens``-token prompt that are sent to decode and attended, in
        order: all of them, unless the codec drops tokens. Every kept block but the last is full
        (so the kept tokens are contiguous in decode's block table)."""
        return list(range(-(-tokens // block_tokens)))

    # ---- a run of blocks (written once) ----

    def run_bytes(self, tokens: int, kind: int, kv_heads: int, head_dim: int, itemsize: int,
                  block_tokens: int, layer: int = 0) -> int:
        """Bytes of ``tokens`` tokens (from a block boundary) encoded block by block."""
        full, rest = divmod(tokens, block_tokens)
        size = full * self.encoded_bytes(block_tokens, kind, kv_heads, head_dim, itemsize, layer)
        return size + (self.encoded_bytes(rest, kind, kv_heads, head_dim, itemsize, layer) if rest else 0)

    def encode_run(self, chunk: torch.Tensor, kind: int, block_tokens: int, layer: int = 0) -> torch.Tensor:
        """``chunk`` ``(tokens, kv_heads, head_dim)`` of ``layer``, starting on a block boundary
        -> its encoding, a flat uint8 tensor of :meth:`run_bytes` bytes."""
        tokens = chunk.shape[0]
        full, rest = divmod(tokens, block_tokens)
        parts = []
        if full:
            parts.append(self.encode_blocks(chunk[: full * block_tokens].reshape(full, block_tokens, *chunk.shape[1:]),
                                            kind, layer).reshape(-1))
        if rest:
            parts.append(self.encode_blocks(chunk[full * block_tokens :][None], kind, layer).reshape(-1))
        return parts[0] if len(parts) == 1 else torch_module().cat(parts)

    def decode_run(self, data: torch.Tensor | memoryview | bytes, kind: int, out: torch.Tensor, block_tokens: int,
                   layer: int = 0) -> None:
        """The encoding of ``out.shape[0]`` tokens of ``layer`` (as :meth:`encode_run` made it)
        into ``out`` ``(tokens, kv_heads, head_dim)``. ValueError if ``data`` is not exactly that
        long. ``data`` may overlap ``out`` (a chunk decoded where it landed): it is read whole first."""
        tokens, kv_heads, head_dim = out.shape
        data = _as_bytes(data)
        want = self.run_bytes(tokens, kind, kv_heads, head_dim, out.element_size(), block_tokens, layer)
        if data.numel() != want:
            raise ValueError(f"{self.spec} encoding of {tokens} tokens is {want} bytes, got {data.numel()}")
        if _overlaps(data, out):  # copied with numpy: torch's clone may wake its thread pool (ms)
            data = torch_module().from_numpy(data.numpy().copy())
        full, rest = divmod(tokens, block_tokens)
        step = self.encoded_bytes(block_tokens, kind, kv_heads, head_dim, out.element_size(), layer)
        if full:
            self.decode_blocks(data[: full * step].view(full, step), kind,
                               out[: full * block_tokens].view(full, block_tokens, kv_heads, head_dim), layer)
        if rest:
            self.decode_blocks(data[full * step :][None], kind, out[full * block_tokens :][None], layer)


def torch_module():
    """torch, imported on first use (checking a topology needs the codecs, not torch)."""
    import torch

    return torch


def _as_bytes(data: torch.Tensor | memoryview | bytes) -> torch.Tensor:
    torch = torch_module()
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8) if not view.readonly else torch.frombuffer(bytearray(view), dtype=torch.uint8)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel()
