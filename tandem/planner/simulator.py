"""Discrete-event simulator of a tandem cluster: router -> P queues -> KV transfer -> D batches, or colocated.

What it models, following the engine (docs/ARCHITECTURE.md, "One request, disaggregated"):
1. Arrival: the router picks the least-loaded D (in-flight requests) and, disaggregated, the least-loaded P
   (`local_if_busy`: a prompt that short stays on D when every P is busy, as router_svc/core.py does).
2. D seats it (at most `max_num_seqs` seats) at the start of its next step, or at once when idle; a prompt
   of at least `local_prefill_threshold` tokens goes to its P (the seat held while it waits), else D's.
3. P runs FCFS chunked prefill: each step takes up to the token budget from its seated requests in
   order; a step costs `CostModel.prefill_step`. When a prompt's last chunk ends, P samples the first
   token and the KV transfer finishes `exposed` seconds later (layer-by-layer sends overlap P's compute,
   so at least one layer's share is left).
4. D's step: requests whose KV arrived join (their first token is streamed at the step's start), local
   prefill chunks fill the budget left by the decodes, and every running request gains one token; a
   step costs `CostModel.mixed_step(batch, mean context, prefill tokens)`. Colocated workers are D
   workers that prefill everything themselves.
5. Optionally (`core_of`), workers sharing a CPU core (`tandem up` with more workers than cores) are
   processor-shared: while k are busy each step advances at 1/k speed, re-timed whenever one starts
   or stops (one step per event there). Real time-slicing loses more (docs/PLANNING.md).

Speed: one event per worker step, never per token. A running request is a (finishing step, id) entry in
its worker's heap, the batch's context a running sum: a step costs O(1) + the requests joining or leaving.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass

from tandem.planner.profile import CostModel
from tandem.planner.workload import Workload

PREFILL, DECODE, COLOCATED = "P", "D", "C"


class LeastLoaded:
    """The worker with the fewest requests in flight; ties go to the one idle longest (a rotation).
    A lazy heap: stale entries are skipped when they surface, so choosing is O(log N)."""

    def __init__(self, n: int) -> None:
        self.load = [0] * n
        self._seq = n
        self._heap = [(0, i, i) for i in range(n)]

    def choose(self) -> int:
        heap, load = self._heap, self.load
        while True:
            count, _, w = heap[0]
            if count == load[w]:
                return w
            heapq.heappop(heap)

    def change(self, w: int, delta: int) -> None:
        self.load[w] += delta
        self._seq += 1
        heapq.heappush(self._heap, (self.load[w], self._seq, w))


class Worker:
    __slots__ = ("kind", "idx", "waiting", "prefilling", "ready", "running", "batch", "ctx_sum", "k", "seats_used",
                 "busy", "chunks", "end_seq", "macro_start", "macro_dt", "macro_m", "core", "left", "since")

    def __init__(self, kind: str, idx: int) -> None:
        self.kind, self.idx = kind, idx
        self.waiting: deque[int] = deque()  # routed, no seat yet
        self.prefilling: deque[list] = deque()  # seated, prompt in progress: [id, tokens done, started_at]
        self.ready: list[int] = []  # KV arrived from P: join at the next step's start
        self.running: list[tuple[int, int]] = []  # heap of (step at whose end it finishes, id)
        self.batch = self.seats_used = 0
        self.ctx_sum = 0  # sum over running of (context at step 0's reckoning): context = ctx_sum/batch + k
        self.k = 0  # steps completed
        self.busy = False
        self.chunks: list[tuple[list, int]] = []  # this step's prefill chunks: (entry, tokens)
        # The step in flight: its end event's seq (a re-planned end makes older ones stale), and, for a
        # run of identical decode steps done as one event, where it started, each step's length, how many.
        self.end_seq, self.macro_m = 0, 1
        self.macro_start = self.macro_dt = 0.0
        self.core = -1  # workers with the same core >= 0 share one CPU core (-1: its own hardware)
        self.left = self.since = 0.0  # on a shared core: solo seconds left of this step, as of `since`


@dataclass(slots=True)
class SimResult:
    ttft_s: list[float]
    itl_s: list[float | None]  # mean gap after the first token; None for one-token answers
    duration_s: float  # arrival span of the workload
    wall_s: float  # how long the simulation took
    steps: int

    def met(self, ttft_slo: float, itl_slo: float) -> int:
        return sum(1 for t, i in zip(self.ttft_s, self.itl_s) if t <= ttft_slo and (i is None or i <= itl_slo))


class Simulator:
    def __init__(self, cost: CostModel, prefill_workers: int, decode_workers: int, colocated: bool = False,
                 local_prefill_threshold: int = 32, core_of: list[int] | None = None, local_if_busy: int = 0) -> None:
        if decode_workers < 1 or prefill_workers < 0 or (colocated and prefill_workers):
            raise ValueError(f"need >= 1 decode (or colocated) worker and no prefill worker when colocated, got "
                             f"{prefill_workers}P:{decode_workers}D{' colocated' if colocated else ''}")
        if not colocated and prefill_workers == 0:
            raise ValueError("a disaggregated split needs >= 1 prefill worker (or colocated=True)")
        self.cost = cost
        self.colocated = colocated
        self.threshold = 10**12 if colocated else local_prefill_threshold
        self.local_if_busy = local_if_busy
        self.p = [Worker(PREFILL, i) for i in range(prefill_workers)]
        self.d = [Worker(COLOCATED if colocated else DECODE, i) for i in range(decode_workers)]
        if core_of is not None:  # prefill workers first, then decode: tandem up's order
            if len(core_of) != prefill_workers + decode_workers:
                raise ValueError(f"core_of names {len(core_of)} workers, the split has "
                                 f"{prefill_workers + decode_workers}")
            for w, core in zip(self.p + self.d, core_of):
                w.core = core
        self.busy_on_core: dict[int, int] = {}
        self.mates: dict[int, list[Worker]] = {}
        for w in self.p + self.d:
            if w.core >= 0:
                self.mates.setdefault(w.core, []).append(w)

    def run(self, wl: Workload) -> SimResult:
        t_wall = time.perf_counter()
        n = len(wl)
        self.prompt, self.out = wl.prompt_tokens, wl.output_tokens
        self.first = [0.0] * n
        self.last = [0.0] * n
        self.p_of = [0] * n
        self.d_of = [0] * n
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind 0=D step end 1=P step end 2=kv, x)
        self.seq = 0
        self.steps = 0
        route_d, route_p = LeastLoaded(len(self.d)), LeastLoaded(len(self.p)) if self.p else None
        self.route_d, self.route_p = route_d, route_p
        events, arr = self.events, wl.arrival_s
        i = 0
        while i < n or events:
            if i < n and (not events or arr[i] <= events[0][0]):
                t = arr[i]
                w = route_d.choose()
                route_d.change(w, 1)
                self.d_of[i] = w
                if route_p is not None:  # p_of -1: D prefills it (conditional disaggregation)
                    p = route_p.choose()
                    self.p_of[i] = -1 if route_p.load[p] and self.prompt[i] <= self.local_if_busy else p
                    if self.p_of[i] >= 0:
                        route_p.change(p, 1)
                dw = self.d[w]
                dw.waiting.append(i)
                self._wake(dw, t)
                i += 1
                continue
            t, seq, kind, x = heapq.heappop(events)
            if kind == 0:
                if seq == self.d[x].end_seq:  # else stale: the run of steps was cut short
                    self._end(self.d[x], t)
            elif kind == 1:
                if seq == self.p[x].end_seq:  # else stale: re-timed by a core-mate's change
                    self._end(self.p[x], t)
            else:
                dw = self.d[self.d_of[x]]
                dw.ready.append(x)
                self._wake(dw, t)
        ttft = [f - a for f, a in zip(self.first, arr)]
        itl = [(la - f) / (o - 1) if o > 1 else None for f, la, o in zip(self.first, self.last, self.out)]
        return SimResult(ttft, itl, wl.duration_s, time.perf_counter() - t_wall, self.steps)

    def _push(self, t: float, kind: int, x: int) -> int:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, x))
        return self.seq

    def _wake(self, w: Worker, t: float) -> None:
        """New work for D at t: start a step if idle; inside a run of decode steps, end the run at the
        first step boundary after t, where the engine would next look at its queues."""
        if not w.busy:
            self._start(w, t)
        elif w.macro_m > 1:
            done = max(1, -int(-(t - w.macro_start) // w.macro_dt))  # steps finished by then (ceil)
            if done < w.macro_m:
                w.macro_m = done
                w.end_seq = self._push(w.macro_start + done * w.macro_dt, 0, w.idx)

    def _core_changed(self, w: Worker, delta: int, t: float) -> None:
        """w became busy (+1) or idle (-1) on its shared core: every busy core-mate's step so far ran at
        1/old of its speed, and from now on runs at 1/new; re-time its end."""
        old = self.busy_on_core.get(w.core, 0)
        new = self.busy_on_core[w.core] = old + delta
        for mate in self.mates[w.core]:
            if mate is not w and mate.busy:
                mate.left = max(0.0, mate.left - (t - mate.since) / old)
                mate.since = t
                mate.end_seq = self._push(t + mate.left * new, 1 if mate.kind == PREFILL else 0, mate.idx)

    def _join(self, w: Worker, i: int, step: int) -> None:
        """Request i decodes from `step` on, holding prompt + 1 tokens then; it needs out - 1 more tokens."""
        heapq.heappush(w.running, (step + self.out[i] - 2, i))
        w.batch += 1
        w.ctx_sum += self.prompt[i] + 1 - step

    def _finish(self, w: Worker, i: int, t: float) -> None:
        self.last[i] = t
        w.seats_used -= 1
        self.route_d.change(w.idx, -1)

    def _start(self, w: Worker, t: float) -> None:
        cost = self.cost
        for i in w.ready:  # the engine polls its connector before it schedules
            self.first[i] = t
            if self.out[i] == 1:
                self._finish(w, i, t)
            else:
                self._join(w, i, w.k)
        w.ready.clear()
        while w.waiting and w.seats_used < cost.seats:
            i = w.waiting.popleft()
            w.seats_used += 1
            if w.kind == DECODE and self.prompt[i] >= self.threshold and self.p_of[i] >= 0:
                pw = self.p[self.p_of[i]]  # D's connector sends `prefill` as it allocates the blocks
                pw.waiting.append(i)
                if not pw.busy:
                    self._start(pw, t)
            else:
                w.prefilling.append([i, 0, t])
        budget = cost.budget - w.batch
        tokens, attn = 0, 0.0
        chunks = w.chunks
        chunks.clear()
        for entry in w.prefilling:
            if budget <= 0:
                break
            take = min(budget, self.prompt[entry[0]] - entry[1])
            if entry[1] == 0:
                entry[2] = t
            chunks.append((entry, take))
            attn += take * entry[1]
            tokens += take
            budget -= take
        if not w.batch and not tokens:
            if w.busy:
                w.busy = False
                if w.core >= 0:
                    self._core_changed(w, -1, t)
            return
        if not w.busy and w.core >= 0:
            self._core_changed(w, +1, t)
        w.busy = True
        self.steps += 1
        ctx = w.ctx_sum / w.batch + w.k if w.batch else 0.0
        if tokens or w.core >= 0:  # one step at a time: a prefill chunk (seats free, and KV arrives, only
            # at finishes/_wake), or any step on a shared core (its speed changes with its core-mates')
            w.macro_m, dt = 1, cost.mixed_step(w.batch, ctx, tokens, attn)
        else:
            # Plain decode steps until the first request finishes: one event. The context grows by one a
            # step; step time is (piecewise) linear in it, so the middle step's time is the mean.
            m = w.running[0][0] - w.k + 1
            w.macro_m, dt = m, cost.decode_step(w.batch, ctx + (m - 1) / 2)
        end = t + w.macro_m * dt
        if w.core >= 0:
            w.left, w.since = dt, t
            end = t + dt * self.busy_on_core[w.core]
        w.macro_start, w.macro_dt = t, dt
        w.end_seq = self._push(end, 1 if w.kind == PREFILL else 0, w.idx)

    def _end(self, w: Worker, t: float) -> None:
        k = w.k + w.macro_m - 1  # the last step this event ends
        running = w.running
        while running and running[0][0] <= k:
            last, i = heapq.heappop(running)
            w.batch -= 1
            w.ctx_sum -= self.prompt[i] + 1 - (last - self.out[i] + 2)  # what _join added
            self._finish(w, i, t)
        for entry, take in w.chunks:
            entry[1] += take
            i = entry[0]
            if entry[1] < self.prompt[i]:
                continue
            w.prefilling.popleft()  # FCFS: only the head of the queue can finish first
            if w.kind == PREFILL:
                w.seats_used -= 1
                self.route_p.change(w.idx, -1)  # type: ignore[union-attr]
                self._push(t + self._exposed_transfer(i, t - entry[2]), 2, i)
            else:
                self.first[i] = t
                if self.out[i] == 1:
                    self._finish(w, i, t)
                else:
                    self._join(w, i, k + 1)
        w.chunks.clear()
        w.k = k + 1
        self._start(w, t)

    def _exposed_transfer(self, i: int, prefill_s: float) -> float:
        """The part of the KV transfer not hidden behind P's compute: layer l's blocks leave as soon as
        layer l is stored, so all but the last layer's share can overlap the prefill."""
        xfer = self.cost.transfer(self.prompt[i])
        if xfer == 0.0:
            return 0.0
        layers = self.cost.num_layers
        return max(xfer / layers, xfer - prefill_s * (layers - 1) / layers)

