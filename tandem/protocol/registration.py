"""Registrar: how a worker announces itself to a router and keeps itself listed.

A worker owns one Registrar and calls `tick(stats_fn)` from its loop every iteration (cheap: a clock
read and a non-blocking drain). Every `interval_s` it sends `heartbeat(worker_id, stats)`; the first
tick (and any tick after the router said it does not know us, e.g. because the router restarted)
sends `register(worker_id, role, control_address, model, interval_ms)` first. The router drops a
worker that misses about three heartbeats, so a worker whose loop stalls longer than that is treated
as gone — its not-yet-started requests go elsewhere.

`control_address` may be set after construction (a worker that binds `tcp://host:0` learns its
port only after binding); nothing is sent before the first tick.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import structlog
import zmq

from tandem.protocol import messages
from tandem.protocol.channel import dealer_socket
from tandem.protocol.messages import ProtocolError

log = structlog.get_logger(__name__)

ROLES = ("decode", "prefill")


class Registrar:
    def __init__(self, ctx: zmq.Context, router_address: str, worker_id: str, role: str,
                 control_address: str | None, model: str, interval_s: float = 1.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.router_address = router_address
        self.worker_id = worker_id
        self.role = role
        self.control_address = control_address
        self.model = model
        self.interval_s = interval_s
        # A router that is down must not make heartbeats pile up: a few queued frames are plenty,
        # a stale heartbeat is worth nothing.
        self.sock = dealer_socket(ctx, router_address, send_hwm=16)
        self._registered = False
        self._next_beat = 0.0
        self.heartbeats_sent = 0

    def tick(self, stats_fn: Callable[[], dict[str, Any]]) -> None:
        """Call once per worker-loop iteration; sends at most one heartbeat per interval."""
        self._drain_replies()
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.interval_s
        if self.control_address is None:
            return  # not bound yet
        if not self._registered:
            self._registered = self._send("register", worker_id=self.worker_id, role=self.role,
                                          control_address=self.control_address, model=self.model,
                                          interval_ms=max(1, round(self.interval_s * 1000)))
            if self._registered:
                log.info("registering with router", router=self.router_address, worker_id=self.worker_id,
                         role=self.role, address=self.control_address)
        if self._send("heartbeat", worker_id=self.worker_id, stats=self._stats(stats_fn)):
            self.heartbeats_sent += 1

    def _stats(self, stats_fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        # The heartbeat says "alive"; a bug in the stats must not stop it, let alone the worker loop.
        try:
            stats = stats_fn()
            messages.encode("heartbeat", worker_id=self.worker_id, stats=stats)  # msgpack-able?
            return stats
        except Exception as exc:
            log.warning("worker stats failed; heartbeat sent without them", error=repr(exc))
            return {}

    def _send(self, msg_type: str, **fields: Any) -> bool:
        try:
            self.sock.send(messages.encode(msg_type, **fields), zmq.NOBLOCK)
            return True
        except zmq.Again:  # router unreachable and the queue is full: try again next interval
            return False

    def _drain_replies(self) -> None:
        """The router only answers to say it does not know us: register again on the next beat."""
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = messages.decode(frame)
            except ProtocolError as exc:
                log.warning("bad message from router", error=str(exc))
                continue
            if msg["type"] == "error":
                log.info("router asked us to register again", message=msg["message"])
                self._registered = False
                self._next_beat = 0.0

    def close(self) -> None:
        self.sock.close(0)
