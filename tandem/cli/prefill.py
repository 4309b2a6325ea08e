"""`tandem prefill`: a prefill worker (the engine in prefill role + KV sender)."""

from __future__ import annotations

import argparse

from tandem.cli.worker_common import add_worker_args, run_worker


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="run a prefill worker",
                       description="Prefill worker: computes prompts for decode workers and pushes their KV "
                                   "layer by layer.")
    add_worker_args(p, default_port=5800)
    p.set_defaults(func=lambda args: run_worker(args, "prefill"))
