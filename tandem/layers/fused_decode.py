"""A decoder layer of a small decode step in one C call (kernels/csrc/decode_layer_cpu.c).

Why: a batch-1 decode step of the shipped model spends ~190 us per layer, of which ~100 us is the
Python, ctypes and torch plumbing between the ten C kernels the layer calls (docs/PERFORMANCE.md,
"Session 14"); the same plumbing sets the cost of every EAGLE head pass. `run` hands the layer's weights
(the plans `Linear.small_batch_plan` makes, so the same bf16 or fp32 kernels) and the step's cache
addresses to one C function that calls those kernels back to back: the result is bitwise the module
path's (tests/test_fused_decode.py).

It applies to steps of up to MAX_ROWS tokens (SMALL_BATCH where a linear reads fp32 weights: past that,
oneDNN wins, and the module path takes it) that are all decode rows, on the native CPU ops, with an
fp32 cache without scales, no q/k norms, no per-layer hook (a prefill worker's layer-by-layer send),
in inference; anywhere else `run` returns None and the module path runs.

`run_layers` runs a step's layers in one C call (LlamaModel takes it first): inside a step, the Python
between per-layer calls cost ~65 us a layer, not the ~15 us it costs alone, because each layer's weight
stream evicts the code and data it uses; one call for the model made batch-1 decode of the shipped model
1.17-1.20x faster (the 55M Llama, bound by its weights: 1.03x; docs/PERFORMANCE.md, session 28).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import fused, native_cpu
from tandem.layers.linear import SMALL_BATCH, SMALL_BATCH_BF16, _weight_key

MAX_ROWS = SMALL_BATCH_BF16  # a layer whose linears all read bf16 copies; SMALL_BATCH where one reads fp32


class _LinearPlan(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("out_features", ctypes.c_int64),
                ("in_features", ctypes.c_int64), ("bf16", ctypes.c_int64)]


class _LayerPlan(ctypes.Structure):  # tandem_layer_t
    _fields_ = [("qkv", _LinearPlan), ("o", _LinearPlan), ("gate_up", _LinearPlan), ("down", _LinearPlan),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("input_eps", ctypes.c_float),
                ("post_eps", ctypes.c_float), ("scale", ctypes.c_float), ("heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("window", ctypes.c_int32)]


def _linear_plan(linear, plan: tuple) -> _LinearPlan:
    out_features, in_features = linear.weight.shape
    return _LinearPlan(plan[1], plan[2], out_features, in_features, int(plan[3]))


def _params(layer) -> tuple:
    """The layer's linear weights and biases and its norms' weights (None for a missing one: no bias, an EAGLE
    head's first layer without input norm). Where they live is looked up once per layer (nn.Module's
    attribute lookup made this ~9 us a call); a parameter replaced since is still seen."""
    slots = layer.__dict__.get("_fused_param_slots")
    if slots is None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        slots = tuple((lin._parameters, name) for lin in linears for name in ("weight", "bias")) + tuple(
            (norm._parameters, "weight") for norm in (layer.input_layernorm, layer.post_attention_layernorm))
        layer._fused_param_slots = slots
    return tuple(params.get(name) for params, name in slots)


def _versions(params: tuple) -> tuple:
    try:
        return tuple(None if p is None else p._version for p in params)
    except RuntimeError:  # made under inference_mode: no version counter; storage and shape, as Linear keys them
        return tuple(None if p is None else _weight_key(p) for p in params)


def _layer_plan(layer) -> tuple | None:
    """(the C struct, a scratch buffer for MAX_ROWS rows), made again when one of the layer's parameters is
    replaced or written (keyed on the parameters and their version counters: ~1 us a call, where asking
    each linear for its plan cost ~15); None where a linear has no C plan."""
    params = _params(layer)
    versions = _versions(params)
    cached = layer.__dict__.get("_fused_decode")
    if cached is not None and cached[0] == versions and all(a is b for a, b in zip(cached[1], params)):
        return cached[2]
    planned = _make_layer_plan(layer)
    # The entry keeps the parameters (so their ids stay theirs) and the plans (so their bf16 copies and the
    # addresses in the struct) alive.
    layer._fused_decode = (versions, params, planned)
    return planned


def _make_layer_plan(layer) -> tuple | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    plans = tuple(lin.small_batch_plan() for lin in linears)
    norm_in = getattr(layer.input_layernorm, "weight", None)
    norms = (norm_in, layer.post_attention_layernorm.weight)
    if any(p is None for p in plans) or any(
            w is not None and (w.dtype != torch.float32 or not w.is_contiguous() or not w.is_cpu) for w in norms):
        return None
    struct = _LayerPlan(
        *(_linear_plan(lin, p) for lin, p in zip(linears, plans)),
        None if norm_in is None else norm_in.data_ptr(), norms[1].data_ptr(),
        getattr(layer.input_layernorm, "eps", 0.0), layer.post_attention_layernorm.eps, attn.scale,
        attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window or 0)
    lib = native_cpu.library()
    scratch = torch.empty(lib.tandem_decode_layer_scratch(ctypes.byref(struct), MAX_ROWS))
    max_rows = SMALL_BATCH_BF16 if all(p[3] for p in plans) else SMALL_BATCH  # as Linear's own calls decide
    return struct, scratch, max_rows, plans


def run(layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor | None:
    """The layer's output for x, or None where the fused call does not apply (see the module docstring)."""
    return run_layers([layer], x, rope, meta)


def run_layers(layers, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor | None:
    """The output of `layers` applied in turn to x, in one C call; None where the fused call does not apply to
    every one of them (the caller then runs the module path from the first layer)."""
    t, lib = x.shape[0], native_cpu.library()
    if (not layers or not 0 < t <= MAX_ROWS or meta.num_decode_tokens != t or meta.layer_hook is not None
            or meta.kv_scales is not None or meta.ops.name != "native" or not fused.ALLOWED or lib is None):
        return None
    first = layers[0].self_attn
    cos, sin = rope
    slots, cache0 = meta.slot_mapping, meta.kv_caches[first.layer_idx]
    if (x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or cos.shape != (t, 1, first.head_dim)
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.dtype != torch.float32
            or slots.dtype != torch.int64 or not slots.is_contiguous()
            or (torch.is_grad_enabled() and first.qkv_proj.weight.requires_grad)):
        return None
    planned = []
    for layer in layers:
        attn = layer.self_attn
        cache = meta.kv_caches[attn.layer_idx]
        plan = _layer_plan(layer) if attn.q_norm is None and attn.head_dim == first.head_dim else None
        if (plan is None or t > plan[2] or cache.dtype != torch.float32 or not cache.is_contiguous()
                or not cache.is_cpu or cache.shape != cache0.shape):
            return None
        planned.append((plan, cache))
    num_blocks, block_size = cache0.shape[0], cache0.shape[2]
    for window in {layer.self_attn.window for layer in layers}:  # blocks every layer reads are in the cache
        tables, lens = native_cpu._checked(meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_len,
                                           num_blocks, block_size, window)
    structs, caches, scratch = _arrays(layers[0], planned)
    out = torch.empty_like(x)
    tmp = torch.empty_like(x) if len(layers) > 1 else None
    rc = lib.tandem_decode_layers_f32(
        structs, len(layers), caches, scratch, x.data_ptr(), out.data_ptr(), None if tmp is None else tmp.data_ptr(),
        t, cos.data_ptr(), sin.data_ptr(), num_blocks * block_size, block_size, slots.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), meta.num_decode_seqs, meta.decode_query_len, torch.get_num_threads())
    return out if rc == 0 else None  # a refusal (a slot outside the cache, say): the module path decides


def _arrays(owner, planned: list[tuple[tuple, torch.Tensor]]) -> tuple:
    """The C arrays of the layers' structs, cache and scratch addresses, kept on `owner` while the plans and
    caches they were made from stay the same objects (a plan is remade when its weights change)."""
    key = tuple(id(p) for pair in planned for p in pair)
    cached = owner.__dict__.get("_fused_arrays")
    if cached is not None and cached[0] == key:
        return cached[2]
    n = len(planned)
    arrays = ((_LayerPlan * n)(*(plan[0] for plan, _ in planned)),
              (ctypes.c_void_p * n)(*(cache.data_ptr() for _, cache in planned)),
              (ctypes.c_void_p * n)(*(plan[1].data_ptr() for plan, _ in planned)))
    owner._fused_arrays = (key, planned, arrays)  # `planned` keeps the ids in the key theirs
    return arrays
