"""Rotary position embeddings (rotate-half layout, as in HF Llama), with Llama-3 frequency scaling.

cos/sin are precomputed for every position once; a step indexes them by the tokens' positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import fused


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.x: low frequencies are divided by `factor`, high ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, D] for a step's positions: computed once per step, shared by all layers.
        index_select, unsqueezed in place and cast only when needed: 2 dispatches a table where indexing,
        unsqueeze and .to made 3 (~20 -> ~12 us a batch-1 step; every step of every model pays it)."""
        cos, sin = torch.index_select(self.cos, 0, positions).unsqueeze_(1), torch.index_select(
            self.sin, 0, positions).unsqueeze_(1)
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by rope = (cos, sin) from RotaryEmbedding.lookup (kernels/fused.py: in
    place on the CPU, so x may be a view into the q/k/v projection's output)."""
    return fused.rotate(x, *rope)
