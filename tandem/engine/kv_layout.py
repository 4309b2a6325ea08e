"""The engine's KV cache described as a `kvtransfer.CacheLayout`: what both halves of a transfer must
agree on byte for byte (the handshake refuses a mismatch), and what a transport's allocator sizes.

The model is identified by architecture + a digest of config.json, so two hosts holding the same
checkpoint at different paths still agree.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Callable

from kvtransfer.base import CacheLayout

if TYPE_CHECKING:
    import torch

    from tandem.config import EngineConfig
    from tandem.engine.interfaces.kv_quantizer import KVQuantizer
    from tandem.models.config import ModelConfig

# (layout, num_blocks, device) -> (kv_caches, kv_scales or None): where a transport wants the KV memory
KVAllocator = Callable[[CacheLayout, int, "torch.device"], "tuple[list[torch.Tensor], list[torch.Tensor] | None]"]


def model_identity(path: str) -> str:
    with open(os.path.join(path, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{os.path.basename(os.path.normpath(path))}@{digest}"


def hidden_state_layers(model: ModelConfig) -> int:
    """Cache layers that hold one token's final hidden state [hidden_size] in its K and V rows
    [2, num_kv_heads, head_dim] (zero-padded): stored at the token's slot like its K/V, so they are
    cached, copied, freed and transferred with its blocks."""
    row = 2 * model.num_kv_heads * model.head_dim
    return -(-model.hidden_size // row)


def cache_layout(config: EngineConfig, model: ModelConfig, quantizer: KVQuantizer,
                 hidden_layers: int = 0) -> CacheLayout:
    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    return CacheLayout(
        model=model_identity(config.model),
        dtype=name(config.torch_dtype),
        kv_cache_dtype=name(quantizer.cache_dtype(config.torch_dtype)),
        block_size=config.block_size,
        num_layers=model.num_layers + hidden_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        hidden_layers=hidden_layers,
    )
