"""A small decode step's whole Llama body and lm_head in one C call (kernels/csrc/decode_layer_cpu.c,
`tandem_decode_model_f32`): the rows' embeddings and rotary rows gathered, the decoder layers (through
fused_decode's kept layer stack), the final norm, every row's logits, the block tables checked and, where the
cache has hidden-state layers (EAGLE), the final hidden states stored into them, in C.

Why: inside a decode step every torch op and Python function runs after the layers' weight streams have evicted
the interpreter's code and data: the embedding lookup of one row, the rotary rows, the final norm and the
lm_head's call cost 40-150 us each there (1-15 us hot), the checks around the call ~190 us on the shipped model
(docs/PERFORMANCE.md, session 33). What the call takes from the model is kept on it (_Body) and checked by
identity and version each step. The result is bitwise the module path's (tests/test_fused_decode.py).
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass

import torch

from kernels import fused, native_cpu
from tandem.layers import fused_decode
from tandem.layers.fused_decode import _linear_plan, _Stack, _stack, _versions
from tandem.layers.linear import SMALL_BATCH, SMALL_BATCH_BF16


def run_model(model, input_ids: torch.Tensor, positions: torch.Tensor, meta,
              lm_head=None) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None] | None:
    """(A Llama body's output for a small decode step — the final norm of its layers applied to the rows'
    embeddings — and, given its `lm_head`, every row's logits and their argmax, else None and None), in one C
    call that also gathers the embeddings and rotary rows and checks the block tables; None where it does not
    apply (the caller runs embedding, rotary lookup and run_layers). Why: after the layers' weight streams, those
    torch ops, the lm_head's call, the checks and the greedy sampler's argmax ran with the interpreter's code and
    data evicted, ~20-150 us each (sessions 33-34). What the call needs from the model is kept (_body). Logits
    only where the lm_head's own call would take the same C kernel (its small-batch plan covers the rows):
    bitwise what it returns; the argmax is kernels.fused.argmax_rows' of them (a row with a grammar's mask in
    meta.argmax_masks: kernels.fused.masked_argmax's). With meta.hidden_layers the call
    also stores the output into those last cache layers (as hidden_cache.store_hidden) and sets meta.hidden_stored."""
    t, lib = input_ids.shape[0], native_cpu.library()
    if (not 0 < t <= fused_decode.MAX_ROWS or meta.num_decode_tokens != t or meta.layer_hook is not None
            or meta.kv_scales is not None or meta.ops.name != "native" or not fused.ALLOWED or lib is None):
        return None
    stack = _stack(model.layers, meta.kv_caches)
    body = None if stack is None or t > stack.max_rows else _body(model, stack, lm_head)
    slots, tables, lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
    if (body is None or slots.dtype != torch.int64 or tables.dtype != torch.int32 or lens.dtype != torch.int32
            or input_ids.dtype != torch.int64 or positions.dtype != torch.int64 or positions.shape != (t,)
            or not (slots.is_contiguous() and tables.is_contiguous() and lens.is_contiguous()
                    and input_ids.is_contiguous() and positions.is_contiguous())
            or (torch.is_grad_enabled() and body.tensors[0].requires_grad)):
        return None
    out = torch.empty((t, body.hidden))
    logits = torch.empty((t, body.vocab)) if body.head is not None and t <= body.head_rows else None
    best = None if logits is None else (ctypes.c_int64 * t)()  # not a tensor: see fused.argmax_rows
    hidden_caches = _hidden_caches(meta.kv_caches, meta.hidden_layers, stack) if meta.hidden_layers else None
    rc = lib.tandem_decode_model_f32(
        *body.args, None if logits is None else body.head, *body.buffers, input_ids.data_ptr(), positions.data_ptr(),
        t, slots.data_ptr(), tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
        meta.num_decode_seqs, meta.decode_query_len, out.data_ptr(), None if logits is None else logits.data_ptr(),
        best, *(meta.argmax_masks or (None, 0)), hidden_caches, meta.hidden_layers if hidden_caches else 0,
        torch.get_num_threads())
    if rc != 0:
        return None
    meta.hidden_stored = hidden_caches is not None
    return out, logits, None if best is None else best[:]


def stack_rows(model, kv_caches: list) -> int | None:
    """The most rows run_model takes for this model body (its layer stack's limit), or None where it does not
    apply (no native kernels, not allowed, a layer without a C plan)."""
    if native_cpu.library() is None or not fused.ALLOWED:
        return None
    stack = _stack(model.layers, kv_caches)
    return None if stack is None else min(stack.max_rows, fused_decode.MAX_ROWS)


def _hidden_caches(kv_caches: list, n: int, stack: _Stack) -> ctypes.Array | None:
    """The addresses of the last n cache layers (the hidden-state layers) for the C call to store the final hidden
    states into, or None where one is not an fp32 CPU tensor laid out as the layers' caches (the runner's
    store_hidden then writes them)."""
    layers = kv_caches[len(kv_caches) - n:]
    shape = stack.caches[0].shape
    if not all(c.dtype == torch.float32 and c.is_cpu and c.is_contiguous() and c.shape == shape for c in layers):
        return None
    return (ctypes.c_void_p * n)(*(c.data_ptr() for c in layers))


@dataclass
class _Body:
    """What run_model's call takes from a model, kept on it while the layer stack, the embedding, norm and rotary
    tensors (identity and version) and the lm_head's plan stay the same."""

    stack: _Stack
    tensors: tuple  # embedding, final norm weight, rotary cos and sin (kept: their ids stay theirs)
    versions: tuple
    plan: tuple | None  # the lm_head's plan the head struct was made from
    hidden: int
    vocab: int  # the lm_head's outputs
    head: object  # the lm_head's plan as a C struct (byref), or None
    head_rows: int  # rows up to which the lm_head's own call takes that plan
    args: tuple  # the call's leading arguments, up to the head
    buffers: tuple  # work, x_out, x_tmp addresses and the model's constants after the head
    scratch: torch.Tensor


def _body(model, stack: _Stack, lm_head) -> _Body | None:
    """The model's _Body (made again when anything it was made from changed), or None where the call does not
    apply: an embedding, norm or rotary table that is not a contiguous fp32 CPU tensor of the layers' sizes.
    Read through the modules' own dicts: nn.Module's attribute lookup cost ~5 us each inside a step."""
    mods = model._modules
    rotary = mods["rotary"]._buffers
    tensors = (mods["embed_tokens"]._parameters["weight"], mods["norm"]._parameters["weight"], rotary["cos"],
               rotary["sin"])
    plan = None if lm_head is None else lm_head.small_batch_plan()
    held = model.__dict__.get("_fused_body")
    if (held is not None and held.stack is stack and held.plan is plan and all(map(operator.is_, tensors, held.tensors))
            and _versions(tensors) == held.versions):
        return held
    embed, norm, cos, sin = tensors
    hidden, d = embed.shape[-1], stack.head_dim
    if not (all(x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() for x in tensors) and embed.dim() == 2
            and norm.shape == (hidden,) and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == d):
        return None
    head, head_rows, vocab = None, 0, 0
    if plan is not None and lm_head.weight.shape[1] == hidden:
        head, head_rows, vocab = ctypes.byref(_linear_plan(lm_head, plan)), SMALL_BATCH_BF16 if plan[3] else \
            SMALL_BATCH, lm_head.weight.shape[0]
    rows = fused_decode.MAX_ROWS
    scratch = torch.empty(rows * (3 * hidden + 2 * d))
    address, step = scratch.data_ptr(), rows * hidden * 4
    structs, caches, layer_scratch = stack.arrays
    windows = [w or 0 for w in stack.windows]
    args = (structs, len(model.layers), caches, layer_scratch, embed.data_ptr(), embed.shape[0], cos.data_ptr(),
            sin.data_ptr(), cos.shape[0], norm.data_ptr(), model.norm.eps)
    buffers = (address + 2 * step, address, address + step, stack.num_blocks, stack.block_size,
               0 if 0 in windows else max(windows))  # the widest window reads the most blocks
    body = _Body(stack, tensors, _versions(tensors), plan, hidden, vocab, head, head_rows, args, buffers,
                 scratch)
    model._fused_body = body
    return body
