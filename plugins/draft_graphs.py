"""A speculator's greedy draft passes on a GPU as one CUDA graph (the GPU's counterpart of plugins/eagle_fused.py):
EAGLE's head (`eagle_chains`) and a draft model (`draft_model_chains`).

On a GPU each of a proposal's k passes ran eagerly from Python: some 35 kernel launches and a host read of its
argmax each (an H200, shipped model, k = 4: EAGLE at 0.45x of plain decoding while accepting 3.3 tokens a step,
draft_model at 0.12x; docs/PERFORMANCE.md "Session 42 (GPU)"). For greedy requests nothing between the passes
needs the host: pass j feeds pass j-1's argmax (mapped from a draft vocabulary to target ids) — with, for EAGLE,
its output state — at the next position, whose cache slot the graph reads off the request's block table in the
drafter's cache. So the whole chain — the first pass over Q rows a request, then k-1 passes of one row, each
through the logits and an argmax — is captured at start once per (padded batch size, Q, k) and replayed: the
host copies the inputs into static buffers (three copies from pinned memory) and reads the k drafts back once.
Padding requests write no K/V (slot -1) and attend block 0, as tandem/engine/cuda_graphs.py's do; a ragged
batch's padding rows (plugins/draft_model.padded) are slots -1 too. `capture=False` runs the same buffers
eagerly: the CPU tests check the chains' drafts and K/V against the Python passes that way. A capture the driver
refuses turns the graphs off with a warning; the Python passes then run, as before, as they do for sampled
requests and repetition penalties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from tandem.engine.cuda_graphs import SIZES, record
from tandem.engine.decode_group import MAX_DECODE_QUERY_LEN
from tandem.layers.attention import AttentionMetadata

log = structlog.get_logger(__name__)
MAX_SIZE = 16  # padded batch sizes up to this: speculation runs at small batch (spec_max_batch)


@dataclass
class _Chain:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (capture=False)
    drafts: torch.Tensor | None  # the graph's output, [size, k] target ids


class DraftGraphs:
    def __init__(self, step, logits, draft_ids: torch.Tensor | None, width: int, ops, kv_caches: list[torch.Tensor],
                 block_size: int, max_blocks: int, device: torch.device, states: tuple[int, torch.dtype] | None,
                 capture: bool = True, name: str = "eagle") -> None:
        """step(ids, states, positions, meta): the drafter's output rows [T, H] (an EAGLE head's predicted target
        states, fed to the next pass as its states; a draft model's hidden states, which ignores them); logits:
        its logits of such rows, over `width` columns at least, whose target ids are draft_ids (None: the columns
        are target ids); kv_caches: the drafter's paged caches; states: the width and dtype of the states a first
        pass feeds (None: none)."""
        self.step, self.logits, self.ops, self.kv_caches, self.name = step, logits, ops, kv_caches, name
        self.draft_ids = None if draft_ids is None else draft_ids.to(device=device, dtype=torch.long)
        self.width, self.block_size, self.capture = width, block_size, capture
        rows = MAX_SIZE * MAX_DECODE_QUERY_LEN
        self.rows, self.pinned = rows, device.type == "cuda"
        self._ids_pos_slots = torch.zeros(3 * rows, dtype=torch.long, device=device)  # one copy in a call
        self.ids, self.positions, self.slots = self._ids_pos_slots.view(3, rows).unbind()
        self.states = None if states is None else torch.zeros(rows, states[0], dtype=states[1], device=device)
        self.tables = torch.zeros(MAX_SIZE, max_blocks, dtype=torch.int32, device=device)
        self._lens_real = torch.ones(2 * MAX_SIZE, dtype=torch.int32, device=device)  # one copy in a call
        self.lens, self.real = self._lens_real.view(2, MAX_SIZE).unbind()  # real: 0 for a padding request
        self.chains: dict[tuple[int, int, int], _Chain] = {}
        self.pool = None
        self.replays = 0  # proposals drafted by a chain (tests read it)
        self.failed = False  # a capture failed: the Python passes run

    def capture_all(self, k: int, batch: int, max_q: int | None = None) -> int:
        """Capture at start every chain a proposal of up to k drafts takes — 1 to k drafts (fewer near a request's
        max_tokens), first passes of 1 to max_q rows (default k + 1: EAGLE's accepted drafts and one more; a
        draft model's: 2), up to `batch` requests — so that no proposal waits for a capture (tandem/engine/
        warm_up.py's rule for the target's graphs; captured at first use, the bench's timed decoding had paid for
        6). How many there are."""
        start, largest = time.perf_counter(), next((s for s in SIZES if s >= batch), MAX_SIZE)
        with torch.inference_mode():
            for size in (s for s in SIZES if s <= min(largest, MAX_SIZE)):
                for steps in range(1, k + 1):
                    for q in range(1, (max_q or k + 1) + 1):
                        if not self.failed and (size, q, steps) not in self.chains:
                            self._capture(size, q, steps)
        log.info("draft graphs captured", drafter=self.name, chains=len(self.chains), failed=self.failed,
                 seconds=round(time.perf_counter() - start, 3))
        return len(self.chains)

    def draft(self, tokens: list[int], states: torch.Tensor | None, start_pos: list[int], tables: list[list[int]],
              steps: int, pads: list[int] | None = None) -> list[list[int]] | None:
        """`steps` greedy drafts for each of B requests, as FusedDrafter.draft takes them (a first pass of Q =
        len(tokens) // B rows each, row q of request b feeding tokens[b * Q + q] with states[b * Q + q] at
        position start_pos[b] + q, its first pads[b] rows padding: attended, not written); None where no chain
        applies (the caller runs the Python passes)."""
        b, q = len(start_pos), len(tokens) // len(start_pos)
        size, bs = next((s for s in SIZES if s >= b), MAX_SIZE + 1), self.block_size
        if (self.failed or size > MAX_SIZE or not 0 < q <= MAX_DECODE_QUERY_LEN or len(tokens) != b * q
                or steps < 1 or (states is None) != (self.states is None) or (states is not None and (
                    states.shape != (b * q, self.states.shape[1]) or states.dtype != self.states.dtype))
                or max(map(len, tables)) > self.tables.shape[1]
                or any(len(t) * bs < start + q + steps - 1 for t, start in zip(tables, start_pos))):
            return None  # (the last pass writes position start + q + steps - 2: its block must be the request's)
        self._copy_in(tokens, states, start_pos, tables, size, q, pads or [0] * b)
        chain = self.chains.get((size, q, steps)) or self._capture(size, q, steps)
        if chain is None:
            return None
        self.replays += 1
        if chain.graph is None:
            drafts = self._chain(size, q, steps)
        else:
            chain.graph.replay()
            drafts = chain.drafts
        return drafts[:b].tolist()

    def _copy_in(self, tokens: list[int], states: torch.Tensor | None, start_pos: list[int], tables: list[list[int]],
                 size: int, q: int, pads: list[int]) -> None:
        b, bs, pad = len(start_pos), self.block_size, (size - len(start_pos)) * q
        positions = [p for start in start_pos for p in range(start, start + q)]
        slots = [t[p // bs] * bs + p % bs if p >= start + skip else -1
                 for t, start, skip in zip(tables, start_pos, pads) for p in range(start, start + q)]
        gap = [0] * (self.rows - b * q - pad)
        flat = (tokens + [0] * pad + gap + positions + list(range(q)) * (size - b) + gap
                + slots + [-1] * (pad + len(gap)))
        self._ids_pos_slots.copy_(torch.tensor(flat, pin_memory=self.pinned), non_blocking=True)
        lens = [start + q for start in start_pos] + [q] * (MAX_SIZE - b)
        real = [1] * b + [0] * (MAX_SIZE - b)
        self._lens_real.copy_(torch.tensor(lens + real, dtype=torch.int32, pin_memory=self.pinned), non_blocking=True)
        if states is not None and self.states is not None:
            self.states[:b * q].copy_(states, non_blocking=True)
        width = max(map(len, tables))
        self.tables[:b, :width].copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                                   pin_memory=self.pinned), non_blocking=True)
        self.tables[b:size] = 0
        self.tables[:size, width:] = 0

    def _meta(self, slots: torch.Tensor, size: int, q: int, lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            ops=self.ops, kv_caches=self.kv_caches, kv_scales=None, slot_mapping=slots, num_decode_seqs=size,
            decode_query_len=q, decode_block_tables=self.tables[:size], decode_seq_lens=lens,
            prefill_block_tables=None, prefill_query_start_loc=None, prefill_seq_lens=None)

    def _argmax(self, state: torch.Tensor) -> torch.Tensor:
        best = self.logits(state)[:, :self.width].argmax(-1)  # the first maximum, as fused.argmax_rows
        return best if self.draft_ids is None else self.draft_ids[best]

    def _chain(self, size: int, q: int, steps: int) -> torch.Tensor:
        """The passes, from the static buffers only (what a graph captures): drafts [size, steps]."""
        n, bs = size * q, self.block_size
        state = self.step(self.ids[:n], None if self.states is None else self.states[:n], self.positions[:n],
                          self._meta(self.slots[:n], size, q, self.lens[:size]))
        state = state.view(size, q, -1)[:, -1]  # each request's last row (EAGLE: a predicted next target state)
        position = self.positions[:n].view(size, q)[:, -1]
        drafts = [self._argmax(state)]
        for _ in range(1, steps):
            position = position + 1
            block = self.tables[:size].gather(1, (position // bs).unsqueeze(1)).squeeze(1).long()
            slots = torch.where(self.real[:size].bool(), block * bs + position % bs, -1)
            state = self.step(drafts[-1], state, position, self._meta(slots, size, 1, (position + 1).to(torch.int32)))
            drafts.append(self._argmax(state))
        return torch.stack(drafts, 1)

    def _capture(self, size: int, q: int, steps: int) -> _Chain | None:
        """Capture with harmless inputs (no K/V written; every request attends Q tokens of block 0), then put
        back the call's own, already copied in. None (and `failed`) if the capture fails."""
        if not self.capture:
            self.chains[(size, q, steps)] = _Chain(None, None)
            return self.chains[(size, q, steps)]
        saved = [t.clone() for t in (self._ids_pos_slots, self._lens_real, self.tables)]
        self.slots.fill_(-1)
        self.lens.fill_(q)
        self.real.zero_()
        self.tables.zero_()
        try:
            graph, drafts = record(lambda: self._chain(size, q, steps), self.pool)
            self.pool = graph.pool()
            self.chains[(size, q, steps)] = _Chain(graph, drafts)
        except RuntimeError as exc:
            self.failed = True
            log.warning("draft graph capture failed: drafts run eagerly", drafter=self.name, batch=size, query_len=q,
                        steps=steps, error=str(exc)[:300])
            return None
        finally:
            for buf, value in zip((self._ids_pos_slots, self._lens_real, self.tables), saved):
                buf.copy_(value)
        return self.chains[(size, q, steps)]


def eagle_chains(runner, max_blocks: int, capture: bool = True) -> DraftGraphs:
    """The chains of an EagleRunner (plugins/eagle.py): its head over the target's embedding of each token and the
    state paired with it, logits through its lm_head (or its draft vocabulary's rows)."""
    width = runner.vocab_size if runner.draft_ids is None else len(runner.draft_ids)
    embed = runner.embed
    return DraftGraphs(lambda ids, states, positions, meta: runner.head(embed(ids), states, positions, meta),
                       runner.lm_head, runner.draft_ids, width, runner.ops, runner.kv_caches, runner.block_size,
                       max_blocks, runner.device, (embed.weight.shape[1], embed.weight.dtype), capture)


def draft_model_chains(runner, max_blocks: int, capture: bool = True) -> DraftGraphs:
    """The chains of a DraftModelRunner (plugins/draft_model.py): the draft model's forward and logits, no states."""
    model = runner.model
    return DraftGraphs(lambda ids, states, positions, meta: model(ids, positions, meta), model.compute_logits, None,
                       runner.vocab_size, runner.ops, runner.kv_caches, runner.block_size, max_blocks, runner.device,
                       None, capture, name="draft_model")
