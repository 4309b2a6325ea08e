"""Per-request event timestamps a worker keeps for its `trace` request (layer-wise transfer checks,
debugging a slow request). CLOCK_MONOTONIC ns, so processes on one host can be compared."""

from __future__ import annotations

import time

MAX_TRACED_REQUESTS = 10000


class Traces:
    def __init__(self, limit: int = MAX_TRACED_REQUESTS) -> None:
        self.limit = limit
        self.events: dict[str, dict[str, int]] = {}

    def record(self, rid: str, event: str, ns: int | None = None) -> None:
        """Keep the first time `event` happened to `rid`; bounded to the newest `limit` requests."""
        if rid not in self.events and len(self.events) >= self.limit:
            self.events.pop(next(iter(self.events)))
        self.events.setdefault(rid, {}).setdefault(event, ns if ns is not None else time.monotonic_ns())

    def get(self, rid: str) -> dict[str, int]:
        return self.events.get(rid, {})
