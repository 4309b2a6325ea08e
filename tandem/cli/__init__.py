"""`tandem` command line: one subcommand per module in this package, each with `register(subparsers)`.

Bad input (a ValueError/TypeError from anywhere below) exits with code 2 and one readable line.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

# Subcommand modules, in the order `tandem --help` lists them.
COMMANDS = ["generate", "chat", "up", "launch", "router", "prefill", "decode", "keys", "plugins", "profile", "plan"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem",
                                     description="tandem: LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tandem.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # As a container's PID 1 (Kubernetes runs the entrypoint so), a signal with no handler is ignored:
    # SIGTERM during a model load would wait out the whole grace period. Exit on it until a command
    # installs its own (the workers' drain, the router's and `tandem up`'s shutdown).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (ValueError, TypeError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
