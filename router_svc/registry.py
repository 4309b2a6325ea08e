"""The worker registry: which decode (D) and prefill (P) workers are alive, and their load.

Alive, slow and hung are three things:
1. A worker's Registrar sends `register(worker_id, role, control_address, model, interval_ms)` to
   the router's listen socket, then `heartbeat(worker_id, stats)` every interval from a thread its
   engine loop cannot block. A heartbeat from an unknown worker_id is answered with `error`, which
   makes the Registrar register again (so a restarted router re-learns its workers within one interval).
2. Dead: `expire()` removes a registered worker that has been silent for `misses` x its interval
   (~1.5 s by default: a killed, crashed or SIGSTOPped process) and returns it, so the router can
   retry or fail its requests. A worker that re-registers later is simply a new entry.
3. Slow: each heartbeat carries `loop_age_s`, how long ago the worker's engine loop last came round.
   A live worker whose loop is stalled is load, not failure: `Worker.stalled` makes the router
   prefer others for new requests, and its streams are left alone.
4. Hung: alive but with no loop progress for `hung_timeout_s` (default 60 s, sized for a long
   prefill of a real model). `expire()` returns it like a dead one (its requests are retried or
   failed) and keeps it, marked hung and not routable; it comes back when its loop moves again.
5. Checked at the door: a registration is refused, with a message naming the worker, when its
   worker_id is in use by another live worker (at another address), or when the router cannot
   reach the control address it advertises (no `stats_reply` within REACH_TIMEOUT_S: a wrong
   `--advertise`, a firewall), or when its KV cache layout (sent by workers with a KV connector)
   differs from a live worker's of the other role — a P/D pair that could not transfer KV, e.g.
   one side with `--speculator eagle` (hidden-state layers) and one without. Until that reply it is
   registered but not routable. The refused worker's Registrar keeps asking, so it gets in once the
   conflict is gone.
6. Static workers (`--decode ADDR`, `--prefill ADDR`) never register: the router polls them with
   `stats`, and a `stats_reply` is their heartbeat. A static worker is down until its first reply;
   a silent one is marked down again, not forgotten, and comes back with its next reply. (Their
   replies come from the engine loop, so a long step can mark one down: register workers instead.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from router_svc import metrics

log = structlog.get_logger(__name__)

ROLES = ("decode", "prefill")
REACH_TIMEOUT_S = 5.0  # a registering worker must answer over its advertised control address within this
REFUSAL_LOG_EVERY_S = 10.0  # a refused worker asks again each interval: log each refusal this often
STALLED_S = 2.0  # a loop this late is "slow": the router prefers other workers for new requests


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
    hung: bool = False  # alive, but its engine loop made no progress for the hung timeout
    stats: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0  # requests routed here and not finished (prefill: not started yet)
    identity: bytes = b""  # its registration connection: heartbeats must come from it
    unverified_since: float | None = None  # registered, its control address has not answered yet
    kv_layout: dict[str, Any] | None = None  # its KV CacheLayout, where it transfers KV
    kv_address: str | None = None  # a decode worker's KV receiver (prefill workers are told when it is lost)

    def loop_age_s(self, now: float | None = None) -> float:
        """How long ago the engine loop last came round, as of now (0 for workers that do not say)."""
        reported = self.stats.get("loop_age_s")
        if not isinstance(reported, (int, float)):
            return 0.0
        return float(reported) + ((time.monotonic() if now is None else now) - self.last_seen)

    @property
    def stalled(self) -> bool:
        return self.loop_age_s() > STALLED_S

    def describe(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "role": self.role, "address": self.address, "kv_address": self.kv_address,
                "static": self.static,
                "alive": self.alive, "hung": self.hung, "reachable": self.unverified_since is None,
                "loop_age_s": round(self.loop_age_s(), 3),
                "inflight": self.inflight, "seconds_since_seen": round(time.monotonic() - self.last_seen, 3),
                "stats": self.stats}


class Registry:
    def __init__(self, static_timeout_s: float = 3.0, misses: float = 3.0, hung_timeout_s: float = 60.0) -> None:
        self.workers: dict[str, Worker] = {}
        self.static_timeout_s = static_timeout_s
        self.misses = misses
        self.hung_timeout_s = hung_timeout_s
        self._refusals_logged: dict[tuple[str, str], float] = {}

    # ---- membership ----------------------------------------------------------------------------
    def add_static(self, role: str, address: str) -> Worker:
        # Down until its first stats_reply: a request must not wait on a worker never heard from.
        worker = Worker(worker_id=address, role=role, address=address, static=True,
                        interval_s=self.static_timeout_s / self.misses, alive=False)
        self.workers[worker.worker_id] = worker
        self._update_gauges()
        return worker

    def handle(self, msg: dict[str, Any], identity: bytes = b"") -> tuple[str | None, Worker | None]:
        """Apply a `register`/`heartbeat` that came over registration connection `identity`. Returns
        (error text to answer with or None, a worker the router must treat as lost because this
        registration replaced it, or None)."""
        kind, wid = msg["type"], msg.get("worker_id")
        if kind == "register":
            return self._register(msg, identity)
        if kind == "deregister":  # a clean exit (after draining): gone now, not lost
            worker = self.workers.get(wid) if isinstance(wid, str) else None
            if worker is None or worker.static:
                return None, None
            del self.workers[worker.worker_id]
            log.info("worker deregistered", worker_id=wid, role=worker.role)
            self._update_gauges()
            return None, worker  # anything still routed to it moves on
        if kind == "heartbeat":
            worker = self.workers.get(wid) if isinstance(wid, str) else None
            if worker is None or worker.static:
                return f"unknown worker_id {wid!r}: send register first", None
            if worker.identity and identity and identity != worker.identity:
                # another process with the same id (refused, or about to be), or this one reconnected:
                # registering again sorts out which
                return f"worker_id {wid!r} is registered over another connection: register again", None
            worker.stats, worker.last_seen = msg["stats"], time.monotonic()
            if worker.hung and worker.loop_age_s() < self.hung_timeout_s:
                worker.hung, worker.alive = False, True
                log.warning("hung worker is making progress again", worker_id=wid, role=worker.role)
                self._update_gauges()
            return None, None
        return f"the router's listen socket does not accept {kind!r}", None

    def _register(self, msg: dict[str, Any], identity: bytes) -> tuple[str | None, Worker | None]:
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
        now = time.monotonic()
        if old is not None and old.address != address and now - old.last_seen < self.misses * old.interval_s:
            # a restarted worker at a new address waits here until its old self has expired (~2 s)
            return self._refuse(wid, address, "duplicate_id",
                                f"register: worker_id {wid!r} is in use by a live {old.role} worker at {old.address} "
                                f"(this one advertises {address}); give each worker its own --worker-id"), None
        clash = self._layout_clash(wid, role, msg.get("kv_layout"))
        if clash is not None:
            return self._refuse(wid, address, "kv_layout", clash), None
        replaced = old if old is not None and (old.address != address or old.role != role) else None
        if old is not None and replaced is None:
            old.interval_s, old.last_seen, old.identity = msg["interval_ms"] / 1000, now, identity
            old.kv_address = msg.get("kv_address")
            old.alive, old.hung = old.unverified_since is None, False
            return None, None
        self.workers[wid] = Worker(worker_id=wid, role=role, address=address, model=msg["model"], alive=False,
                                   interval_s=msg["interval_ms"] / 1000, identity=identity, unverified_since=now,
                                   kv_layout=msg.get("kv_layout"), kv_address=msg.get("kv_address"))
        log.info("worker registering: waiting for its control address to answer", worker_id=wid, role=role,
                 address=address, model=msg["model"])
        self._update_gauges()
        return None, replaced

    def _layout_clash(self, wid: str, role: str, layout: dict[str, Any] | None) -> str | None:
        """Any D may be sent any P's KV: a worker whose KV cache layout differs from a live worker's of
        the other role (another --speculator eagle, --kv-cache-dtype or --block-size) is refused."""
        if layout is None:
            return None
        for other in self.workers.values():
            if other.role == role or other.kv_layout is None or not other.alive or other.worker_id == wid:
                continue
            diffs = [f"{k}: this={layout.get(k)!r} {other.worker_id}={other.kv_layout.get(k)!r}"
                     for k in sorted(layout.keys() | other.kv_layout.keys()) if layout.get(k) != other.kv_layout.get(k)]
            if diffs:
                return (f"register: this {role} worker's KV cache layout differs from {other.role} worker "
                        f"{other.worker_id!r}'s ({'; '.join(diffs)}); prefill and decode workers must agree on "
                        "--speculator (eagle keeps hidden-state layers), --kv-cache-dtype and --block-size")
        return None

    def unverified(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.unverified_since is not None]

    def unreachable(self, now: float | None = None) -> list[tuple[Worker, str]]:
        """Registered workers whose control address never answered: removed, each with the refusal."""
        now = time.monotonic() if now is None else now
        refused = []
        for worker in self.unverified():
            assert worker.unverified_since is not None
            if now - worker.unverified_since > REACH_TIMEOUT_S:
                del self.workers[worker.worker_id]
                refused.append((worker, self._refuse(
                    worker.worker_id, worker.address, "unreachable",
                    f"register: worker {worker.worker_id!r} advertises control address {worker.address}, which the "
                    f"router cannot reach (no answer in {REACH_TIMEOUT_S:.0f} s); check --advertise / --listen and "
                    "the network between them")))
        return refused

    def _refuse(self, wid: str, address: str, reason: str, message: str) -> str:
        metrics.REGISTRATIONS_REFUSED.labels(reason).inc()
        now, key = time.monotonic(), (wid, address)
        if now - self._refusals_logged.get(key, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            self._refusals_logged[key] = now
            log.warning("registration refused", worker_id=wid, address=address, reason=reason, message=message)
        return message

    def on_stats_reply(self, address: str, stats: dict[str, Any]) -> None:
        """A static worker answered our poll, or a registering one proved its control address works
        (later registered workers' replies just refresh stats)."""
        for worker in self.workers.values():
            if worker.address == address:
                worker.stats, worker.last_seen = stats, time.monotonic()
                if worker.unverified_since is not None:
                    worker.unverified_since, worker.alive = None, True
                    log.info("worker registered", worker_id=worker.worker_id, role=worker.role, address=address)
                    self._update_gauges()
                if worker.static and not worker.alive:
                    worker.alive = True
                    log.info("static worker is up", worker_id=worker.worker_id, role=worker.role)
                    self._update_gauges()

    def expire(self, now: float | None = None) -> list[Worker]:
        """Workers that just died (silent too long: removed, or marked down if static) or hung (kept,
        marked hung). The router retries or fails their requests."""
        now = time.monotonic() if now is None else now
        lost = []
        for worker in list(self.workers.values()):
            silent = now - worker.last_seen
            if not worker.alive:
                if worker.hung and silent > self.misses * worker.interval_s:
                    del self.workers[worker.worker_id]  # a hung worker that died: its requests went already
                continue
            if silent > self.misses * worker.interval_s:
                worker.alive = False
                if not worker.static:
                    del self.workers[worker.worker_id]
                metrics.WORKERS_LOST.labels(worker.role).inc()
                log.warning("worker missed its heartbeats", worker_id=worker.worker_id, role=worker.role,
                            silent_s=round(silent, 2), static=worker.static)
                lost.append(worker)
            elif worker.loop_age_s(now) > self.hung_timeout_s:
                worker.alive, worker.hung = False, True
                metrics.WORKERS_HUNG.labels(worker.role).inc()
                log.warning("worker is hung: alive, but its engine loop made no progress", worker_id=worker.worker_id,
                            role=worker.role, loop_age_s=round(worker.loop_age_s(now), 1),
                            hung_timeout_s=self.hung_timeout_s)
                lost.append(worker)
        if lost:
            self._update_gauges()
        return lost

    # ---- queries --------------------------------------------------------------------------------
    def live(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.alive]

    def routable(self, role: str) -> list[Worker]:
        """Live workers for new requests: not draining, and not stalled unless every one is (a slow
        worker still beats none)."""
        live = [w for w in self.live(role) if not w.stats.get("draining")]
        return [w for w in live if not w.stalled] or live

    def statics(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.static]

    def describe(self) -> list[dict[str, Any]]:
        return [w.describe() for w in sorted(self.workers.values(), key=lambda w: (w.role, w.worker_id))]

    def _update_gauges(self) -> None:
        for role in ROLES:
            metrics.WORKERS.labels(role).set(len(self.live(role)))
