"""The KV-quantizer interface (`--kv-cache-dtype NAME`): the storage format of the paged cache.

A quantizer answers two questions; the cache's one layout type, `kvtransfer.CacheLayout` (built by
tandem/engine/kv_layout.py), turns the answers into shapes, bytes per block (what
`kv_cache_memory_gb` is divided by) and what a KV connector moves:

- `cache_dtype(model_dtype)`: the element type of the cache tensor;
- `has_scales`: whether a `kv_scale [num_blocks, 2, block_size, kv_heads]` float32 tensor (one scale
  per token and KV head, `x ≈ q * scale`) exists beside each layer's cache. The layout knows which
  cache dtypes carry scales (int8, fp8 e4m3: the ones the kernels dequantize).

The math itself (quantize on store, dequantize in attention) lives in the kernels
(`kernels/reference.py` and the Triton ops), which key it off the cache dtype; a quantizer plugin
therefore picks a dtype the kernels implement (`kernels.reference.QUANT_MAX`) or stores as-is.

`NoQuantizer` (the model's dtype, no scales) is here rather than with the other built-ins in
plugins/quantizers.py because it is the engine's default when no quantizer is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kernels.reference import dequantize_rows, quantize_rows

SCALE_DTYPE = torch.float32


class KVQuantizer(ABC):
    """Storage format of the KV cache. Stateless; built once per engine with no arguments."""

    name: ClassVar[str]
    has_scales: ClassVar[bool]

    @abstractmethod
    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the cache tensors for a model computing in `model_dtype`."""

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
