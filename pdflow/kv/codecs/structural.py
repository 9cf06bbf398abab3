"""Structural KV codecs: they drop part of the KV instead of approximating all of it.

- ``head-prune``: the KV of some kv heads is never sent. Which ones: ``pruned`` lists them
  (``"3.1/7.0"``: layer 3's kv head 1 and layer 7's kv head 0), or ``calibration`` names an
  importance file (``pdflow bench kv-heads`` measures one; ``"smollm2"`` is the one shipped for
  SmolLM2) and ``fraction`` the share of the model's kv heads to prune, least important first,
  never every head of a layer. A pruned kv head takes its whole GQA group of query heads with it:
  the query heads keep their mapping (query head *q* reads kv head ``q // group`` as before), and
  those of a pruned kv head put out zeros, so decode attends with the kept heads only. A block's
  encoding is the kept heads' KV as it is; decoded, a pruned head's KV is zeros.
- ``sink-window``: of a prompt's KV only the first ``sink`` tokens (attention sinks) and the last
  ``window`` tokens are sent and attended (StreamingLLM); the tokens between are dropped. Kept in
  whole blocks (the unit decode's block table addresses): the sink rounded up to a block, the
  window starting at the block boundary at or before ``window`` tokens from the end. Every kept
  token keeps its position (rotary embedding stays right: the keys were rotated where they were
  computed), and the tokens decode generates take the positions after the whole prompt. What is
  sent is the KV's own bytes.

Decode receives either one over its link from kv-shuttle; the store keeps the full KV (a later
request reuses all of it), and prefill always computes with all of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from pdflow.kv.codecs.base import KvCodec

if TYPE_CHECKING:  # torch is imported where KV is encoded, not where a topology is checked
    import torch

__all__ = ["CALIBRATIONS", "HeadPrune", "SinkWindow", "load_importance", "least_important"]

CALIBRATIONS = Path(__file__).with_name("calibration")  # importance files shipped, by model name


class HeadPrune(KvCodec):
    name = "head-prune"
    structural = True
    defaults = {"pruned": "", "calibration": "", "fraction": 0.0}
    path_params = ("calibration",)

    def check(self) -> None:
        calibration, fraction = self.params["calibration"], self.params["fraction"]
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 <= fraction < 1.0:
            raise ValueError(f"head-prune codec: fraction must be a number in [0, 1), got {fraction!r}")
        if not isinstance(calibration, str) or not isinstance(self.params["pruned"], str):
            raise ValueError("head-prune codec: pruned and calibration are strings")
        if calibration:
            if self.params["pruned"]:
                raise ValueError("head-prune codec: give pruned or calibration (with fraction), not both")
            chosen = least_important(load_importance(calibration), fraction)
            # the heads themselves from here on: the spec (in every chunk header) needs no file
            self.params.update(pruned="/".join(f"{layer}.{head}" for layer, head in chosen), calibration="",
                               fraction=0.0)
        elif fraction:
            raise ValueError("head-prune codec: fraction needs a calibration (an importance file)")
        self._pruned: dict[int, frozenset[int]] = {}
        for item in filter(None, self.params["pruned"].split("/")):
            layer, dot, head = item.partition(".")
            if not dot or not layer.isdigit() or not head.isdigit():
                raise ValueError(f"head-prune codec: pruned lists layer.head pairs joined by '/', got {item!r}")
            self._pruned[int(layer)] = self._pruned.get(int(layer), frozenset()) | {int(head)}

    @property
    def pruned(self) -> dict[int, frozenset[int]]:
        """Per layer, the kv heads pruned (layers without any are absent)."""
        return dict(self._pruned)

    def check_model(self, num_layers: int, kv_heads: int) -> None:
        for layer, heads in self._pruned.items():
            if layer >= num_layers or max(heads) >= kv_heads:
                raise ValueError(f"head-prune codec prunes kv head {max(heads)} of layer {layer}; the model has "
                                 f"{num_layers} layers of {kv_heads} kv heads")
            if len(heads) >= kv_heads:
                raise ValueError(f"head-prune codec prunes every kv head of layer {layer}; keep at least one")

    def kept_heads(self, layer: int, kv_heads: int) -> list[bool] | None:
        pruned = self._pruned.get(layer)
        return None if not pruned else [h not in pruned for h in range(kv_heads)]

    def _kept(self, layer: int, kv_heads: int) -> list[int]:
        pruned = self._pruned.get(layer, ())
        return [h for h in range(kv_heads) if h not in pruned]

    def encoded_bytes(self, tokens: int, kind: int, kv_heads: int, head_dim: int, itemsize: int,
                      layer: int = 0) -> int:
        return tokens * len(self._kept(layer, kv_heads)) * head_dim * itemsize

    def encode_blocks(self, blocks: torch.Tensor, kind: int, layer: int = 0) -> torch.Tensor:
        import torch

        kept = self._kept(layer, blocks.shape[2])
        part = blocks if len(kept) == blocks.shape[2] else blocks[:, :, kept]
        return part.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1)

    def decode_blocks(self, data: torch.Tensor, kind: int, out: torch.Tensor, layer: int = 0) -> None:
        n, tokens, kv_heads, head_dim = out.shape
        kept = self._kept(layer, kv_heads)
        values = data.contiguous().view(out.dtype).view(n, tokens, len(kept), head_dim)
        if len(kept) == kv_heads:
            out.copy_(values)
            return
        out[:, :, kept] = values
        out[:, :, [h for h in range(kv_heads) if h not in kept]] = 0


class SinkWindow(KvCodec):
    name = "sink-window"
    lossless = True  # what is sent is sent as it is
    structural = True
    drops_tokens = True
    defaults = {"sink": 4, "window": 1024}

    def check(self) -> None:
        for key, least in (("sink", 0), ("window", 1)):
            value = self.params[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"sink-window codec: {key} must be an integer >= {least}, got {value!r}")

    def kept_blocks(self, tokens: int, block_tokens: int) -> list[int]:
        blocks = -(-tokens // block_tokens)
        sink = -(-self.params["sink"] // block_tokens)
        window = max(0, tokens - self.params["window"]) // block_tokens
        if sink >= window:
            return list(range(blocks))
        return [*range(sink), *range(window, blocks)]

    def encoded_bytes(self, tokens: int, kind: int, kv_heads: int, head_dim: int, itemsize: int,
                      layer: int = 0) -> int:
        return tokens * kv_heads * head_dim * itemsize

    def encode_blocks(self, blocks: torch.Tensor, kind: int, layer: int = 0) -> torch.Tensor:
        import torch

        return blocks.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1)

    def decode_blocks(self, data: torch.Tensor, kind: int, out: torch.Tensor, layer: int = 0) -> None:
        import torch

        out.view(out.shape[0], -1).view(torch.uint8).copy_(data)


def load_importance(source: str) -> list[list[float]]:
    """Per layer, per kv head, an importance (higher: more important) from an importance file
    (``pdflow bench kv-heads --out``), named by path or by a shipped model name. ValueError if
    it cannot be read or is not one."""
    path = CALIBRATIONS / f"{source}.json" if "/" not in source and not source.endswith(".json") else Path(source)
    try:
        data = json.loads(path.expanduser().read_text())
        importance = data["importance"]
        rows = [[float(x) for x in row] for row in importance]
    except FileNotFoundError:
        shipped = ", ".join(sorted(p.stem for p in CALIBRATIONS.glob("*.json")))
        raise ValueError(f"head-prune codec: no importance file {str(path)!r} (shipped: {shipped}; "
                         "`pdflow bench kv-heads --out FILE` measures one)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"head-prune codec: {str(path)!r} is not an importance file: {exc}") from None
    if not rows or any(len(row) != len(rows[0]) or not row for row in rows) \
            or not all(math.isfinite(x) for row in rows for x in row):
        raise ValueError(f"head-prune codec: {str(path)!r} must hold one row of finite numbers per layer, "
                         "each as long as the others")
    return rows


def least_important(importance: list[list[float]], fraction: float) -> list[tuple[int, int]]:
    """The ``fraction`` of all kv heads with the lowest importance, as sorted ``(layer, head)``
    pairs, keeping at least one head in every layer."""
    want = round(fraction * sum(len(row) for row in importance))
    left = [len(row) for row in importance]
    chosen = []
    for value, layer, head in sorted((v, l, h) for l, row in enumerate(importance) for h, v in enumerate(row)):
        if len(chosen) >= want:
            break
        if left[layer] > 1:
            left[layer] -= 1
            chosen.append((layer, head))
    return sorted(chosen)
