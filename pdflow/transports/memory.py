"""Kinds of memory on the data plane: host memory, or a device's (a GPU's) memory.

A *memory* is named by a string: ``"host"``, or a torch device such as ``"cuda:0"``. Its *kind*
is ``"host"`` or ``"device"``. A transport says which kinds it can send from and land in
(:meth:`pdflow.transports.Transport.memory_kinds`); where a stage's memory is of a kind its
transport cannot use, the bytes go through host buffers (:mod:`pdflow.transports.staging`).

Kept free of a torch import: torch is looked up only where a tensor is already in hand.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

HOST = "host"
DEVICE = "device"
KINDS = (HOST, DEVICE)


def memory_of(data: Any) -> str:
    """Where ``data``'s bytes are: ``"host"`` for buffers and CPU tensors, else the tensor's
    device (``"cuda:0"``; ``"meta"`` for a tensor with no memory at all)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor) and data.device.type != "cpu":
        device = data.device
        return device.type if device.index is None else f"{device.type}:{device.index}"
    return HOST


def kind_of(memory: str) -> str:
    """``"host"`` for host memory (``"host"``, ``"cpu"``), else ``"device"``."""
    return HOST if memory in (HOST, "cpu") else DEVICE


@dataclass(frozen=True)
class MemoryKinds:
    """What a transport can move: the kinds of memory it sends from (``reads``) and lands in
    (``lands``)."""

    reads: frozenset[str] = frozenset({HOST})
    lands: frozenset[str] = frozenset({HOST})

    def pairs(self) -> list[tuple[str, str]]:
        """Every (source kind, landing kind) it moves directly, host first."""
        return [(a, b) for a in KINDS for b in KINDS if a in self.reads and b in self.lands]

    def describe(self) -> str:
        def names(kinds: frozenset[str]) -> str:
            return " or ".join(k for k in KINDS if k in kinds) or "nothing"

        return f"sends from {names(self.reads)} memory, lands in {names(self.lands)} memory"


HOST_ONLY = MemoryKinds()


def cuda_missing() -> str | None:
    """None when a CUDA device can be used here, else why not (without importing torch when it
    is not installed)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False)"
    return None
