"""The router's admin operations on its workers (off unless `--enable-admin`; behind --api-key):

- `GET  /admin/workers`: the registry (role, address, liveness, load, draining, switchable).
- `POST /admin/workers/{id}/drain`: the worker stops taking work, finishes what is in flight,
  deregisters and exits 0 (as on SIGTERM). Nothing in flight is dropped.
- `POST /admin/workers/{id}/role` `{"role": "prefill"|"decode"}`: the worker drains its current
  role and registers again in the other, without a restart, keeping its KV cache and prefix cache
  (tandem/cli/roles.py). The `--rebalance` policy (router_svc/rebalance.py) uses the same call.

Refused with the OpenAI error shape: an unknown worker (404), a bad body (400), a static worker, a
worker that cannot switch (its KV connector), one already draining or switching, the same role, or
the last worker of a role (409) — a drain or switch never leaves a role empty.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

from router_svc import metrics
from router_svc.errors import BadRequest, Conflict, NotFound
from router_svc.registry import ROLES, Registry, Worker

log = structlog.get_logger(__name__)


class Admin:
    def __init__(self, registry: Registry, send: Callable[..., None]) -> None:
        self.registry = registry
        self.send = send  # WorkerLinks.send(address, msg_type, **fields)

    def workers(self) -> dict[str, Any]:
        return {"object": "list", "data": self.registry.describe()}

    def drain(self, worker_id: str) -> dict[str, Any]:
        worker = self._movable(worker_id, "drain")
        self._send(worker, "drain")
        metrics.DRAINS.labels(worker.role).inc()
        log.info("admin: draining worker", worker_id=worker_id, role=worker.role)
        return {"worker_id": worker_id, "role": worker.role, "status": "draining"}

    def set_role(self, worker_id: str, body: Any, by: str = "admin") -> dict[str, Any]:
        role = body.get("role") if isinstance(body, dict) else None
        if role not in ROLES:
            raise BadRequest(f"role must be one of {list(ROLES)}, got {role!r}", param="role")
        worker = self._movable(worker_id, f"switch to {role}")
        if worker.role == role:
            raise Conflict(f"worker {worker_id!r} already serves the {role} role")
        if not worker.stats.get("switchable"):
            raise Conflict(f"worker {worker_id!r} cannot switch roles (needs --kv-connector zmq; see docs/PLANNING.md)")
        self._send(worker, "set_role", role=role)
        metrics.ROLE_CHANGES.labels(worker.role, role, by).inc()
        log.info("worker asked to switch roles", worker_id=worker_id, from_role=worker.role, to_role=role, by=by)
        return {"worker_id": worker_id, "from": worker.role, "to": role, "status": "switching"}

    def _movable(self, worker_id: str, what: str) -> Worker:
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            raise NotFound(f"no worker {worker_id!r} (GET /admin/workers lists them)", param="worker_id")
        if worker.static:
            raise Conflict(f"worker {worker_id!r} is static (--decode/--prefill): the router cannot {what} it")
        if not worker.alive or worker.stats.get("draining"):
            raise Conflict(f"worker {worker_id!r} is {'draining' if worker.alive else 'not live'}: cannot {what} it")
        others = [w for w in self.registry.routable(worker.role) if w is not worker and not w.stats.get("draining")]
        if not others:
            raise Conflict(f"worker {worker_id!r} is the last routable {worker.role} worker: cannot {what} it")
        return worker

    def _send(self, worker: Worker, msg_type: str, **fields: Any) -> None:
        try:
            self.send(worker.address, msg_type, **fields)
        except ConnectionError as exc:
            raise Conflict(f"worker {worker.worker_id!r} is not reachable: {exc}") from None
        # Route nothing new to it from now on, not from its next heartbeat on.
        worker.stats = {**worker.stats, "draining": True}
