"""`tandem profile`: measure this machine's prefill, decode and KV-transfer times for a model and engine
config, and write them as JSON for `tandem plan` (tandem/planner/measure.py does the measuring)."""

from __future__ import annotations

import argparse
import sys
import time

from tandem.cli.engine_args import add_engine_args, add_model_arg, engine_config_from_args, resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure step and transfer times on this machine for `tandem plan`",
                       description="Measure prefill time vs prompt length and chunk budget, decode step time vs "
                                   "batch and context, and KV transfer time vs bytes, with the real engine. "
                                   "A few minutes for the default model; --quick takes seconds (coarse).")
    add_model_arg(p)
    p.add_argument("--kv-connector", default="zmq", choices=["zmq", "shm", "torch_dist", "none"],
                   help="the transport to time (none: colocated only, no transfer)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a few points only, in seconds (for tests)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, as one worker gets from `tandem up`'s cpu plan (docs/CPUS.md); default 1")
    add_engine_args(p)
    p.set_defaults(func=run)


class ProgressBar:
    """One self-overwriting line on stderr: [#####.....] done/total what (elapsed)."""

    def __init__(self, width: int = 30) -> None:
        self.width, self.t0 = width, time.monotonic()

    def __call__(self, done: int, total: int, what: str) -> None:
        self.total = total
        filled = self.width * done // max(self.total, 1)
        line = f"\rprofile [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {what}"
        sys.stderr.write(f"{line[:100]:<100} {time.monotonic() - self.t0:5.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def run(args: argparse.Namespace) -> int:
    from tandem.observability.logging import configure_logging

    configure_logging("warning")  # the engines' log lines on stderr, warnings only: stdout is this command's output
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    config = engine_config_from_args(args, resolve_model(args.model))
    if config.speculator is not None:
        raise ValueError("profile without --speculator: the planner models one token per decode step")
    from tandem.planner.measure import measure

    bar = ProgressBar()
    try:
        profile = measure(config, args.threads, args.kv_connector, args.quick, bar)
    finally:
        bar.close()
    profile.save(args.output)
    print(f"wrote {args.output}: {len(profile.prefill)} prefill, {len(profile.prefill_chunked)} chunked, "
          f"{len(profile.decode)} decode, {len(profile.kv_transfer['points'])} transfer points "
          f"in {time.monotonic() - bar.t0:.0f} s")
    return 0
