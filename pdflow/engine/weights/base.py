"""The interface of a weight format: how a linear layer's weight is stored and multiplied.

A format packs an fp32 weight ``(out_features, in_features)`` once, at load time, into a
:class:`PackedLinear`: a callable ``x -> x @ W.T`` over the last dimension of ``x``, returning
``x``'s dtype, whatever the format computes in. ``nbytes`` is what one call reads from memory
(the decode step's floor is the sum over the model divided by the machine's read bandwidth).
"""

from __future__ import annotations

from typing import ClassVar

import torch


class PackedLinear:
    """One linear layer's packed weight (and bias, kept in fp32)."""

    __slots__ = ("out_features", "in_features", "bias", "nbytes")

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, nbytes: int):
        self.out_features, self.in_features, self.bias, self.nbytes = out_features, in_features, bias, nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` 2-D ``(rows, in_features)`` -> ``(rows, out_features)``, any float dtype."""
        raise NotImplementedError

    def native(self):
        """This weight as pdflow's C kernels read it (a :class:`pdflow.kernels.Matrix`),
        for decode steps run wholly in C; None where the format has no such form."""
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            y = self.matmul(x)
        else:
            y = self.matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)


class WeightFormat:
    """How weights are stored. ``kernel`` names what runs the matrix product."""

    name: ClassVar[str] = ""
    kernel: ClassVar[str] = ""

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, output: bool = False) -> PackedLinear:
        """``output``: the model's output projection (``lm_head``), which a format may keep at
        more bits than the layers' (as 4-bit GGUFs do)."""
        raise NotImplementedError
