"""`tandem decode`: a decode worker (the engine in decode role + KV receiver). Without a KV connector
(`--kv-connector none`) it is a colocated worker that prefills every prompt itself."""

from __future__ import annotations

import argparse

from tandem.cli.worker_common import add_worker_args, run_worker


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="run a decode worker",
                       description="Decode worker: receives requests from the router, gets prompt KV from "
                                   "prefill workers (or computes it), streams tokens back.")
    add_worker_args(p, default_port=5700)
    p.set_defaults(func=lambda args: run_worker(args, "decode"))
