"""`tandem prefill`: a prefill worker (the engine in prefill role + KV sender)."""

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
    p = sub.add_parser("prefill", help="run a prefill worker",
                       description="Prefill worker: computes prompts for decode workers and pushes their KV "
                                   "layer by layer.")
    add_worker_args(p, default_port=5800)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefill_svc.worker import PrefillWorker
    from tandem.engine.strategies import resolve_connector
    from tandem.observability.cli import setup_worker_observability

    start_logging(args, "prefill")
    if args.kv_connector == "none":
        raise ValueError("a prefill worker needs a KV connector (zmq, shm or torch_dist)")
    engine = build_engine(args, role="prefill")
    sender = resolve_connector(args.kv_connector)().make_sender(engine.kv_layout, engine.config.torch_device)
    worker = PrefillWorker(engine, args.listen, sender)
    worker.registrar = make_registrar(args, "prefill", worker.address, engine.config.model)
    metrics = setup_worker_observability(args, worker, "prefill", worker_id(args, "prefill"))
    announce("prefill", control=worker.address, metrics=metrics)
    return serve(worker, args.drain_timeout)
