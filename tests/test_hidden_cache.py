"""tandem/engine/hidden_cache.py: hidden states stored at token slots in extra cache layers come back
exactly (fp32) or within quantization error (int8), whether or not they fill the layers' K+V rows, and
the layer hook sees every hidden layer (a prefill worker pushes them)."""

from __future__ import annotations

import pytest
import torch

from kernels import get_ops
from tandem.engine.hidden_cache import read_hidden, store_hidden


@pytest.mark.parametrize("hidden_size, hidden_layers", [(64, 1), (96, 2), (40, 1)])  # exact fit, padded, padded
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_store_then_read_round_trip(hidden_size, hidden_layers, dtype):
    blocks, bs, hkv, d, model_layers = 12, 4, 2, 16, 2
    caches = [torch.zeros(blocks, 2, bs, hkv, d, dtype=dtype) for _ in range(model_layers + hidden_layers)]
    scales = [torch.ones(blocks, 2, bs, hkv) for _ in caches] if dtype == torch.int8 else None
    g = torch.Generator().manual_seed(0)
    block_ids = [7, 2, 9, 4]  # a sequence of 16 positions in scattered blocks
    hidden = torch.randn(10, hidden_size, generator=g)  # positions 3..12
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(3, 13)])
    hooked: list[int] = []
    store_hidden(get_ops("cpu"), caches, scales, hidden, slots, hidden_layers, hooked.append)
    assert hooked == list(range(model_layers, model_layers + hidden_layers))
    assert all(not c.any() for c in caches[:model_layers])  # the model's layers are not touched
    got = read_hidden(caches, scales, block_ids, 3, 13, hidden_layers, hidden_size, torch.float32)
    tol = 0.0 if dtype == torch.float32 else 0.01 * hidden.abs().max().item()
    assert got.shape == hidden.shape and (got - hidden).abs().max().item() <= tol + 1e-7
    assert read_hidden(caches, scales, block_ids, 5, 9, hidden_layers, hidden_size, torch.float32).equal(got[2:6])
    # a position whose block was released behind a sliding window (NULL_BLOCK) cannot be read
    assert read_hidden(caches, scales, [-1, *block_ids[1:]], 3, 13, hidden_layers, hidden_size, torch.float32) is None
