"""Built-in routing policies. The router keeps one policy for decode workers and one for prefill
workers (`--decode-policy`, `--prefill-policy`); the interface (`RoutingPolicy`, `RouteRequest`,
`WorkerView`) is `tandem.engine.interfaces.routing`, re-exported here under the old names together
with `prefix_key` (tandem/protocol/prefix_hash.py). Standard library only, like the interface: the
router imports this without torch.

- round_robin      rotate over the live workers.
- least_loaded     fewest queued requests (the worker's last heartbeat — queue depth lags by up to
                   one heartbeat — plus what this router sent it and has not finished), then lowest
                   KV-cache usage.
- prefix_affinity  requests whose first blocks are equal go to the same worker, so its prefix cache
                   hits: rendezvous hashing of the request's prefix key over the live workers (a
                   worker joining or leaving moves only its own share), with a load bound so one
                   hot prefix cannot pile everything onto one worker.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

from tandem.engine.interfaces.routing import RouteRequest, RoutingPolicy, WorkerView
from tandem.protocol.prefix_hash import prefix_key

__all__ = ["ROUTING_POLICIES", "LeastLoaded", "PrefixAffinity", "RoundRobin", "RouteRequest", "RoutingPolicy",
           "WorkerView", "prefix_key", "queued", "resolve_policy"]


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[WorkerView], request: RouteRequest) -> WorkerView:
        # Sort so the rotation does not depend on registration order or dict iteration.
        ordered = sorted(workers, key=lambda w: w.worker_id)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return worker


def queued(worker: WorkerView) -> int:
    s = worker.stats
    return int(s.get("waiting", 0)) + int(s.get("waiting_for_kv", 0))


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def __init__(self) -> None:
        self._tiebreak = 0

    def choose(self, workers: Sequence[WorkerView], request: RouteRequest) -> WorkerView:
        self._tiebreak += 1
        n = len(workers)

        def score(item: tuple[int, WorkerView]) -> tuple[int, float, int]:
            i, w = item
            # Ties (e.g. an idle cluster) rotate instead of always landing on the first worker.
            return queued(w) + w.inflight, float(w.stats.get("kv_usage", 0.0)), (i + self._tiebreak) % n

        return min(enumerate(sorted(workers, key=lambda w: w.worker_id)), key=score)[1]


class PrefixAffinity(RoutingPolicy):
    """Rendezvous (highest-random-weight) hashing with bounded load: walk the workers in the
    request's hash order and take the first whose in-flight count is within `load_factor` times
    the fair share; the preferred worker is skipped only while it is clearly busier than the rest."""

    name = "prefix_affinity"
    load_factor = 2.0
    min_slack = 4  # a small cluster at low load never spills: spilling costs a prefix-cache miss

    def choose(self, workers: Sequence[WorkerView], request: RouteRequest) -> WorkerView:
        ranked = sorted(workers, key=lambda w: _weight(request.prefix_key, w.worker_id), reverse=True)
        total = sum(w.inflight for w in workers)
        bound = max(math.ceil(self.load_factor * (total + 1) / len(workers)), self.min_slack)
        for w in ranked:
            if w.inflight < bound:
                return w
        return min(ranked, key=lambda w: w.inflight)


def _weight(key: bytes, worker_id: str) -> bytes:
    return hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PrefixAffinity.name: PrefixAffinity,
}


def resolve_policy(name: str) -> RoutingPolicy:
    """A fresh policy instance (built-ins + third-party); see tandem.engine.strategies."""
    from tandem.engine.strategies import resolve_routing_policy

    return resolve_routing_policy(name)
