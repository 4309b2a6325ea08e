"""`tandem up`: the whole serving system on this machine — the router plus prefill and decode workers
as child processes — and the child-process supervision that `tandem launch` shares.

What `tandem up` does:
1. Resolve the model once (the built-in default without --model) and hand the path to every child.
2. Start the router on loopback-internal ports of its own choosing (port 0); read its endpoints line.
3. Start N prefill + M decode workers (port 0 everywhere) that register to the router's listen address.
   Each worker gets its own cores (tandem/cli/cpus.py): the budget — the affinity mask, capped by
   an exported OMP_NUM_THREADS — split into disjoint slices, or --cpus-per-worker each; the plan is
   printed; with a core to spare, the last one is left to the router (asyncio, one thread, no torch)
   and its clients. The router prefills a short prompt on its D while P is busy (conditional
   disaggregation, `--local-prefill-if-busy`, on by default here).
4. Poll the router's /health until it sees all of them; print the endpoints, a curl example and one
   machine-readable `tandem-up-ready {json}` line.
5. Supervise (tandem/cli/supervise.py). A worker that exits is reported by name with its last output
   lines and restarted with backoff (1, 2, 4 ... 30 s) while the router serves with the others; it
   registers again by itself. Only the router's death, or a worker dying MAX_RESTARTS times in a row
   (each run shorter than HEALTHY_RUN_S), stops everything and exits 1.
6. Ctrl-C / SIGTERM / SIGHUP: SIGTERM every child (each drains), wait up to STOP_GRACE_S, SIGKILL
   stragglers, exit 0.

No orphans, without prctl (so it works beyond Linux): children run in their own sessions (a Ctrl-C
in the terminal reaches only `tandem up`, which stops them in order), and each one is *tethered*:
it runs as `python -m tandem.cli.up COMMAND ARGS...` with its stdin a pipe from its parent and
SIGTERMs itself when that pipe reaches EOF — which the kernel guarantees when the parent dies, even
by SIGKILL. Over ssh (`tandem launch`) the same EOF travels to the remote process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from router_svc.reasoning import PARSERS as REASONING_PARSERS
from router_svc.tool_parsers import PARSERS
from tandem.cli import cpus
from tandem.cli.engine_args import add_engine_args, add_model_arg, engine_flags, resolve_model_path
from tandem.cli.keys import add_link_args
from tandem.cli.supervise import Supervisor, run_supervised, wait_healthy
from tandem.observability.logging import LEVELS

TETHER_GRACE_S = 15.0  # a tethered child that has not exited this long after its parent vanished is killed
LOCAL_IF_BUSY = 512  # tokens: `tandem up`'s default --local-prefill-if-busy (see _local_if_busy)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the router and prefill/decode workers on this machine",
                       description="Start a router and its workers as child processes on this machine, wait "
                                   "until they are all serving, print the endpoints; Ctrl-C stops everything.")
    add_model_arg(p)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1; 0 with --colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", action="store_true",
                   help="no prefill workers: decode workers prefill their own prompts (--kv-connector none)")
    p.add_argument("--kv-connector", default="zmq", choices=["zmq", "shm", "torch_dist"],
                   help="how prefill workers push KV to decode workers (default zmq)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface for the HTTP and gRPC servers (default loopback; 0.0.0.0 exposes them)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the directory's)")
    p.add_argument("--decode-policy", default=None, help="the router's decode routing policy (see `tandem router`)")
    p.add_argument("--prefill-policy", default=None, help="the router's prefill routing policy")
    p.add_argument("--local-prefill-threshold", type=int, default=None,
                   help="decode workers prefill prompts with fewer uncached tokens than this themselves")
    p.add_argument("--local-prefill-if-busy", type=int, default=None, metavar="TOKENS",
                   help="the router's conditional disaggregation: prompts of at most TOKENS tokens are prefilled "
                        f"by their decode worker while the prefill worker is busy (default {LOCAL_IF_BUSY}; 0: never)")
    p.add_argument("--cpus-per-worker", type=int, default=None,
                   help="cores (and torch threads) per worker; default: the CPU budget split evenly. The budget "
                        "is this process's affinity mask, capped by an exported OMP_NUM_THREADS")
    p.add_argument("--hung-timeout", type=float, default=None,
                   help="the router's hung timeout: seconds a live worker may make no progress (default 60)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM) for the router's HTTP and gRPC")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM) for the router's HTTP and gRPC")
    p.add_argument("--no-migration", dest="migrate", action="store_false",
                   help="the router ends a stream whose decode worker died instead of continuing it on another")
    p.add_argument("--enable-admin", action="store_true",
                   help="the router serves /admin/workers (drain, role switch; see `tandem router --help`)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="requests the router admits at once, past which it answers 429 (default: twice what the "
                        "decode workers batch: 2 x --decode x --max-num-seqs)")
    p.add_argument("--ttft-slo", type=float, default=None, help="the router's TTFT target in seconds (SLO metrics)")
    p.add_argument("--itl-slo", type=float, default=None, help="the router's mean inter-token latency target")
    p.add_argument("--rebalance", action="store_true",
                   help="the router moves workers between roles from the SLO signals (see `tandem router --help`)")
    p.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help="the router serves tool_choice 'auto' with this parser (see `tandem router --help`)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="the router splits <think> text into reasoning_content (see `tandem router --help`)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for every worker")
    p.add_argument("--quiet", action="store_true", help="do not relay the children's logs to stderr")
    p.add_argument("--log-level", default=None, choices=LEVELS,
                   help="the router's and every worker's minimum log level (default info; warning drops the "
                        "line per request)")
    p.add_argument("--log-prompts", action="store_true",
                   help="the router and workers include prompt text in their logs (off: prompts may be private)")
    add_link_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def _counts(args: argparse.Namespace) -> tuple[int, int]:
    if args.colocated and args.prefill:
        raise ValueError("--colocated runs no prefill workers: drop --prefill (decode workers prefill themselves)")
    prefill = 0 if args.colocated else (1 if args.prefill is None else args.prefill)
    if prefill < 0 or args.decode < 1:
        raise ValueError(f"need --decode >= 1 and --prefill >= 0, got --decode {args.decode} --prefill {prefill}")
    if prefill == 0 and not args.colocated:
        raise ValueError("--prefill 0 leaves the decode workers without prefill workers: use --colocated")
    return prefill, args.decode


def _local_if_busy(args: argparse.Namespace) -> int | None:
    """Conditional disaggregation is on by default on one box (as Dynamo's router has it): a short prompt
    that would queue behind P's prefill is computed by its D now. Measured on 2 cores (docs/PERFORMANCE.md,
    sessions 19-24): P/D's TTFT p99 was lower with it in every bursty row, ITL p99 stayed below vLLM's."""
    if args.local_prefill_if_busy is not None:
        return args.local_prefill_if_busy
    return None if args.colocated else LOCAL_IF_BUSY


def build_commands(args: argparse.Namespace, model: str) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """The router's `tandem` arguments and, per worker, (name, role, arguments without --router)."""
    router = ["router", "--model", model, "--host", args.host, "--http-port", str(args.http_port),
              "--grpc-port", str(args.grpc_port), "--listen", "tcp://127.0.0.1:0"]
    for flag, value in (("--served-model-name", args.served_model_name), ("--decode-policy", args.decode_policy),
                        ("--prefill-policy", args.prefill_policy), ("--hung-timeout", args.hung_timeout),
                        ("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile),
                        ("--tool-call-parser", args.tool_call_parser),
                        ("--reasoning-parser", args.reasoning_parser),
                        ("--local-prefill-if-busy", _local_if_busy(args))):
        if value is not None:
            router += [flag, str(value)]
    if not args.migrate:
        router.append("--no-migration")
    for flag, on in (("--enable-admin", args.enable_admin), ("--rebalance", args.rebalance)):
        if on:
            router.append(flag)
    _, decode_n = _counts(args)
    inflight = args.max_inflight or 2 * decode_n * args.max_num_seqs
    router += ["--max-inflight", str(inflight)]  # a load generator's burst queues, not 429s, up to this
    for flag, value in (("--ttft-slo", args.ttft_slo), ("--itl-slo", args.itl_slo)):
        if value is not None:
            router += [flag, str(value)]
    prefill, decode = _counts(args)
    shared = ["--model", model, "--listen", "tcp://127.0.0.1:0", *engine_flags(vars(args))]
    shared += ["--metrics-port", "0"]  # the router serves /metrics on its HTTP port; each worker on its own
    for flag, value in (("--link-keys", args.link_keys), ("--link-secret-file", args.link_secret_file)):
        if value is not None:  # (TANDEM_LINK_KEYS / TANDEM_LINK_SECRET reach the children by inheritance)
            router += [flag, value]
            shared += [flag, value]
    logs = (["--log-level", args.log_level] if args.log_level else []) + (["--log-prompts"] if args.log_prompts else [])
    if sys.stderr.isatty():
        # children write into our pipes, so they would pick JSON logs; we relay them to a person
        logs += ["--log-format", "console"]
    router += logs
    shared += logs
    workers = []
    for i in range(prefill):
        workers.append((f"prefill-{i}", "prefill", ["--kv-connector", args.kv_connector, *shared]))
    for i in range(decode):
        extra = ["--kv-connector", "none" if args.colocated else args.kv_connector]
        if args.local_prefill_threshold is not None:
            extra += ["--local-prefill-threshold", str(args.local_prefill_threshold)]
        workers.append((f"decode-{i}", "decode", [*extra, *shared]))
    return router, workers


def cpu_plan(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, list[int]], str]:
    """Each worker's cores out of the budget, and the line that tells the user."""
    budget = cpus.budget(os.environ)
    assignment, spare = cpus.assign(names, budget, args.cpus_per_worker)
    source = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "the affinity mask"
    rest = f"cpu {budget[-1]} left to the router and clients" if spare else "router unpinned"
    shared = " (more workers than cores: they share)" if len(names) > len(budget) else ""
    return assignment, (f"cpu plan: {len(budget)} cores from {source} (cpus {cpus.format_cpuset(budget)}): "
                        f"{cpus.describe(assignment)}; {rest}{shared}")


def run(args: argparse.Namespace) -> int:
    model = resolve_model_path(args.model)
    router_args, workers = build_commands(args, model)
    prefill, decode = _counts(args)
    assignment, plan_line = cpu_plan(args, [name for name, _, _ in workers])
    print(f"tandem up: {plan_line}", file=sys.stderr, flush=True)
    sup = Supervisor(echo=not args.quiet)

    def start_all() -> dict:
        router = sup.start("router", tethered(router_args), env={**os.environ, "OMP_NUM_THREADS": "1"})
        ep = sup.router_endpoints(router, timeout=args.startup_timeout)
        ready = {}
        switch_to = cpus.switch_targets(assignment)
        for name, role, worker_args in workers:
            cores = assignment[name]
            argv = [role, *worker_args, "--router", ep["listen"], "--worker-id", name,
                    "--cpus", cpus.format_cpuset(cores)]
            if name in switch_to:
                argv += ["--switch-cpus", cpus.format_cpuset(switch_to[name])]
            sup.start(name, tethered(argv), env={**os.environ, "OMP_NUM_THREADS": str(len(cores))})
        for name, role, _ in workers:
            ready[name] = sup.worker_ready(sup.children[name], role, timeout=args.startup_timeout)
        health = wait_healthy(sup, ep["http"], decode=decode, prefill=prefill, timeout=args.startup_timeout)
        return {**ep, "model": health.get("model", ""), "workers": ready}

    local = _local_if_busy(args)
    summary = f"{prefill} prefill + {decode} decode" + (" (colocated)" if args.colocated else (
        f" (kv connector {args.kv_connector}; prompts of <= {local} tokens prefilled on D while every P is busy)"
        if local else f" (kv connector {args.kv_connector})"))
    return run_supervised(sup, start_all, "tandem up", summary)


def tethered(argv: list[str]) -> list[str]:
    """The command line that runs `tandem ARGV...` tethered to its parent (see the module docstring)."""
    return [sys.executable, "-m", "tandem.cli.up", *argv]


def run_tethered(argv: list[str]) -> int:
    """Run `tandem ARGV...` in this process; SIGTERM ourselves when stdin (the parent's pipe) closes."""
    def watch() -> None:
        try:
            while os.read(0, 65536):  # the parent never writes: any EOF or error means it is gone
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # the command's own handler shuts it down cleanly
        time.sleep(TETHER_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="tether", daemon=True).start()
    from tandem.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run_tethered(sys.argv[1:]))
