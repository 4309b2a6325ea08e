"""Beam groups in the engine: the hypotheses of one beam search as sequences in the paged KV cache,
sharing their blocks by reference count.

1. The prompt enters the scheduler as one ordinary request, the group's root (prefix cache, chunked
   prefill, a seat, a decode worker's remote KV all apply). When its prompt is computed, its logits
   row is taken before the scheduler would sample from it, and the root leaves the scheduler: the
   group owns it from then on as its first hypothesis.
2. Every step, before the scheduler runs, each group's live hypotheses get blocks for the tokens
   they are behind (one, normally) and ride in the same batch as everything else. A group that
   cannot get them all is preempted whole: every block is dropped and each hypothesis recomputes
   later from its prefix-cache hit (the prompt and shared full blocks come back by hash).
3. After the step, the hypotheses' log-softmaxed rows go to the selection rule
   (tandem/engine/beam_search.py). A hypothesis continued once keeps its sequence; each further
   continuation of it is a fork: a new sequence whose block list references the parent's full blocks
   (ref count + 1) and a fresh copy of the partial tail block (copy-on-write: one index copy per
   layer for all of the step's forks). Hypotheses not continued release their blocks.
4. When the search ends, the live hypotheses' blocks are freed and one RequestOutput carries the
   `beam_width` best hypotheses, best first.

The block pool's invariant holds throughout: a block's ref count = the live sequences listing it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.engine.beam_search import BeamSearch
from tandem.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import ScheduledRequest, Scheduler
from tandem.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class BeamGroup:
    root: Request
    search: BeamSearch
    beams: list[Request] = field(default_factory=list)  # live hypotheses, best first; [] while the root prefills
    cum_logprobs: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.root.request_id


class BeamGroups:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, kv_caches: Callable[[], list[torch.Tensor]],
                 decode: Callable[[list[int]], str]) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.kv_caches = kv_caches  # every per-layer tensor whose blocks a fork copies (K/V and any scales)
        self.decode = decode
        self.groups: dict[str, BeamGroup] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_forks = 0
        self.starved = False

    def add(self, root: Request, search: BeamSearch) -> None:
        self.groups[root.request_id] = BeamGroup(root, search)

    # ---- before the step -------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledRequest]:
        """Blocks for every live hypothesis of every decoding group (a group gets all or none).
        `starved` is set when a group is left without: the engine then admits no new request, so
        the blocks that running requests free come to the group (as a preempted request goes back
        to the head of the waiting queue)."""
        rows = []
        self.starved = False
        for g in self.groups.values():
            if not g.beams:
                continue
            if self._allocate(g):
                rows += [ScheduledRequest(r, r.num_tokens - r.num_computed_tokens) for r in g.beams]
            else:
                self.starved = True
        return rows

    def _allocate(self, g: BeamGroup) -> bool:
        for r in g.beams:
            cached = self.kv.find_cached_prefix(r) if not r.block_ids else []
            new = r.num_tokens - r.num_computed_tokens - len(cached) * self.kv.block_size
            if not self.kv.allocate(r, new, cached):
                self._drop_blocks(g)
                self.num_preemptions += 1
                return False
            r.num_computed_tokens += len(cached) * self.kv.block_size
        return True

    def _drop_blocks(self, g: BeamGroup) -> None:
        """Preempt the group: each hypothesis keeps its tokens and recomputes them later."""
        for r in g.beams:
            self.kv.free(r)
            r.num_computed_tokens = 0

    def num_computing(self) -> int:
        return sum(len(g.beams) for g in self.groups.values())

    # ---- after the step --------------------------------------------------------------------------
    def take_roots(self, sampled: dict[str, list[int]]) -> list[BeamGroup]:
        """Roots whose prompt is now computed: their sampled token is removed, so the scheduler
        advances them without appending anything."""
        ready = [g for rid, g in self.groups.items() if not g.beams and rid in sampled]
        for g in ready:
            del sampled[g.request_id]
        return ready

    def advance(self, rows: list[ScheduledRequest], roots: list[BeamGroup],
                logits: dict[str, torch.Tensor]) -> list[RequestOutput]:
        """The step ran: select each group's next hypotheses; the outputs of groups that ended."""
        for s in rows:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed_blocks(s.request)
        ran = {id(s.request) for s in rows}  # a group ran all its hypotheses or none (schedule)
        groups = [g for g in self.groups.values() if g.beams and id(g.beams[0]) in ran]
        for g in roots:  # the scheduler advanced the root; from now on it is the group's
            self.scheduler.running.remove(g.root)
            self.scheduler.requests.pop(g.request_id, None)
            g.beams, g.cum_logprobs = [g.root], [0.0]
        groups += roots
        copies: list[tuple[int, int]] = []
        outputs = []
        for g in groups:
            rows_logp = torch.log_softmax(torch.cat([logits[r.request_id][-1:] for r in g.beams]).float(), dim=-1)
            nexts = g.search.step([r.output_token_ids for r in g.beams], g.cum_logprobs, rows_logp)
            if g.search.done:
                outputs.append(self._finish(g))
                continue
            self._continue(g, nexts, copies)
        self._copy_blocks(copies)
        return outputs

    def _continue(self, g: BeamGroup, nexts, copies: list[tuple[int, int]]) -> None:
        parents, used = g.beams, set()
        kept: list[Request | None] = []
        for c in nexts:  # the first continuation of a parent keeps its sequence
            kept.append(None if c.parent in used else parents[c.parent])
            used.add(c.parent)
        for i, r in enumerate(parents):  # blocks of hypotheses not continued go first: room for the forks
            if i not in used:
                self.kv.free(r)
        tails = sum(1 for c, k in zip(nexts, kept) if k is None and parents[c.parent].num_tokens % self.kv.block_size)
        room = tails <= self.kv.pool.num_free
        beams = [k if k is not None else self._fork(g, parents[c.parent], copies, room) for c, k in zip(nexts, kept)]
        for r, c in zip(beams, nexts):
            r.token_ids.append(c.token)
        g.beams, g.cum_logprobs = beams, [c.cum_logprob for c in nexts]
        if not room:  # no block for a tail copy: the whole group recomputes later
            self._drop_blocks(g)
            self.num_preemptions += 1

    def _fork(self, g: BeamGroup, parent: Request, copies: list[tuple[int, int]], with_kv: bool) -> Request:
        """A new sequence with the parent's tokens: full blocks shared, the partial tail copied."""
        child = Request(f"{g.request_id}#{next(self._ids)}", parent.prompt_token_ids, parent.params,
                        parent.eos_token_ids, parent.max_tokens)
        child.token_ids = list(parent.token_ids)
        child.status = RequestStatus.RUNNING
        self.num_forks += 1
        if not with_kv:
            return child
        bs, n = self.kv.block_size, parent.num_computed_tokens
        full = n // bs
        child.block_ids = parent.block_ids[:full]
        self.kv.pool.share([b for b in child.block_ids if b != NULL_BLOCK])  # released behind a window: none
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        if n % bs:
            tail = self.kv.pool.allocate(1)[0]
            copies.append((parent.block_ids[full], tail))
            child.block_ids.append(tail)
        child.num_computed_tokens = n
        return child

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        for cache in self.kv_caches():
            cache[dst.to(cache.device)] = cache[src.to(cache.device)]

    def _finish(self, g: BeamGroup, reason: str | None = None) -> RequestOutput:
        for r in g.beams:
            self.kv.free(r)
            r.status = RequestStatus.FINISHED
        del self.groups[g.request_id]
        root = g.root
        if reason is not None:  # aborted: nothing is returned
            outs = [CompletionOutput("", [], reason)]
        else:
            outs = []
            for h in g.search.finished:
                text_ids = h.token_ids[:-1] if h.stop_reason is not None else h.token_ids
                outs.append(CompletionOutput(self.decode(text_ids), h.token_ids, h.finish_reason, h.stop_reason,
                                             cumulative_logprob=h.cum_logprob))
        return RequestOutput(root.request_id, root.prompt_token_ids, outs, True, max(root.num_cached_tokens, 0))

    def abort(self, request_id: str) -> RequestOutput | None:
        g = self.groups.get(request_id)
        if g is None:
            return None
        if not g.beams:  # still the scheduler's
            del self.groups[request_id]
            return None
        return self._finish(g, "abort")

    def live_requests(self) -> list[Request]:
        return [r for g in self.groups.values() for r in g.beams]
