"""Structured outputs in a step: which rows get their grammar's mask before the forward, and each plain row's
token after it (the ModelRunner's two calls; the grammar states and masks are tandem/engine/structured.py's).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kernels import fused
from tandem.engine import sampler, structured
from tandem.engine.structured import GrammarState


def start_masks(sample_rows: list[tuple[Any, int, int]], num_rows: int) -> tuple[Any, Any]:
    """Structured outputs: (a future of (rows among the plain ones, their allowed-token masks), for
    the rows masked before sampling (top-k / top-p / min-p, or a model that keeps fighting its
    grammar: GrammarState.masks_first), or None; the argmax masks, or None). The others are checked
    after (`tokens`). On a GPU llguidance computes them on its own threads, without the GIL,
    while the forward pass runs; on a CPU, here and now (structured.py: the forward's threads hold every
    core) — and a CPU's greedy rows get theirs here too, for the forward's C call to take each row's
    argmax under (AttentionMetadata.argmax_masks: `num_rows` addresses)."""
    first, greedy, states, i = [], [], [], 0  # i: the index among the plain rows (no draft tokens)
    for s, row, _ in sample_rows:
        if s.spec_token_ids:
            continue
        r, state = s.request, s.request.grammar
        if state is not None:
            state.sync(r.token_ids, r.num_prompt_tokens)
            if state.masks_first(r.params):
                first.append(i)
                states.append(state)
            elif r.params.greedy:  # on a CPU: its mask for the forward's C argmax (a GPU's: masks_first)
                greedy.append((state, row))
        i += 1
    masks = argmax_masks(greedy, num_rows) if greedy else None
    return (first, states[0].grammars.allowed_batch_async(states)) if first else None, masks


def tokens(reqs: list[Any], rows: torch.Tensor, masked: list[int], sample: Any, generator: torch.Generator,
           premasked: torch.Tensor | None = None, argmax: list[int] | None = None) -> list[int]:
    """Tokens for the plain rows `rows` (one per request of `reqs`; the rows `masked` were masked
    before sampling). A greedy row under a grammar takes its masked argmax (greedy_tokens:
    the forward's own, `argmax`, where it had the masks, `premasked`, else one pass); other
    rows sample (`sample(row indices)`), and a temperature row under a grammar keeps its token if the
    grammar allows it (consuming it). The rest are drawn again from their masked row. Exact: for
    sampling, P(x) = p(x) + (1 - Z) p(x) / Z = p(x) / Z for an allowed x (Z = the allowed mass): the
    masked, renormalised distribution. A model that mostly follows its grammar then costs a check per
    sampled row instead of a mask."""
    greedy, others, drawn = [], [], []  # drawn: sampled rows under a grammar, checked after
    for i, r in enumerate(reqs):
        if r.grammar is None or i in masked:
            others.append(i)
        elif r.params.greedy:
            greedy.append(i)
        else:
            others.append(i)
            drawn.append(i)
    chosen: list[int] = [0] * len(reqs)
    for i, token in zip(others, sample(others) if others else ()):
        chosen[i] = token
    if greedy:
        states = [reqs[i].grammar for i in greedy]
        for i, token in zip(greedy, greedy_tokens(rows, greedy, states, argmax if premasked is not None else None,
                                                  premasked)):
            chosen[i] = token
    refused = [i for i in drawn if not reqs[i].grammar.take(chosen[i])]
    for i in drawn:
        reqs[i].grammar.record(i in refused)
    if not refused:
        return chosen
    states = [reqs[i].grammar for i in refused]
    words = states[0].grammars.allowed_batch_async(states, inline=True).result()
    masked_rows = rows[refused]  # a copy: `rows` may be the step's logits, kept raw for logprobs
    structured.mask_rows(masked_rows, words, states[0].vocab_size)
    again = sampler.sample(masked_rows, [reqs[i].params for i in refused],
                           [reqs[i].generator for i in refused], generator)
    for i, token in zip(refused, again):
        chosen[i] = token
    return chosen


def argmax_masks(rows: list[tuple[GrammarState, int]], num_rows: int) -> tuple[Any, int, torch.Tensor]:
    """Each grammar's mask, made now into the reused buffer (`words`, row i rows[i]'s), for a CPU step's C
    call to take the argmax of the step's row rows[i][1] under rows[i][0]'s mask: (the table for
    AttentionMetadata.argmax_masks, an address per row of the step, 0 for the rows without; words a mask;
    words). Made before the forward: after it, with the interpreter's and llguidance's data evicted by the
    weight streams, a mask cost ~15-20 us and the masked argmax's call from Python ~45 us more (shipped
    model, batch 1); before it ~10 us."""
    grammars = rows[0][0].grammars
    words = grammars.mask_buffer(len(rows))
    address, nbytes = words.data_ptr(), grammars.mask_words * 4
    table = (ctypes.c_void_p * num_rows)()
    for i, (state, row) in enumerate(rows):
        state.matcher.unsafe_compute_mask_ptr(address + i * nbytes, nbytes)
        table[row] = address + i * nbytes
    return table, grammars.mask_words, words


def greedy_tokens(rows: torch.Tensor, picked: list[int], states: list[GrammarState], argmax: list[int] | None,
                  masks: torch.Tensor | None) -> list[int]:
    """The masked argmax of each of the greedy rows `picked` of `rows` (a CPU engine's), each consumed by its
    grammar now (not by the stop check's sync: the same llguidance call): the forward's own (`argmax`, one
    per row of `rows`, taken under argmax_masks' masks), else one pass under `masks` (argmax_masks' words,
    row i states[i]'s: the step did not take the forward's C call), else greedy_allowed's."""
    if argmax is not None:
        chosen = [argmax[i] for i in picked]
    elif masks is not None:
        chosen = [max(t, 0) for t in fused.masked_argmax(rows, picked, masks, states[0].vocab_size)]
    else:
        chosen = structured.greedy_allowed(rows, picked, states)
    for state, token in zip(states, chosen):
        state.take(token)
    return chosen
