"""RMSNorm with the same arithmetic as Hugging Face's Llama (variance in fp32, scale after the cast back);
the arithmetic itself is kernels/fused.py (one C pass on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it): a residual add and this norm in one pass."""
        return fused.add_rms_norm(x, delta, self.weight, self.eps)
