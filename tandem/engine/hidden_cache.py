"""The target's final hidden states kept in the paged KV cache, for a speculator that drafts from them
(EAGLE: `Speculator.wants_hidden_states`).

Why in the cache: a token's hidden state then lives exactly as long as its K/V — written at its slot
by every forward pass, kept by the prefix cache, copied on a beam fork, freed with the block — and
crosses from a prefill worker to a decode worker as one more layer of the KV transfer, with no
change to any transport. Without it a decode worker would have to recompute the whole prompt
through the target to get them (what EAGLE under P/D did before).

Layout: `hidden_layers` extra cache layers after the model's (tandem/engine/kv_layout.py). A token's
state [hidden_size] is zero-padded to a multiple of one slot's K+V row (2 * Hkv * D) and split into
K and V halves per layer, stored with the same `store_kv` op as the K/V (quantized as the cache is:
a quantized cache keeps an approximation, which only changes which tokens are drafted — the
verification stays exact). A small decode step's C call (tandem/layers/fused_model.py) writes the same
bytes itself: from Python this cost ~0.1 ms of a ~2.5 ms EAGLE step of the shipped model.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels import KernelOps
from kernels.reference_cache import dequantize_rows


def store_hidden(ops: KernelOps, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
                 hidden: torch.Tensor, slot_mapping: torch.Tensor, hidden_layers: int,
                 layer_hook: Callable[[int], None] | None) -> None:
    """Write the step's final hidden states [T, H] at the tokens' slots; `layer_hook` is called per
    hidden layer as for the model's layers (a prefill worker pushes it to its decode worker)."""
    first = len(kv_caches) - hidden_layers
    t = hidden.shape[0]
    _, _, _, hkv, d = kv_caches[first].shape
    row = hkv * d
    pad = 2 * row * hidden_layers - hidden.shape[1]  # 0 when the layers hold the states exactly (no copy)
    padded = torch.nn.functional.pad(hidden, (0, pad)) if pad else hidden
    for i in range(hidden_layers):
        part = padded[:, 2 * row * i:2 * row * (i + 1)]
        layer = first + i
        ops.store_kv(part[:, :row].reshape(t, hkv, d), part[:, row:].reshape(t, hkv, d), kv_caches[layer],
                     slot_mapping, kv_scales[layer] if kv_scales is not None else None)
        if layer_hook is not None:
            layer_hook(layer)


def read_hidden(kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None, block_ids: list[int],
                lo: int, hi: int, hidden_layers: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The hidden states [hi - lo, H] of positions [lo, hi) of a sequence holding `block_ids`; None
    where a position's block is not held (released behind a sliding window)."""
    first = len(kv_caches) - hidden_layers
    num_blocks, _, bs, hkv, d = kv_caches[first].shape
    pos = torch.arange(lo, hi)
    blocks = torch.tensor(block_ids[lo // bs:(hi - 1) // bs + 1], dtype=torch.long) if hi > lo else None
    if blocks is None or (blocks < 0).any():
        return None
    block = blocks[pos // bs - lo // bs]
    k_rows = (block * 2) * bs + pos % bs  # the cache seen as [num_blocks * 2 * bs, Hkv, D] token rows
    rows = torch.cat([k_rows, k_rows + bs]).to(kv_caches[first].device)
    parts = []
    for layer in range(first, first + hidden_layers):
        cache = kv_caches[layer]
        if cache.dtype == torch.float8_e4m3fn:  # index_select has no fp8 kernel: select the bytes
            kv = cache.view(torch.uint8).view(-1, hkv, d).index_select(0, rows).view(cache.dtype)
        else:
            kv = cache.view(num_blocks * 2 * bs, hkv, d).index_select(0, rows)
        scale = None
        if kv_scales is not None:
            scale = kv_scales[layer].view(num_blocks * 2 * bs, hkv).index_select(0, rows)
        kv = dequantize_rows(kv, scale, dtype).reshape(2, hi - lo, hkv * d)
        parts += [kv[0], kv[1]]
    return torch.cat(parts, dim=1)[:, :hidden_size]
