"""One worker process, two roles: build a role's worker around an engine, and move a running worker
to the other role without a restart.

tandem's prefill and decode workers run the same engine; only the KV connector plugged into it and
the service around it differ. So a role switch (the router's `set_role`, from
`POST /admin/workers/{id}/role` or its `--rebalance` policy) is: drain the current role (the router
routes nothing new here; what is in flight finishes — `serve` in worker_common.py), close that
role's transport half (P: the KV sender; D: the receiver and peer links), build the other role's
around the same engine and control socket, and register again under the new role. The engine's
KV memory and its prefix cache are kept: a former prefill worker's cached prompts serve its first
decode requests.

A switch needs a transport whose halves can both use the engine's ordinary KV memory: zmq. (shm
allocates a decode worker's cache in shared memory at start-up; torch_dist pairs ranks at start-up;
a colocated decode worker has no transport at all.)
"""

from __future__ import annotations

import argparse
from typing import Any

import structlog

from tandem.observability.logging import bind_service

log = structlog.get_logger(__name__)

SWITCHABLE_CONNECTORS = ("zmq",)


def make_transport(args: argparse.Namespace) -> Any:
    """The KV connector named by --kv-connector (None for `none`: a colocated decode worker)."""
    from tandem.engine.strategies import resolve_connector

    if args.kv_connector == "none":
        return None
    return resolve_connector(args.kv_connector)(timeout_s=args.prefill_timeout)


def switchable(args: argparse.Namespace) -> bool:
    return args.kv_connector in SWITCHABLE_CONNECTORS


def build_worker(role: str, engine: Any, args: argparse.Namespace, listen: Any, transport: Any) -> Any:
    """A `role` worker around `engine`; `listen` is an address, or the ControlServer of the worker it replaces."""
    if role == "prefill":
        from prefill_svc.worker import PrefillWorker

        if transport is None:
            raise ValueError("a prefill worker needs a KV connector (zmq, shm or torch_dist)")
        return PrefillWorker(engine, listen, transport.make_sender(engine.kv_layout, engine.config.torch_device))
    from decode_svc.worker import DecodeWorker

    receiver = None
    if transport is not None:
        bind = args.kv_listen or same_host(args.listen)
        receiver = transport.make_receiver(engine.kv_layout, engine.runner.kv_caches, engine.runner.kv_scales, bind)
    return DecodeWorker(engine, listen, receiver, args.local_prefill_threshold, args.prefill_timeout)


def kv_address(worker: Any) -> str | None:
    """A decode worker's KV receiver address (what it registers), None for any other worker."""
    receiver = getattr(getattr(worker, "kv", None), "receiver", None)
    return getattr(receiver, "address", None)


def switch(old: Any, role: str, args: argparse.Namespace, transport: Any) -> Any:
    """Hand `old`'s engine, control socket, registration and metrics to a new `role` worker. `old` is idle."""
    old.release_role()
    if args.switch_cores is not None:  # the cores tandem up (or tandem launch's share) planned for this role
        move_cores(old.engine, args.switch_cores[role], role)
    if role == "decode":
        old.engine.ensure_speculator()  # a prefill worker has not built it
    new = build_worker(role, old.engine, args, old.server, transport)
    new.registrar, new.obs, new.traces = old.registrar, old.obs, old.traces
    new._trace = new.traces.record
    if hasattr(new.obs, "switch_role"):
        new.obs.switch_role(role, new.stats_dict)
    if new.registrar is not None:
        new.registrar.kv_address = kv_address(new)
        new.registrar.switch_role(role)
        bind_service(service=role, worker_id=new.registrar.worker_id)  # log lines name the new role
    log.info("role switched: serving as %s" % role, address=new.address,
             kv_blocks_used=new.engine.stats()["kv_blocks_used"])
    return new


def move_cores(engine: Any, cores: list[int], role: str) -> None:
    """Pin to `cores` for `role`; a mask the kernel refuses now (a cpuset changed under us) keeps the old
    one: a worker that cannot move still serves."""
    from tandem.cli import cpus
    from tandem.engine.thread_backoff import ThreadBackoff

    try:
        cpus.pin(cores)
    except OSError as exc:
        log.warning("kept its cpus after the role switch: %s" % exc, wanted=cpus.format_cpuset(cores))
        return
    engine.thread_backoff = ThreadBackoff()  # its full thread count is the new one
    log.info("moved to cpus %s for the %s role" % (cpus.format_cpuset(cores), role), threads=len(cores))


def same_host(address: str) -> str:
    """A free port on the control address's host (a decode worker's default KV receiver address)."""
    if address.startswith("tcp://"):
        return address.rsplit(":", 1)[0] + ":0"
    if address.startswith("ipc://"):
        return address + ".kv"
    return "tcp://127.0.0.1:0"
