"""The fused decode layer (tandem/layers/fused_decode.py, kernels/csrc/decode_layer_cpu.c): bitwise the
module path's output and cache writes wherever it applies, refused where it does not, and taken by real
decode steps of the engine, whose greedy tokens still equal transformers'."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import NATIVE_CPU_OPS, native_cpu
from tandem.engine import sampler
from tandem.layers import fused_decode, fused_model
from tandem.layers.attention import AttentionMetadata
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ModelConfig
from tandem.models.llama import DecoderLayer
from tests.tiny_models import hf_greedy, make_checkpoint

pytestmark = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler: the fused layer needs one")

BS, NUM_BLOCKS = 4, 100


def _layer(arch: str, bf16_exact: bool, eagle_first: bool, seed: int, **extra) -> DecoderLayer:
    raw = dict(architectures=[arch], vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, **extra)
    layer = DecoderLayer(ModelConfig.from_dict(raw), 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.numel() == 64 else 0.0))
            if bf16_exact:
                p.copy_(p.bfloat16().float())
    if eagle_first:
        layer.input_layernorm = torch.nn.Identity()
    return layer.eval()


def _step(layer: DecoderLayer, b: int, q: int, seed: int):
    """x, rope, meta and the cache of a decode step of b sequences of q tokens each, at random lengths
    over random distinct blocks."""
    g = torch.Generator().manual_seed(seed)
    attn = layer.self_attn
    cache = torch.randn(NUM_BLOCKS, 2, BS, attn.num_kv_heads, attn.head_dim, generator=g)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[:b * 8].reshape(b, 8).int()
    lens = torch.randint(q, 8 * BS + 1, (b,), generator=g).int()
    positions = torch.cat([torch.arange(int(n) - q, int(n)) for n in lens])
    seq = torch.arange(b).repeat_interleave(q)
    slots = (blocks[seq, positions // BS].long() * BS + positions % BS).contiguous()
    x = torch.randn(b * q, 64, generator=g)
    rope = RotaryEmbedding(attn.head_dim, 64, 10000.0, None).lookup(positions, torch.float32)
    meta = AttentionMetadata(ops=NATIVE_CPU_OPS, kv_caches=[cache], kv_scales=None, slot_mapping=slots,
                             num_decode_seqs=b, decode_query_len=q, decode_block_tables=blocks, decode_seq_lens=lens,
                             prefill_block_tables=None, prefill_query_start_loc=None, prefill_seq_lens=None)
    return x, rope, meta, cache


def _module_path(layer, x, rope, meta, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(fused_decode, "MAX_ROWS", 0)
        return layer(x, rope, meta)


@pytest.mark.parametrize("arch,extra", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),  # q/k/v biases
                                        ("MistralForCausalLM", {"sliding_window": 6})])
@pytest.mark.parametrize("bf16_exact", [False, True])
@pytest.mark.parametrize("b,q", [(1, 1), (3, 1), (1, 5), (2, 4), (8, 1), (12, 1), (4, 4)])
def test_fused_layer_is_bitwise_the_module_path(monkeypatch, arch, extra, bf16_exact, b, q):
    """Up to 16 rows where every linear reads bf16 copies, 8 where they read fp32 (the linears' own limits)."""
    layer = _layer(arch, bf16_exact, eagle_first=(b == 3), seed=b * 10 + q, **extra)
    x, rope, meta, cache = _step(layer, b, q, seed=b + q)
    cache_module = cache.clone()
    x_before = x.clone()
    with torch.inference_mode():
        fused = fused_decode.run(layer, x, rope, meta)
        if b * q > (16 if bf16_exact else 8):
            assert fused is None and torch.equal(cache, cache_module)
            return
        assert fused is not None
        meta.kv_caches = [cache_module]
        module = _module_path(layer, x, rope, meta, monkeypatch)
    assert torch.equal(x, x_before)  # the input is not written
    assert torch.equal(fused, module)
    assert torch.equal(cache, cache_module)  # the same K/V rows in the same slots, nothing else touched
    # and a wrong result would show: the step really attends over what it stored
    assert not torch.equal(fused, x)


@pytest.mark.parametrize("bf16_exact", [False, True])
@pytest.mark.parametrize("b,q", [(1, 1), (2, 4), (8, 1)])
@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_fused_layers_in_one_call_are_bitwise_the_module_path(monkeypatch, bf16_exact, b, q, n_layers):
    """run_layers: every layer in one C call, outputs alternating between two buffers (an odd and an even count
    both end in the returned one), each layer's K/V in its own cache; a layer that does not qualify refuses all."""
    layers = [_layer("MistralForCausalLM", bf16_exact, False, seed=7 * i + b, sliding_window=6)
              for i in range(n_layers)]
    x, rope, meta, cache = _step(layers[0], b, q, seed=b * q)
    caches = [cache] + [torch.randn_like(cache) for _ in range(n_layers - 1)]
    for i, layer in enumerate(layers):
        layer.self_attn.layer_idx = i
    module_caches = [c.clone() for c in caches]
    x_before = x.clone()
    with torch.inference_mode():
        meta.kv_caches = caches
        fused = fused_decode.run_layers(layers, x, rope, meta)
        meta.kv_caches = module_caches
        module = x
        for layer in layers:
            module = _module_path(layer, module, rope, meta, monkeypatch)
        assert fused is not None and torch.equal(x, x_before)
        assert torch.equal(fused, module)
        assert all(torch.equal(a, m) for a, m in zip(caches, module_caches))
        if n_layers > 1:  # a Qwen3 layer (q/k norms) among them: none fused
            qwen3 = _layer("Qwen3ForCausalLM", bf16_exact, False, seed=3, head_dim=16)
            qwen3.self_attn.layer_idx = n_layers - 1
            assert fused_decode.run_layers([*layers[:-1], qwen3], x, rope, meta) is None


@pytest.mark.parametrize("bf16_exact", [False, True])
@pytest.mark.parametrize("b,q", [(1, 1), (2, 4), (8, 1)])
def test_the_model_body_in_one_call_is_bitwise_the_module_path(monkeypatch, bf16_exact, b, q):
    """run_model: embeddings, rotary rows, two layers, the final norm and the lm_head in one C call give the
    module path's hidden states, logits and cache writes bit for bit (and the model's forward hands those logits
    to compute_logits of the tensor it returned, once); an id outside the vocabulary is refused before anything
    is written (the module path then raises, as it always did)."""
    from tandem.models.llama import LlamaForCausalLM

    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               tie_word_embeddings=bf16_exact)
    lm = LlamaForCausalLM(ModelConfig.from_dict(raw), 64).eval()
    model = lm.model
    torch.manual_seed(b * 10 + q)
    with torch.no_grad():
        for p in lm.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
            if bf16_exact:
                p.copy_(p.bfloat16().float())
    _, _, meta, cache = _step(model.layers[0], b, q, seed=b * q)
    meta.kv_caches = [cache, torch.randn_like(cache)]
    ids = torch.randint(0, 100, (b * q,), generator=torch.Generator().manual_seed(q))
    positions = torch.cat([torch.arange(int(n) - q, int(n)) for n in meta.decode_seq_lens])
    module_caches = [c.clone() for c in meta.kv_caches]
    with torch.inference_mode():
        fused = fused_model.run_model(model, ids, positions, meta, lm.lm_head)
        fused_caches, meta.kv_caches = meta.kv_caches, module_caches
        with monkeypatch.context() as m:
            m.setattr(fused_decode, "MAX_ROWS", 0)
            module = model(ids, positions, meta)
        assert fused is not None and fused[1] is not None
        assert torch.equal(fused[0], module) and torch.equal(fused[1], lm.lm_head(module))
        assert fused[2] == lm.lm_head(module).argmax(-1).tolist()
        assert all(torch.equal(a, m) for a, m in zip(fused_caches, module_caches))
        assert not torch.equal(fused[0], model.norm(model.embed_tokens(ids)))  # the layers really ran
        written = [c.clone() for c in module_caches]
        assert fused_model.run_model(model, torch.full_like(ids, 100), positions, meta) is None
        tables = meta.decode_block_tables
        meta.decode_block_tables = tables.clone()
        meta.decode_block_tables[-1, (int(meta.decode_seq_lens[-1]) - 1) // BS] = NUM_BLOCKS  # a block it reads
        assert fused_model.run_model(model, ids, positions, meta) is None
        meta.decode_block_tables = tables
        assert all(torch.equal(a, w) for a, w in zip(module_caches, written))
        with torch.no_grad():
            model.norm.weight.mul_(2)  # written in place: the kept body follows it
        meta.kv_caches = [c.clone() for c in written]
        doubled = fused_model.run_model(model, ids, positions, meta, lm.lm_head)
        meta.kv_caches = [c.clone() for c in written]
        with monkeypatch.context() as m:
            m.setattr(fused_decode, "MAX_ROWS", 0)
            again = model(ids, positions, meta)
        assert doubled is not None and torch.equal(doubled[0], again) and not torch.equal(again, fused[0])
        with torch.no_grad():
            model.norm.weight.div_(2)
        meta.kv_caches = [c.clone() for c in written]
        hidden = lm(ids, positions, meta)  # the model's own forward takes it, logits kept for this tensor once
        assert lm._fused_logits is not None and lm._fused_logits[0] is hidden
        logits = lm.compute_logits(hidden)
        assert torch.equal(logits, lm.lm_head(hidden)) and lm._fused_logits is None
        assert lm.fused_argmax is not None and lm.fused_argmax[0] is logits
        assert lm.fused_argmax[1] == logits.argmax(-1).tolist()
        assert torch.equal(lm.compute_logits(hidden[:1]), lm.lm_head(hidden[:1]))


def test_the_fused_layer_follows_a_written_weight(monkeypatch):
    layer = _layer("LlamaForCausalLM", False, False, seed=1)
    x, rope, meta, cache = _step(layer, 1, 1, seed=1)
    with torch.inference_mode():
        first = fused_decode.run(layer, x, rope, meta)
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(2)
        layer.post_attention_layernorm.weight.add_(0.5)
    with torch.inference_mode():
        again = fused_decode.run(layer, x, rope, meta)
        module = _module_path(layer, x, rope, meta, monkeypatch)
    assert not torch.equal(first, again) and torch.equal(again, module)


def test_a_kept_layer_stack_follows_written_and_replaced_weights_and_a_new_cache(monkeypatch):
    """run_layers keeps a model's layer stack (its C arrays) on the ModuleList between steps: a weight written in
    place, a parameter replaced by another tensor, or another cache tensor for a layer must each be seen at
    the next call, bitwise as the module path sees it."""
    layers = torch.nn.ModuleList(_layer("LlamaForCausalLM", False, False, seed=s) for s in (4, 5))
    for i, layer in enumerate(layers):
        layer.self_attn.layer_idx = i
    x, rope, meta, cache = _step(layers[0], 1, 1, seed=4)
    meta.kv_caches = [cache, cache.clone()]

    def both():
        with torch.inference_mode():
            caches = [c.clone() for c in meta.kv_caches]
            saved, meta.kv_caches = meta.kv_caches, caches
            fused = fused_decode.run_layers(layers, x, rope, meta)
            meta.kv_caches = [c.clone() for c in saved]
            module = x
            for layer in layers:
                module = _module_path(layer, module, rope, meta, monkeypatch)
            meta.kv_caches = saved
        assert fused is not None and torch.equal(fused, module)
        return fused

    first = both()
    assert "_fused_stack" in layers.__dict__
    with torch.no_grad():
        layers[1].mlp.down_proj.weight.mul_(2)  # written in place
    written = both()
    layers[0].self_attn.o_proj.weight = torch.nn.Parameter(layers[0].self_attn.o_proj.weight.detach() * 0.5,
                                                           requires_grad=False)  # replaced
    replaced = both()
    meta.kv_caches = [meta.kv_caches[0], torch.randn_like(meta.kv_caches[1])]  # layer 1 reads another cache
    recached = both()
    assert not torch.equal(first, written) and not torch.equal(written, replaced)
    assert not torch.equal(replaced, recached)


def test_steps_it_does_not_apply_to_are_left_to_the_module_path():
    layer = _layer("LlamaForCausalLM", False, False, seed=2)
    x, rope, meta, _ = _step(layer, 1, 1, seed=2)
    with torch.inference_mode():
        assert fused_decode.run(layer, x, rope, meta) is not None
        for change in ({"layer_hook": lambda i: None}, {"kv_scales": [torch.ones(1)]},
                       {"ops": dataclasses.replace(NATIVE_CPU_OPS, name="reference")},
                       {"num_decode_seqs": 0}):
            saved = {k: getattr(meta, k) for k in change}
            for k, v in change.items():
                setattr(meta, k, v)
            assert fused_decode.run(layer, x, rope, meta) is None, change
            for k, v in saved.items():
                setattr(meta, k, v)
        meta.slot_mapping = torch.tensor([NUM_BLOCKS * BS])  # outside the cache: refused before any write
        assert fused_decode.run(layer, x, rope, meta) is None
    qwen3 = _layer("Qwen3ForCausalLM", False, False, seed=3, head_dim=16)  # q/k norms
    x, rope, meta, _ = _step(qwen3, 1, 1, seed=3)
    with torch.inference_mode():
        assert fused_decode.run(qwen3, x, rope, meta) is None


def test_engine_decode_steps_take_the_fused_layer_and_stay_exact(tmp_path, monkeypatch):
    from tandem import LLM, SamplingParams

    path = make_checkpoint(str(tmp_path / "m"), seed=5)
    taken = []
    real = fused_model.run_model
    monkeypatch.setattr(fused_model, "run_model", lambda *a: taken.append((len(a[0].layers), r := real(*a))) or r)
    argmax_passes = []  # the sampler's own argmax: only where the step's C call did not take it (prompt steps)
    real_argmax = sampler.fused.argmax_rows
    monkeypatch.setattr(sampler.fused, "argmax_rows", lambda x: argmax_passes.append(len(x)) or real_argmax(x))
    prompts = [[5, 9, 33, 7, 81, 2, 44], [17, 3, 3, 90, 12]]
    llm = LLM(path, max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 12)
    assert sum(n == 2 and r is not None for n, r in taken) >= 11  # every decode step: the whole body in one call
    assert len(argmax_passes) <= len(prompts)  # decode steps' tokens are the argmax the C call took
