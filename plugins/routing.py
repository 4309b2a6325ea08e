"""Routing policies: which live worker gets a request. The router keeps one policy for decode
workers and one for prefill workers (`--decode-policy`, `--prefill-policy`).

A policy is a class built with no arguments whose `choose(workers, request)` returns one of
`workers` (never empty). Third-party policies register through the `tandem_routing_policies()`
plugin hook and follow the same interface; this module imports nothing from the services so a
plugin can subclass `RoutingPolicy` cheaply.

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
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from tandem.engine.block_pool import hash_block_tokens


class WorkerView(Protocol):
    """What a policy may look at (router_svc.registry.Worker satisfies it)."""

    worker_id: str
    address: str
    stats: dict[str, Any]  # the worker's last heartbeat / stats_reply
    inflight: int  # requests this router routed to it that have not finished (prefill: not started)


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    token_ids: list[int]
    prefix_key: bytes  # see prefix_key(); equal for requests sharing their first blocks
    extra: dict[str, Any] = field(default_factory=dict)


def prefix_key(token_ids: Sequence[int], block_size: int, num_blocks: int) -> bytes:
    """The chained hash of the first `num_blocks` full blocks (the same chain the workers' prefix
    caches use), or of the whole prompt when it has no full block."""
    n_full = min(len(token_ids) // block_size, num_blocks)
    if n_full == 0:
        return hash_block_tokens(None, token_ids)
    h: bytes | None = None
    for i in range(n_full):
        h = hash_block_tokens(h, token_ids[i * block_size:(i + 1) * block_size])
    assert h is not None
    return h


class RoutingPolicy:
    name = "base"

    def choose(self, workers: Sequence[WorkerView], request: RouteRequest) -> WorkerView:
        raise NotImplementedError


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
    """A fresh policy instance; names come from the plugin registry (built-ins + third-party)."""
    try:
        from plugins.registry import resolve_routing_policy
    except ImportError:  # plugin system not importable: the built-ins still work
        if name not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; available: {', '.join(sorted(ROUTING_POLICIES))}")
        return ROUTING_POLICIES[name]()
    return resolve_routing_policy(name)()
