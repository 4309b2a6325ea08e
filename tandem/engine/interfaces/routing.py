"""The routing-policy interface: which live worker gets a request. The router keeps one policy for
decode workers and one for prefill workers (`--decode-policy`, `--prefill-policy`).

A policy is a class built with no arguments whose `choose(workers, request)` returns one of
`workers` (never empty). Built-ins are in plugins/routing.py; third-party policies register through
the `tandem_routing_policies()` plugin hook. Standard library only: the router imports this and must
not pull in torch or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from tandem.protocol.prefix_hash import prefix_key

__all__ = ["RouteRequest", "RoutingPolicy", "WorkerView", "prefix_key"]


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


class RoutingPolicy:
    name = "base"

    def choose(self, workers: Sequence[WorkerView], request: RouteRequest) -> WorkerView:
        raise NotImplementedError
