"""Registrar: how a worker announces itself to a router and proves, apart from its engine loop, that
it is alive.

Alive, busy and hung are three different things, so they travel separately:
- **Liveness** comes from a thread of its own (`liveness`), which the engine loop cannot block: every
  `interval_s` it sends `heartbeat(worker_id, stats)` on its own socket. A long engine step (a big
  prefill chunk on CPU, a first-use Triton compile) does not stop it; only the process stopping
  (killed, crashed, SIGSTOPped) does, and the router notices that within a few intervals.
- **Progress** is what the engine loop reports by calling `tick(stats_fn)` once per iteration: the
  time of its last iteration and, at most once per interval, a fresh snapshot of its stats. The
  heartbeat carries the snapshot plus `loop_age_s` (seconds since the loop last came round) and
  `loops` (iterations so far). The router treats a high `loop_age_s` as load — fewer new requests —
  and only one above its hung timeout as a hung worker.

The first heartbeat (and any after the router said it does not know us, e.g. because the router
restarted) is preceded by `register(worker_id, role, control_address, model, interval_ms)`. A
draining worker says so in its heartbeats (`draining`: the router routes nothing new to it), and a
worker that closes cleanly sends `deregister(worker_id)`: it leaves at once, not counted as lost.
`control_address` may be set after construction (a worker that binds `tcp://host:0` learns its port
only after binding); the thread starts on the loop's first tick, when it is known.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import structlog
import zmq

from tandem.protocol import messages, security
from tandem.protocol.channel import dealer_socket
from tandem.protocol.messages import ProtocolError

log = structlog.get_logger(__name__)

ROLES = ("decode", "prefill")
DEFAULT_INTERVAL_S = 0.5  # the router declares a worker dead after 3 silent intervals: ~1.5 s
REFUSAL_LOG_EVERY_S = 10.0  # a refused worker asks again each interval; say so in its log this often


class Registrar:
    def __init__(self, ctx: zmq.Context, router_address: str, worker_id: str, role: str,
                 control_address: str | None, model: str, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.ctx = ctx
        self.router_address = router_address
        self.worker_id = worker_id
        self.role = role
        self.control_address = control_address
        self.model = model
        self.kv_layout: dict[str, Any] | None = None  # set where the worker transfers KV: the router checks pairs
        self.kv_address: str | None = None  # a decode worker's KV receiver (the router tells P when D is lost)
        self.interval_s = interval_s
        self.heartbeats_sent = 0
        self.draining = False  # set on SIGTERM: heartbeats tell the router to route nothing new here
        self.extra_stats: dict[str, Any] = {}  # constant facts sent with every heartbeat (e.g. switchable)
        self._refusal, self._refused_at = "", -REFUSAL_LOG_EVERY_S  # the router's last refusal: logged this often
        self._new_role: str | None = None  # a role switch: deregister, then register in this role
        # Written by the engine loop, read by the liveness thread: single reference assignments.
        self._snapshot: dict[str, Any] = {}
        self._last_loop = time.monotonic()
        self._loops = 0
        self._next_snapshot = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the engine loop's side ------------------------------------------------------------------
    def tick(self, stats_fn: Callable[[], dict[str, Any]]) -> None:
        """Call once per engine-loop iteration: records progress; cheap except once per interval."""
        now = time.monotonic()
        self._last_loop = now
        self._loops += 1
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.interval_s
            self._snapshot = self._stats(stats_fn)
        if self._thread is None and self.control_address is not None:
            self._thread = threading.Thread(target=self._liveness, name="liveness", daemon=True)
            self._thread.start()

    def _stats(self, stats_fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        # A bug in the stats must not stop the heartbeat, let alone the worker loop.
        try:
            stats = stats_fn()
            messages.encode("heartbeat", worker_id=self.worker_id, stats=stats)  # msgpack-able?
            return stats
        except Exception as exc:
            log.warning("worker stats failed; heartbeat sent without them", error=repr(exc))
            return {}

    # ---- the liveness thread ---------------------------------------------------------------------
    def _liveness(self) -> None:
        # A router that is down must not make heartbeats pile up: a few queued frames are plenty,
        # a stale heartbeat is worth nothing. The socket belongs to this thread alone.
        sock = dealer_socket(self.ctx, self.router_address, send_hwm=16)
        watch = security.HandshakeWatch(sock, self.router_address)
        registered = False
        try:
            while True:
                watch.check()
                registered = self._drain_replies(sock, registered)
                if self._new_role is not None:
                    if registered:
                        self._send(sock, "deregister", worker_id=self.worker_id)
                    self.role, self._new_role, registered, self.draining = self._new_role, None, False, False
                if not registered:
                    registered = self._send(sock, "register", worker_id=self.worker_id, role=self.role,
                                            control_address=self.control_address, model=self.model,
                                            interval_ms=max(1, round(self.interval_s * 1000)),
                                            kv_layout=self.kv_layout, kv_address=self.kv_address)
                    if registered and not self._refused_recently():  # asking again each interval: quietly
                        log.info("registering with router", router=self.router_address, worker_id=self.worker_id,
                                 role=self.role, address=self.control_address)
                stats = {**self._snapshot, **self.extra_stats, "loops": self._loops, "draining": self.draining,
                         "loop_age_s": round(time.monotonic() - self._last_loop, 3)}
                if self._send(sock, "heartbeat", worker_id=self.worker_id, stats=stats):
                    self.heartbeats_sent += 1
                if self._stop.wait(self.interval_s):
                    if registered:
                        self._send(sock, "deregister", worker_id=self.worker_id)
                        sock.setsockopt(zmq.LINGER, 500)  # let it go out before the socket closes
                    return
        except zmq.ContextTerminated:
            return
        finally:
            watch.close()
            sock.close(0)

    @staticmethod
    def _send(sock: zmq.Socket, msg_type: str, **fields: Any) -> bool:
        try:
            sock.send(messages.encode(msg_type, **fields), zmq.NOBLOCK)
            return True
        except zmq.Again:  # router unreachable and the queue is full: try again next interval
            return False

    def _drain_replies(self, sock: zmq.Socket, registered: bool) -> bool:
        """The router only answers to say it does not know us, or refuses us: then register again now."""
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return registered
            try:
                msg = messages.decode(frame)
            except ProtocolError as exc:
                log.warning("bad message from router", error=str(exc))
                continue
            if msg["type"] == "error":
                registered = False
                text, now = msg["message"], time.monotonic()
                if text.startswith("register:"):  # refused: we keep asking, the operator must act
                    if text != self._refusal or now - self._refused_at > REFUSAL_LOG_EVERY_S:
                        log.warning("router refused our registration", message=text)
                        self._refusal, self._refused_at = text, now
                elif not self._refused_recently():
                    log.info("router asked us to register again", message=text)

    def _refused_recently(self) -> bool:
        return time.monotonic() - self._refused_at < REFUSAL_LOG_EVERY_S

    def switch_role(self, role: str) -> None:
        """The worker now serves `role`: the liveness thread deregisters and registers again in it
        (and the heartbeats stop saying draining). A worker without a thread yet just registers so."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if self._thread is None:
            self.role, self.draining = role, False
        else:
            self._new_role = role

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval_s + 1)
