"""Flags and start-up shared by the worker commands (`tandem decode`, `tandem prefill`)."""

from __future__ import annotations

import argparse
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
    p.add_argument("--cpus", default=None, metavar="CPUSET|i/n",
                   help="pin this worker to these cores and use one torch thread per core: a cpuset like 0-3,8, "
                        "or i/n for slice i of n of the affinity mask (default: every core the mask allows, "
                        "capped by OMP_NUM_THREADS)")
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

    from tandem.protocol.registration import Registrar

    return Registrar(zmq.Context.instance(), args.router, worker_id(args, role), role,
                     args.advertise or control_address, model)


def announce(role: str, **addresses: str | None) -> None:
    """One machine-readable line on stdout: launchers and tests wait for it. It also says which
    process this is and the cores and threads it computes with."""
    import torch

    from tandem.cli import cpus

    info = {**addresses, "pid": os.getpid(), "cpus": cpus.format_cpuset(cpus.available()),
            "threads": torch.get_num_threads()}
    print(f"tandem-{role}-ready " + json.dumps(info), flush=True)


def serve(worker, drain_timeout_s: float = 30.0) -> int:
    """Run until SIGTERM/SIGINT, then drain: heartbeats tell the router to route nothing new here,
    the requests in flight finish, and the worker deregisters, closes its sockets (and shared
    memory) and exits 0. After `drain_timeout_s`, or on a second signal, it stops at once (the
    router migrates what is left)."""
    deadline: list[float] = []

    def _signal(*_):
        if deadline or drain_timeout_s <= 0:
            worker.stop()
            return
        deadline.append(time.monotonic() + drain_timeout_s)
        if worker.registrar is not None:
            worker.registrar.draining = True
        print(f"draining: finishing the requests in flight (at most {drain_timeout_s:.0f}s; "
              "a second signal stops now)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    try:
        worker.run(until=lambda: bool(deadline) and (worker.idle() or time.monotonic() > deadline[0]))
    finally:
        if worker.registrar is not None:
            worker.registrar.close()  # stop the liveness thread before the sockets go
        worker.close()
        sys.stdout.flush()
    return 0
