"""The worker commands (`tandem decode`, `tandem prefill`): their flags, start-up, and the serving
loop with its two ways out — drain and exit (SIGTERM or the router's `drain`), or drain and take the
other role (the router's `set_role`, tandem/cli/roles.py)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time

from tandem.cli.engine_args import add_engine_args, add_model_arg, engine_config_from_args, resolve_model
from tandem.cli.keys import add_link_args, apply_link_args
from tandem.observability.cli import add_observability_args, setup_logging
from tandem.observability.logging import bind_service


def add_worker_args(p: argparse.ArgumentParser, default_port: int) -> None:
    add_model_arg(p)
    p.add_argument("--listen", default=f"tcp://127.0.0.1:{default_port}",
                   help="ZMQ control address to bind (tcp://HOST:PORT or ipc://PATH; port 0 picks a free one)")
    p.add_argument("--kv-connector", default="zmq",
                   help="KV transfer connector: zmq | shm | torch_dist (see `tandem plugins`)")
    p.add_argument("--router", default=None, help="router's ZMQ registration address (register + heartbeat)")
    p.add_argument("--worker-id", default=None, help="name reported to the router (default: role-pid)")
    p.add_argument("--advertise", default=None, help="control address the router should use (default: the bound one)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to finish the requests in flight before exiting (0: stop at once)")
    # The decode role's flags: every worker takes them, since a worker can be switched to that role.
    p.add_argument("--kv-listen", default=None,
                   help="decode role: address the KV receiver binds (default: the control host, a free port)")
    p.add_argument("--local-prefill-threshold", type=int, default=32,
                   help="decode role: prefill here instead of remotely when fewer prompt tokens than this are "
                        "uncached")
    p.add_argument("--prefill-timeout", type=float, default=30.0,
                   help="decode role: seconds without KV progress before recomputing a prompt locally")
    p.add_argument("--cpus", default=None, metavar="CPUSET|i/n",
                   help="pin this worker to these cores and use one torch thread per core: a cpuset like 0-3,8, "
                        "or i/n for slice i of n of the affinity mask (i/n:p: the first p of the n are prefill "
                        "workers; default: every core the mask allows, capped by OMP_NUM_THREADS)")
    p.add_argument("--switch-cpus", default=None, metavar="CPUSET",
                   help="the cores to move to while this worker serves the other role after a role switch "
                        "(tandem up sets it where workers share cores, so a prefill and a decode worker never "
                        "share one; default: keep --cpus)")
    add_link_args(p)
    add_engine_args(p)
    add_observability_args(p, worker=True)  # --metrics-port, --log-level, --log-prompts


# ---- observability --------------------------------------------------------------------------------
def worker_id(args: argparse.Namespace, role: str) -> str:
    """The worker's name: reported to the router, a label of its metrics, bound in its logs."""
    return args.worker_id or f"{role}-{os.getpid()}"


def start_logging(args: argparse.Namespace, role: str) -> None:
    """Logging first, then link security (it logs which keys it uses), before any socket exists."""
    setup_logging(args)
    bind_service(service=role, worker_id=worker_id(args, role))
    apply_link_args(args)


def build_engine(args: argparse.Namespace, role: str, kv_allocator=None):
    """The worker's engine; `kv_allocator(layout, num_blocks)` places its KV memory (a transport's)."""
    from tandem.cli import cpus
    from tandem.engine.llm_engine import LLMEngine

    cpus.apply(args.cpus)  # before the engine's first torch op sizes its thread pool

    return LLMEngine(engine_config_from_args(args, resolve_model(args.model), role=role), kv_allocator)


def make_registrar(args: argparse.Namespace, role: str, control_address: str, model: str):
    if not args.router:
        return None
    import zmq

    from tandem.cli.roles import switchable
    from tandem.protocol.registration import Registrar

    registrar = Registrar(zmq.Context.instance(), args.router, worker_id(args, role), role,
                          args.advertise or control_address, model)
    registrar.extra_stats["switchable"] = switchable(args)  # the router refuses role switches it cannot do
    return registrar


def run_worker(args: argparse.Namespace, role: str) -> int:
    """`tandem prefill` / `tandem decode`: engine, transport, worker, registration, metrics, serve."""
    from tandem.cli import roles
    from tandem.observability.cli import setup_worker_observability

    start_logging(args, role)
    from tandem.cli import cpus

    # Where to move on a role switch, resolved now against the mask as started (a bad cpuset fails here):
    # --switch-cpus, or what a role-aware share "i/n:p" (tandem launch) implies; None: keep the cores.
    try:
        away = (cpus.resolve(args.switch_cpus) if args.switch_cpus is not None
                else cpus.switch_share(args.cpus) if args.cpus else None)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--cpus", "--switch-cpus", 1) if args.switch_cpus else str(exc)) from None
    args.switch_cores = None if away is None else {
        role: cpus.resolve(args.cpus) if args.cpus else cpus.budget(os.environ),
        "decode" if role == "prefill" else "prefill": away}
    if args.local_prefill_threshold < 0:
        raise ValueError("--local-prefill-threshold must be >= 0")
    if args.prefill_timeout <= 0:
        raise ValueError("--prefill-timeout must be > 0")
    transport = roles.make_transport(args)
    if role == "prefill" and transport is None:
        raise ValueError("a prefill worker needs a KV connector (zmq, shm or torch_dist)")
    # A decode worker's engine allocates its KV cache once, where the transport wants it (shm: shared
    # memory); the receiver then writes arriving blocks straight into it.
    allocator = transport.allocate_kv_caches if transport is not None and role == "decode" else None
    engine = build_engine(args, role=role, kv_allocator=allocator)
    worker = roles.build_worker(role, engine, args, args.listen, transport)
    worker.registrar = make_registrar(args, role, worker.address, engine.config.model)
    if worker.registrar is not None and transport is not None:
        worker.registrar.kv_layout = engine.kv_layout.to_dict()
        worker.registrar.kv_address = roles.kv_address(worker)
    colocated = role == "decode" and transport is None  # metrics role "both": it prefills too
    metrics = setup_worker_observability(args, worker, "both" if colocated else role, worker_id(args, role))
    addresses = {"control": worker.address}
    if role == "decode":  # its KV receiver (none when colocated)
        addresses["kv"] = worker.kv.receiver.address if worker.kv is not None else None
    announce(role, **addresses, metrics=metrics)
    return serve(worker, args.drain_timeout,
                 switch=lambda old, new_role: roles.switch(old, new_role, args, transport))


def announce(role: str, **addresses: str | None) -> None:
    """One machine-readable line on stdout: launchers and tests wait for it. It also says which
    process this is and the cores and threads it computes with."""
    import torch

    from tandem.cli import cpus

    info = {**addresses, "pid": os.getpid(), "cpus": cpus.format_cpuset(cpus.available()),
            "threads": torch.get_num_threads()}
    print(f"tandem-{role}-ready " + json.dumps(info), flush=True)


def serve(worker, drain_timeout_s: float = 30.0, switch=None) -> int:
    """Run until SIGTERM/SIGINT or the router's `drain`, then drain: heartbeats tell the router to
    route nothing new here, the requests in flight finish, and the worker deregisters, closes its
    sockets (and shared memory) and exits 0. After `drain_timeout_s`, or on a second signal, it
    stops at once (the router migrates what is left). The router's `set_role` drains the same way
    (without a deadline: nothing is cut short), then `switch(worker, role)` returns the worker of
    the other role, and serving goes on."""
    deadline: list[float] = []
    switching: list[str] = []
    freeze_startup_heap()

    def drain(reason: str) -> None:
        if deadline or drain_timeout_s <= 0:
            worker.stop()
            return
        deadline.append(time.monotonic() + drain_timeout_s)
        if worker.registrar is not None:
            worker.registrar.draining = True
        print(f"draining: finishing the requests in flight (at most {drain_timeout_s:.0f}s; "
              f"a second signal stops now) [{reason}]", file=sys.stderr, flush=True)

    def done() -> bool:
        request, worker.lifecycle = worker.lifecycle, None
        if request is not None and request["type"] == "drain":
            drain("the router asked")
        elif request is not None and not deadline and not switching:
            if switch is None or request["role"] not in ("prefill", "decode") or not worker_switchable(worker):
                print(f"ignored a switch to role {request['role']!r}: this worker cannot switch", file=sys.stderr)
            elif request["role"] != worker.registrar.role:
                switching.append(request["role"])
                worker.registrar.draining = True
        if deadline:
            return worker.idle() or time.monotonic() > deadline[0]
        return bool(switching) and worker.idle()

    signal.signal(signal.SIGTERM, lambda *_: drain("signal"))
    signal.signal(signal.SIGINT, lambda *_: drain("signal"))
    try:
        while True:
            worker.run(until=done)
            if not switching or deadline or worker._stopped:
                break
            worker = switch(worker, switching.pop())
    finally:
        if worker.registrar is not None:
            worker.registrar.close()  # stop the liveness thread before the sockets go
        worker.close()
        sys.stdout.flush()
    return 0


def worker_switchable(worker) -> bool:
    return worker.registrar is not None and bool(worker.registrar.extra_stats.get("switchable"))


def freeze_startup_heap() -> None:
    """Everything allocated while starting (imports, the model, the caches' bookkeeping) lives as long
    as the process: gc.freeze() takes it out of the collector's view, as vLLM's engine does. Measured
    without it (docs/PERFORMANCE.md, session 18): full (gen 2) collections while serving paused the
    router 88 ms and a decode worker 76-99 ms, holding the GIL — a request's first token waited them
    out (the rare ~100 ms TTFT outliers)."""
    gc.collect()
    gc.freeze()
