"""Built-in KV-cache quantizers (`--kv-cache-dtype auto|fp8_e4m3|int8`): 1-byte storage formats with
an absmax scale per token and KV head, plus `none` (alias `auto`, the model's dtype).

The interface — what a format must answer (its cache dtype, whether it keeps scales) — is
`tandem.engine.interfaces.kv_quantizer.KVQuantizer`; its names are re-exported here under their old
`plugins.quantizers.*` names for existing code and plugins.
"""

from __future__ import annotations

import torch

from tandem.engine.interfaces.kv_quantizer import SCALE_DTYPE, KVQuantizer, NoQuantizer

__all__ = ["BUILTIN_QUANTIZERS", "FP8E4M3Quantizer", "Int8Quantizer", "KVQuantizer", "NoQuantizer", "SCALE_DTYPE"]


class FP8E4M3Quantizer(KVQuantizer):
    """`fp8_e4m3`: 1 byte per value (3 mantissa bits), absmax scale per token and KV head."""

    name = "fp8_e4m3"
    has_scales = True

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn


class Int8Quantizer(KVQuantizer):
    """`int8`: 1 byte per value (symmetric, 255 levels), absmax scale per token and KV head."""

    name = "int8"
    has_scales = True

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8


BUILTIN_QUANTIZERS: dict[str, type[KVQuantizer]] = {
    q.name: q for q in (NoQuantizer, FP8E4M3Quantizer, Int8Quantizer)
}
