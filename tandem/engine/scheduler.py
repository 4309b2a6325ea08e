"""Scheduler: continuous batching under one rule — every step, each runnable request gets a token
budget to bring `num_computed_tokens` up to `num_tokens` (plus any speculated tokens).

Running requests go first (they are mostly one token behind); when blocks run out the newest
running request is preempted (its blocks freed, recomputed later). Waiting requests are admitted
FCFS (priority first) with their cached prefix, chunked to the remaining budget, while fewer than
`max_num_seqs` hold a seat.

Remote KV (the KV connector's scheduler half, tandem/engine/kv_connector.py) is the same queue and
the same checks: when a waiting request is admitted and the connector says its uncached prompt will
come from a peer, it gets blocks for the whole prompt and a seat, and waits in `remote`
(WAITING_FOR_REMOTE_KV) without using the token budget; when the KV has arrived it joins `running`
with its prompt computed (or, if the transfer failed, computes the prompt itself). A request that
ends while a peer may still write its blocks keeps them in `held` until the connector releases them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_connector import KVConnector
from tandem.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, speculated tokens included
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step catches the request up, so its last rows' logits are sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens + len(self.spec_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]
    num_tokens: int

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_chunked_prefill: bool = True, connector: KVConnector | None = None) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked = enable_chunked_prefill
        self.connector = connector if connector is not None else KVConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV: blocks and a seat, KV in flight
        self.held: dict[str, Request] = {}  # finished, blocks kept until the connector releases them
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.reserved_seats = 0

    # ---- admission -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        # Lower value = more urgent; stable among equals (FCFS). The common case appends.
        if not self.waiting or self.waiting[-1].priority <= req.priority:
            self.waiting.append(req)
        else:
            idx = next(i for i, r in enumerate(self.waiting) if r.priority > req.priority)
            self.waiting.insert(idx, req)

    def remote_kv_arrived(self, request_id: str, first_token: int) -> bool:
        """The prompt's KV is in this worker's blocks; the prefill worker sampled `first_token`.
        Returns True if that token already finished the request."""
        req = self.remote.pop(request_id)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.append_token(first_token):
            self.finish(req)
            return True
        return False

    def compute_locally(self, request_id: str) -> Request:
        """The transfer failed: the request computes the rest itself (it keeps its seat, its blocks
        and its cached prefix; blocks past the prefix are simply recomputed)."""
        req = self.remote.pop(request_id)
        if self.kv.first_held_block(req, req.num_computed_tokens // self.kv.block_size) > \
                req.num_computed_tokens // self.kv.block_size:
            # Under a sliding window it holds only the window's blocks of a prompt it must now
            # compute: it starts over (as after a preemption, which also computes locally).
            self._preempt(req)
            return req
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def release(self, request_id: str) -> None:
        """The connector says nothing writes into a held request's blocks any more."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, reserved_tokens: int = 0, reserved_seats: int = 0) -> SchedulerOutput:
        """`reserved_*`: taken this step by sequences outside the scheduler (beam groups' hypotheses)."""
        budget = self.max_num_batched_tokens - reserved_tokens
        self.reserved_seats = reserved_seats
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            spec = req.spec_token_ids
            num_new = min(req.num_tokens + len(spec) - req.num_computed_tokens, budget)
            if num_new < req.num_tokens + len(spec) - req.num_computed_tokens:
                spec = []  # never verify a partial speculation
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, num_new, list(spec)))
                budget -= num_new
                i += 1
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - reserved_tokens - budget)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        while self.waiting and len(self.running) + len(self.remote) + self.reserved_seats < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            n_cached = len(cached) * self.kv.block_size
            remaining = req.num_tokens - n_cached
            # Asked once: a preempted request recomputes here rather than fetch its KV again.
            external = self.connector.num_external_tokens(req, n_cached) if req.num_preemptions == 0 else 0
            if external > 0:  # blocks for the whole prompt now; no budget: nothing is computed here
                if not self.kv.allocate(req, remaining, cached, computed_elsewhere=True):
                    break
                self.waiting.popleft()
                req.num_computed_tokens = req.num_cached_tokens = n_cached
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.remote[req.request_id] = req
                self.connector.on_allocated(req, n_cached)
                continue
            if budget <= 0 or (not self.chunked and remaining > budget):
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate(req, num_new, cached):
                break
            self.waiting.popleft()
            req.num_computed_tokens = n_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return budget

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran --------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests. `sampled[id]` holds the
        accepted speculated tokens followed by one new token. Returns the requests that changed."""
        changed = []
        for s in out.scheduled:
            req = s.request
            if req.finished:  # aborted while the step ran
                continue
            tokens = sampled.get(req.request_id)
            rejected = len(s.spec_token_ids) - (len(tokens) - 1) if tokens else 0
            req.num_computed_tokens += s.num_new_tokens - rejected
            req.spec_token_ids = []
            self.kv.cache_computed_blocks(req)
            if not tokens:
                continue  # a prefill chunk that has not caught up yet
            for t in tokens:
                if req.append_token(t):
                    self.finish(req)
                    break
            changed.append(req)
        return changed

    def finish(self, req: Request, reason: str | None = None) -> None:
        if req.finished:
            return
        if reason is not None:
            req.finish_reason = reason
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.remote.pop(req.request_id, None)
        hold = self.connector.hold_blocks(req)  # a peer may still write (or read) its blocks
        req.status = RequestStatus.FINISHED
        if hold:
            self.held[req.request_id] = req
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def live_requests(self) -> list[Request]:
        """Every request that holds blocks (held ones included)."""
        return [*self.requests.values(), *self.held.values()]
