"""EAGLE's greedy draft passes in one C call (kernels/csrc/eagle_draft_cpu.c).

Each pass after the first feeds the previous pass's draft token and output state, so for greedy requests
nothing between passes needs Python. The first pass (the catch-up over the accepted tokens, as many rows
per request) runs in C too where the decode path takes it; else in Python, and the rest in C.
`FusedDrafter.draft` hands the head's plans (the same C plans its modules run: tandem/layers/fused_decode.py,
tandem/layers/linear.py) and every request's head block table to the C loop, which makes the same drafts
and head-cache K/V as the Python passes, bitwise. It returns None where the loop does not apply — no native
kernels or not allowed (TANDEM_KERNELS), more than MAX_ROWS rows, a layer or linear without a C plan,
anything not fp32 on the CPU — and the caller runs the passes in Python.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import fused, native_cpu
from tandem.layers import fused_decode
from tandem.layers import linear as linear_mod

MAX_ROWS = 16  # rows of one pass (requests x first-pass tokens), as kernels/csrc/eagle_draft_cpu.c


class FusedDrafter:
    """The draft loop of one EAGLE head: head (tandem.models.eagle.EagleHead), the target's embedding and
    lm_head (shared), the head's per-layer paged caches."""

    def __init__(self, head, embed: torch.nn.Embedding, lm_head, vocab_size: int, kv_caches: list[torch.Tensor],
                 block_size: int, draft_ids: torch.Tensor | None = None) -> None:
        """lm_head: the head's logits over `vocab_size` columns; draft_ids: their target ids (a draft
        vocabulary, tandem/models/eagle.py), or None where columns are target ids."""
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.draft_ids = None if draft_ids is None else draft_ids.to(torch.int64).contiguous()
        self.vocab_size, self.kv_caches, self.block_size = vocab_size, kv_caches, block_size
        self._planned: tuple | None = None  # (the plans it was made from, ctypes args, scratch)

    def _plans(self, lib, batch: int) -> tuple | None:
        stack = fused_decode._stack(self.head.layers, self.kv_caches)
        linears = (self.head.fc.small_batch_plan(), self.lm_head.small_batch_plan())
        if stack is None or batch > stack.max_rows or any(p is None for p in linears) or any(
                batch > (linear_mod.SMALL_BATCH_BF16 if p[3] else linear_mod.SMALL_BATCH) for p in linears):
            return None
        made, embed = self._planned, self.embed.weight
        if made is not None and made[0][0] is stack and made[0][1] is embed and all(
                a is b for a, b in zip(made[0][2:], linears)):
            return made[1], made[2]
        structs, caches, _ = stack.arrays
        fc = fused_decode._linear_plan(self.head.fc, linears[0])
        lm = fused_decode._linear_plan(self.lm_head, linears[1])
        scratch = torch.empty(lib.tandem_eagle_draft_scratch(structs, len(stack.planned), self.lm_head.weight.shape[0]))
        static = (embed, self.head.rotary.cos, self.head.rotary.sin, *self.kv_caches)
        args = (structs, ctypes.byref(fc), ctypes.byref(lm), caches, fc, lm,
                all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in static))
        self._planned = ((stack, embed, *linears), args, scratch)
        return args, scratch

    def draft(self, tokens: list[int], states: torch.Tensor, start_pos: list[int], tables: list[list[int]],
              steps: int, penalties: tuple[list[float], torch.Tensor] | None = None,
              pads: list[int] | None = None) -> list[list[int]] | None:
        """`steps` greedy drafts for each of B requests: a first pass over Q = len(tokens) // B rows each (row
        q of request b feeds tokens[b * Q + q] with states[b * Q + q] at position start_pos[b] + q), then
        single-token passes; None where the C loop does not apply. penalties: each request's repetition
        penalty and a uint8 [B, vocab_size] mark of the logit columns it applies to (its tokens so far;
        the C loop marks each draft), so drafts follow the penalized argmax that verification takes. pads: how
        many of each request's first-pass rows are padding (positions its head computed: attended, not written).
        Called every step at batch 1, so its arguments go as ctypes arrays (torch.tensor: ~5 us each) and
        what does not change between calls is kept with the plans."""
        lib = native_cpu.library()
        batch = len(start_pos)
        rows = len(tokens)
        if (lib is None or not 0 < batch <= rows <= MAX_ROWS or rows % batch or steps < 1 or not fused.ALLOWED
                or linear_mod._choice == "torch" or states.dtype != torch.float32 or not states.is_cpu
                or not states.is_contiguous()):
            return None
        planned = self._plans(lib, rows)
        if planned is None:
            return None
        (structs, fc, lm, caches, _, _, applies), scratch = planned
        if not applies:  # the embedding, rotary tables or caches are not fp32, contiguous, on the CPU
            return None
        width = max(map(len, tables))
        flat = tables[0] if batch == 1 else [b for t in tables for b in t + [0] * (width - len(t))]
        table = (ctypes.c_int32 * len(flat))(*flat)
        drafts = (ctypes.c_int64 * (batch * steps))()
        if penalties is not None:
            rep = torch.tensor(penalties[0], dtype=torch.float32)
            if penalties[1].shape != (batch, self.vocab_size) or penalties[1].dtype != torch.uint8:
                raise ValueError(f"penalty marks {tuple(penalties[1].shape)} for {batch} x {self.vocab_size} columns")
        rotary, embed = self.head.rotary, self.embed.weight
        rc = lib.tandem_eagle_draft_f32(
            structs, len(structs), fc, lm, self.vocab_size, embed.data_ptr(),
            embed.shape[0], rotary.cos.data_ptr(), rotary.sin.data_ptr(), rotary.cos.shape[0], caches,
            self.kv_caches[0].shape[0], self.block_size, table, width, batch, rows // batch,
            (ctypes.c_int64 * rows)(*tokens), states.data_ptr(), (ctypes.c_int64 * batch)(*start_pos),
            None if pads is None else (ctypes.c_int32 * batch)(*pads), steps,
            None if self.draft_ids is None else self.draft_ids.data_ptr(),
            None if penalties is None else rep.data_ptr(), None if penalties is None else penalties[1].data_ptr(),
            drafts, scratch.data_ptr(), torch.get_num_threads())
        # A refusal comes before its pass writes anything; the Python passes then redo them all (writing the
        # earlier passes' K/V again, identically) and meet the same problem with their own error.
        return [drafts[b * steps:(b + 1) * steps] for b in range(batch)] if rc == 0 else None
