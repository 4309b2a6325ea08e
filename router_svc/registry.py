"""The worker registry: which decode (D) and prefill (P) workers are alive, and their load.

1. A worker's Registrar sends `register(worker_id, role, control_address, model, interval_ms)` to
   the router's listen socket, then `heartbeat(worker_id, stats)` every interval.
2. A heartbeat from an unknown worker_id is answered with `error`, which makes the Registrar
   register again (so a restarted router re-learns its workers within one interval).
3. `expire()` removes a registered worker that has been silent for `misses` x its interval and
   returns it, so the router can retry or fail its requests. A worker that re-registers later is
   simply a new entry.
4. Static workers (`--decode ADDR`, `--prefill ADDR`) never register: the router polls them with
   `stats`, and a `stats_reply` is their heartbeat. A static worker is down until its first reply;
   a silent one is marked down again, not forgotten, and comes back with its next reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from router_svc import metrics

log = structlog.get_logger(__name__)

ROLES = ("decode", "prefill")


@dataclass(slots=True)
class Worker:
    worker_id: str
    role: str
    address: str  # control (ROUTER) address: where the router / D sends requests
    model: str = ""
    static: bool = False
    interval_s: float = 1.0
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    stats: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0  # requests routed here and not finished (prefill: not started yet)

    def describe(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "role": self.role, "address": self.address, "static": self.static,
                "alive": self.alive, "inflight": self.inflight, "seconds_since_seen": round(time.monotonic() - self.last_seen, 3),
                "stats": self.stats}


class Registry:
    def __init__(self, static_timeout_s: float = 3.0, misses: float = 3.0) -> None:
        self.workers: dict[str, Worker] = {}
        self.static_timeout_s = static_timeout_s
        self.misses = misses

    # ---- membership ----------------------------------------------------------------------------
    def add_static(self, role: str, address: str) -> Worker:
        # Down until its first stats_reply: a request must not wait on a worker never heard from.
        worker = Worker(worker_id=address, role=role, address=address, static=True,
                        interval_s=self.static_timeout_s / self.misses, alive=False)
        self.workers[worker.worker_id] = worker
        self._update_gauges()
        return worker

    def handle(self, msg: dict[str, Any]) -> tuple[str | None, Worker | None]:
        """Apply a `register`/`heartbeat`. Returns (error text to answer with or None, a worker the
        router must treat as lost because this registration replaced it, or None)."""
        kind, wid = msg["type"], msg.get("worker_id")
        if kind == "register":
            return self._register(msg)
        if kind == "heartbeat":
            worker = self.workers.get(wid)
            if worker is None or worker.static:
                return f"unknown worker_id {wid!r}: send register first", None
            worker.stats, worker.last_seen = msg["stats"], time.monotonic()
            return None, None
        return f"the router's listen socket does not accept {kind!r}", None

    def _register(self, msg: dict[str, Any]) -> tuple[str | None, Worker | None]:
        wid, role, address = msg["worker_id"], msg["role"], msg["control_address"]
        if role not in ROLES:
            return f"register: role must be one of {ROLES}, got {role!r}", None
        if not wid or not address:
            return "register: worker_id and control_address must be non-empty", None
        if msg["interval_ms"] < 1:
            return f"register: interval_ms must be >= 1, got {msg['interval_ms']}", None
        old = self.workers.get(wid)
        if old is not None and old.static:
            return f"register: worker_id {wid!r} names a static worker", None
        replaced = old if old is not None and (old.address != address or old.role != role) else None
        if old is not None and replaced is None:
            old.interval_s, old.last_seen, old.alive = msg["interval_ms"] / 1000, time.monotonic(), True
            return None, None
        self.workers[wid] = Worker(worker_id=wid, role=role, address=address, model=msg["model"],
                                   interval_s=msg["interval_ms"] / 1000)
        log.info("worker registered", worker_id=wid, role=role, address=address, model=msg["model"])
        self._update_gauges()
        return None, replaced

    def on_stats_reply(self, address: str, stats: dict[str, Any]) -> None:
        """A static worker answered our poll (registered workers' replies just refresh stats)."""
        for worker in self.workers.values():
            if worker.address == address:
                worker.stats, worker.last_seen = stats, time.monotonic()
                if worker.static and not worker.alive:
                    worker.alive = True
                    log.info("static worker is up", worker_id=worker.worker_id, role=worker.role)
                    self._update_gauges()

    def expire(self, now: float | None = None) -> list[Worker]:
        """Workers that just went silent for too long: removed (registered) or marked down (static)."""
        now = time.monotonic() if now is None else now
        lost = []
        for worker in list(self.workers.values()):
            if not worker.alive or now - worker.last_seen <= self.misses * worker.interval_s:
                continue
            worker.alive = False
            if not worker.static:
                del self.workers[worker.worker_id]
            metrics.WORKERS_LOST.labels(worker.role).inc()
            log.warning("worker missed its heartbeats", worker_id=worker.worker_id, role=worker.role,
                        silent_s=round(now - worker.last_seen, 2), static=worker.static)
            lost.append(worker)
        if lost:
            self._update_gauges()
        return lost

    # ---- queries --------------------------------------------------------------------------------
    def live(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.alive]

    def statics(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.static]

    def describe(self) -> list[dict[str, Any]]:
        return [w.describe() for w in sorted(self.workers.values(), key=lambda w: (w.role, w.worker_id))]

    def _update_gauges(self) -> None:
        for role in ROLES:
            metrics.WORKERS.labels(role).set(len(self.live(role)))
