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
1.17-1.20x faster (the 55M Llama, bound by its weights: 1.03x; docs/PERFORMANCE.md, session 28). What that
call needs (the layers' C arrays) is kept on the model's layer list and checked as a whole each step (_stack):
asking each layer for its plan cost 59 us of Python a step against 19, and batch-1 decode of the shipped
model 1.08-1.15x (session 31). tandem/layers/fused_model.py does the same for a whole model body and its
lm_head, through this stack.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass

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
    slots = layer.__dict__.get("_fused_slots")
    if slots is None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        pairs = [(lin._parameters, name) for lin in linears for name in ("weight", "bias")] + [
            (norm._parameters, "weight") for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        slots = layer._fused_slots = ([d for d, _ in pairs], [name for _, name in pairs])
    return tuple(map(dict.get, *slots))  # map over C callables: no Python frame per parameter


_VERSION = operator.attrgetter("_version")


def _versions(present: tuple) -> tuple:
    try:
        return tuple(map(_VERSION, present))
    except RuntimeError:  # made under inference_mode: no version counter; storage and shape, as Linear keys them
        return tuple(map(_weight_key, present))


def _layer_plan(layer) -> tuple | None:
    """(the C struct, a scratch buffer for MAX_ROWS rows), made again when one of the layer's parameters is
    replaced or written (keyed on the parameters' identities and version counters: a few us a call, where
    asking each linear for its plan cost ~15); None where a linear has no C plan. Called for every layer of
    every small decode step, so the check runs as C-level maps (generator expressions here cost ~6 us a
    layer, ~30 us a step of the shipped model)."""
    params = _params(layer)
    ids = tuple(map(id, params))
    cached = layer.__dict__.get("_fused_plan")
    if cached is not None and cached[0] == ids and cached[2] == _versions(cached[1]):
        return cached[3]
    present = tuple(p for p in params if p is not None)
    planned = _make_layer_plan(layer)
    # The entry keeps the parameters (so the ids in it stay theirs) and the plans (so their bf16 copies and
    # the addresses in the struct) alive.
    layer._fused_plan = (ids, present, _versions(present), planned)
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
    stack = _stack(layers, meta.kv_caches)
    if stack is None or t > stack.max_rows:
        return None
    cos, sin = rope
    slots = meta.slot_mapping
    if (x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or cos.shape != (t, 1, stack.head_dim)
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.dtype != torch.float32
            or slots.dtype != torch.int64 or not slots.is_contiguous()
            or (torch.is_grad_enabled() and layers[0].self_attn.qkv_proj.weight.requires_grad)):
        return None
    for window in stack.windows:  # blocks every layer reads are in the cache
        tables, lens = native_cpu._checked(meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_len,
                                           stack.num_blocks, stack.block_size, window)
    out = torch.empty_like(x)
    tmp = torch.empty_like(x) if len(layers) > 1 else None
    structs, caches, scratch = stack.arrays
    rc = lib.tandem_decode_layers_f32(
        structs, len(layers), caches, scratch, x.data_ptr(), out.data_ptr(), None if tmp is None else tmp.data_ptr(),
        t, cos.data_ptr(), sin.data_ptr(), stack.num_blocks * stack.block_size, stack.block_size,
        meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), meta.num_decode_seqs,
        meta.decode_query_len, torch.get_num_threads())
    return out if rc == 0 else None  # a refusal (a slot outside the cache, say): the module path decides


@dataclass
class _Stack:
    """A run of layers' C arrays (their structs, cache and scratch addresses) and what run_layers checks them
    by, kept on the layers' container while their parameters (identity and version) and caches stay the same."""

    dicts: list  # where each parameter of every layer lives (_params' slots, all layers in a row) ...
    names: list  # ... and under which name
    ids: tuple  # the ids of those parameters (None included) when the arrays were made
    present: tuple  # the parameters themselves (keeps those ids theirs), None left out
    versions: tuple  # their version counters then
    caches: tuple  # the layers' cache tensors (kept: their ids below stay theirs)
    cache_ids: tuple
    cache_index: tuple  # each layer's index into the step's kv_caches
    planned: list  # each layer's plan (keeps its struct, scratch and bf16 copies alive)
    arrays: tuple
    max_rows: int
    head_dim: int
    windows: tuple
    num_blocks: int
    block_size: int


def _stack(layers, kv_caches: list) -> _Stack | None:
    """The layers' _Stack, or None where one of them has no C plan or its cache does not qualify (fp32,
    contiguous, on the CPU, all of one shape). Checked as a whole, with C-level maps over every parameter:
    asking each layer for its plan (_layer_plan) cost ~30-40 us a step of the shipped model here, ~4x that
    inside a step whose weight streams evict the interpreter's data (docs/PERFORMANCE.md, session 31)."""
    held = getattr(layers, "__dict__", {}).get("_fused_stack")  # a plain list (run) is planned every call
    if held is not None:
        ids = tuple(map(id, map(dict.get, held.dicts, held.names)))
        if (ids == held.ids and _versions(held.present) == held.versions
                and tuple(map(id, map(kv_caches.__getitem__, held.cache_index))) == held.cache_ids):
            return held
    return _make_stack(layers, kv_caches)


def _make_stack(layers, kv_caches: list) -> _Stack | None:
    first = layers[0].self_attn
    planned, cache_index = [], []
    for layer in layers:
        attn = layer.self_attn
        plan = _layer_plan(layer) if attn.q_norm is None and attn.head_dim == first.head_dim else None
        cache = kv_caches[attn.layer_idx]
        if (plan is None or cache.dtype != torch.float32 or not cache.is_contiguous() or not cache.is_cpu
                or cache.shape != kv_caches[first.layer_idx].shape):
            return None
        planned.append(plan)
        cache_index.append(attn.layer_idx)
    caches = tuple(kv_caches[i] for i in cache_index)
    n = len(planned)
    arrays = ((_LayerPlan * n)(*(plan[0] for plan in planned)), (ctypes.c_void_p * n)(*(c.data_ptr() for c in caches)),
              (ctypes.c_void_p * n)(*(plan[1].data_ptr() for plan in planned)))
    slots = [layer._fused_slots for layer in layers]  # made by _layer_plan's _params
    dicts, names = [d for sl in slots for d in sl[0]], [name for sl in slots for name in sl[1]]
    params = tuple(map(dict.get, dicts, names))
    present = tuple(p for p in params if p is not None)
    stack = _Stack(dicts, names, tuple(map(id, params)), present, _versions(present), caches, tuple(map(id, caches)),
                   tuple(cache_index), planned, arrays, min(plan[2] for plan in planned), first.head_dim,
                   tuple({layer.self_attn.window for layer in layers}), caches[0].shape[0], caches[0].shape[2])
    if hasattr(layers, "__dict__"):
        layers._fused_stack = stack
    return stack
