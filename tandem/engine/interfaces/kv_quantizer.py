"""The KV-quantizer interface (`--kv-cache-dtype NAME`): the storage format of the paged cache.

A quantizer answers four questions, so the engine can size and allocate the cache and a KV
connector can move it without knowing the format:

- `cache_dtype(model_dtype)`: the element type of the cache tensor;
- `has_scales`: whether a `kv_scale [num_blocks, 2, block_size, kv_heads]` float32 tensor (one scale
  per token and KV head, `x ≈ q * scale`) exists beside each layer's cache;
- `bytes_per_block(layout, num_layers)`: the true bytes of one block across all layers, scales
  included (this is what `kv_cache_memory_gb` is divided by);
- `transfer_layout(layout)`: the tensors that move, per layer and per block, in order.

The math itself (quantize on store, dequantize in attention) lives in the kernels
(`kernels/reference.py` and the Triton ops), which key it off the cache dtype; a quantizer plugin
therefore picks a dtype the kernels implement (`kernels.reference.QUANT_MAX`) or stores as-is.

`NoQuantizer` (the model's dtype, no scales) is here rather than with the other built-ins in
plugins/quantizers.py because it is the engine's default when no quantizer is given.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from kernels.reference import QUANT_MAX, dequantize_rows, quantize_rows

SCALE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one layer's paged cache (everything a quantizer needs to size it)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    model_dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class TransferTensor:
    """One tensor a layer's block consists of: `kv` [2, bs, H, D] and, if quantized, `kv_scale` [2, bs, H].

    A connector sends, for each layer and each block id, `block_shape` elements of `dtype` from the
    tensor named `name` (`ModelRunner.kv_caches` / `ModelRunner.kv_scales`), indexed by block id
    along dim 0 — the same `gather_blocks` / `scatter_blocks` ops pack both."""

    name: str
    block_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * torch.empty(0, dtype=self.dtype).element_size()


class KVQuantizer(ABC):
    """Storage format of the KV cache. Stateless; built once per engine with no arguments."""

    name: ClassVar[str]
    has_scales: ClassVar[bool]

    @abstractmethod
    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the cache tensors for a model computing in `model_dtype`."""

    def transfer_layout(self, layout: KVLayout) -> list[TransferTensor]:
        """Per layer and per block, the tensors that hold (and must move) its K/V, in order."""
        bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
        tensors = [TransferTensor("kv", (2, bs, h, d), self.cache_dtype(layout.model_dtype))]
        if self.has_scales:
            tensors.append(TransferTensor("kv_scale", (2, bs, h), SCALE_DTYPE))
        return tensors

    def bytes_per_block(self, layout: KVLayout, num_layers: int) -> int:
        """Bytes one block takes across all layers, scales included."""
        return num_layers * sum(t.bytes_per_block for t in self.transfer_layout(layout))

    def allocate(self, layout: KVLayout, num_layers: int, num_blocks: int,
                 alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(kv_caches, kv_scales or None): one tensor per layer each, `[num_blocks, *block_shape]`."""
        kv, *scale = self.transfer_layout(layout)
        if self.has_scales and kv.dtype not in QUANT_MAX:
            raise ValueError(f"KV quantizer {self.name!r} stores {kv.dtype} with scales, but the kernels "
                             f"only dequantize {sorted(str(d) for d in QUANT_MAX)}")
        caches = [alloc((num_blocks, *kv.block_shape), kv.dtype) for _ in range(num_layers)]
        scales = [alloc((num_blocks, *scale[0].block_shape), scale[0].dtype) for _ in range(num_layers)] \
            if scale else None
        return caches, scales

    # The kernels do this on store / in attention; exposed for connectors and tests.
    def quantize(self, x: torch.Tensor, model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., D] rows -> (stored values, per-row scale or None)."""
        dtype = self.cache_dtype(model_dtype)
        if not self.has_scales:
            return x.to(dtype), None
        return quantize_rows(x, dtype)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor | None, model_dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(q, scale, model_dtype)


class NoQuantizer(KVQuantizer):
    """`none` (alias `auto`): K/V stored in the model's dtype, no scales."""

    name = "none"
    has_scales = False

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype
