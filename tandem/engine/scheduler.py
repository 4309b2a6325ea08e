"""Scheduler: continuous batching under one rule — every step, each runnable request gets a token
budget to bring `num_computed_tokens` up to `num_tokens` (plus any speculated tokens).

Running requests go first (they are mostly one token behind); when blocks run out the newest
running request is preempted (its blocks freed, recomputed later). Waiting requests are admitted
FCFS (priority first) with their cached prefix, chunked to the remaining budget. Requests waiting
for remote KV (decode role) hold their blocks and join `running` when the KV has arrived.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.engine.kv_cache_manager import KVCacheManager
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
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.priority and self.waiting:
            # Lower value = more urgent; stable among equals (FCFS).
            idx = next((i for i, r in enumerate(self.waiting) if r.priority > req.priority), len(self.waiting))
            self.waiting.insert(idx, req)
        else:
            self.waiting.append(req)

    def add_remote(self, req: Request) -> bool:
        """Decode role: allocate blocks for the whole prompt now (after the local prefix hit) and
        wait for the KV. Returns False if there is no room right now (caller may retry or compute locally)."""
        cached = self.kv.find_cached_prefix(req)
        n_cached = len(cached) * self.kv.block_size
        if not self.kv.allocate(req, req.num_tokens - n_cached, cached):
            return False
        req.num_computed_tokens, req.num_cached_tokens = n_cached, n_cached
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        return True

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
        """A request waiting for remote KV computes the rest itself (short uncached part, or the
        prefill peer failed). Its cached prefix stays; blocks past it are simply recomputed."""
        req = self.remote.pop(request_id)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
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
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            remaining = req.num_tokens - len(cached) * self.kv.block_size
            if not self.chunked and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate(req, num_new, cached):
                break
            self.waiting.popleft()
            req.num_computed_tokens = len(cached) * self.kv.block_size
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
        req.status = RequestStatus.FINISHED
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
        return list(self.requests.values())
