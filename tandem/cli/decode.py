"""`tandem decode`: a decode worker (the engine in decode role + KV receiver). Without a KV connector
(`--kv-connector none`) it is a colocated worker that prefills every prompt itself."""

from __future__ import annotations

import argparse

from tandem.cli.worker_common import (
    add_worker_args,
    announce,
    build_engine,
    make_registrar,
    serve,
    start_logging,
    worker_id,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="run a decode worker",
                       description="Decode worker: receives requests from the router, gets prompt KV from "
                                   "prefill workers (or computes it), streams tokens back.")
    add_worker_args(p, default_port=5700)
    p.add_argument("--kv-listen", default=None,
                   help="address the KV receiver binds (default: the control host, a free port)")
    p.add_argument("--local-prefill-threshold", type=int, default=32,
                   help="prefill here instead of remotely when fewer prompt tokens than this are uncached")
    p.add_argument("--prefill-timeout", type=float, default=30.0,
                   help="seconds without KV progress before recomputing a prompt locally")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from decode_svc.worker import DecodeWorker
    from tandem.engine.strategies import resolve_connector
    from tandem.observability.cli import setup_worker_observability

    start_logging(args, "decode")
    if args.local_prefill_threshold < 0:
        raise ValueError("--local-prefill-threshold must be >= 0")
    if args.prefill_timeout <= 0:
        raise ValueError("--prefill-timeout must be > 0")
    transport = None if args.kv_connector == "none" else resolve_connector(args.kv_connector)(
        timeout_s=args.prefill_timeout)
    # The engine allocates its KV cache once, where the transport wants it (shm: shared memory);
    # the receiver then writes arriving blocks straight into it.
    engine = build_engine(args, role="decode", kv_allocator=transport.allocate_kv_caches if transport else None)
    receiver = None
    if transport is not None:
        bind = args.kv_listen or _same_host(args.listen)
        receiver = transport.make_receiver(engine.kv_layout, engine.runner.kv_caches, engine.runner.kv_scales, bind)
    worker = DecodeWorker(engine, args.listen, receiver, args.local_prefill_threshold, args.prefill_timeout)
    worker.registrar = make_registrar(args, "decode", worker.address, engine.config.model)
    # without a KV connector this worker is colocated: metrics role "both"
    metrics = setup_worker_observability(args, worker, "decode" if receiver else "both", worker_id(args, "decode"))
    announce("decode", control=worker.address, kv=receiver.address if receiver else None, metrics=metrics)
    return serve(worker, args.drain_timeout)


def _same_host(address: str) -> str:
    if address.startswith("tcp://"):
        return address.rsplit(":", 1)[0] + ":0"
    if address.startswith("ipc://"):
        return address + ".kv"
    return "tcp://127.0.0.1:0"
