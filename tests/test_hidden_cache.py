"""tandem/engine/hidden_cache.py: hidden states stored at token slots in extra cache layers come back
exactly (fp32) or within quantization error (int8), whether or not they fill the layers' K+V rows, and
the layer hook sees every hidden layer (a prefill worker pushes them); a small decode step's C call writes the
same bytes itself."""

from __future__ import annotations

import pytest
import torch

from kernels import NATIVE_CPU_OPS, get_ops, native_cpu
from tandem.engine.hidden_cache import read_hidden, store_hidden
from tandem.engine.kv_layout import hidden_state_layers
from tandem.layers import fused_decode, fused_model
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM
from tests.test_fused_decode import BS, _step


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


@pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler: the fused model call needs one")
@pytest.mark.parametrize("kv_heads, head_dim", [(2, 16), (1, 16), (2, 24)])  # a layer exactly, two, one padded
def test_the_model_call_stores_the_final_hidden_states_as_store_hidden_does(monkeypatch, kv_heads, head_dim):
    """With hidden-state layers (EAGLE), run_model writes the rows' final hidden states into them — every byte
    store_hidden writes after the module path, the zero padding included — and says so (meta.hidden_stored),
    so the runner does not write them again."""
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
                                     intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5))
    lm = LlamaForCausalLM(cfg, 64).eval()
    torch.manual_seed(kv_heads * head_dim)
    with torch.no_grad():
        for p in lm.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    n = hidden_state_layers(cfg)
    _, _, meta, cache = _step(lm.model.layers[0], 2, 3, seed=head_dim)
    meta.kv_caches = [cache, *(torch.randn_like(cache) for _ in range(1 + n))]  # garbage where padding goes
    meta.hidden_layers = n
    expected = [c.clone() for c in meta.kv_caches]
    ids = torch.randint(0, 100, (6,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(int(m) - 3, int(m)) for m in meta.decode_seq_lens])
    with torch.inference_mode():
        fused = fused_model.run_model(lm.model, ids, positions, meta, lm.lm_head)
        assert fused is not None and meta.hidden_stored
        fused_caches, meta.kv_caches = meta.kv_caches, expected
        with monkeypatch.context() as m:
            m.setattr(fused_decode, "MAX_ROWS", 0)
            module = lm.model(ids, positions, meta)
        store_hidden(NATIVE_CPU_OPS, expected, None, module, meta.slot_mapping, n, None)
    assert torch.equal(fused[0], module)
    assert len(fused_caches) == 2 + n and all(torch.equal(a, e) for a, e in zip(fused_caches, expected))
    row = 2 * kv_heads * head_dim
    if n * row > 64:  # the padding really was written (over the garbage)
        slot = int(meta.slot_mapping[0])
        v_row = fused_caches[-1][slot // BS, 1, slot % BS].flatten()  # the last layer's V half ends the state
        assert not v_row[64 - row // 2 * (2 * n - 1):].any()
