"""`tandem launch cluster.yaml`: bare-metal multi-node launch of a router and its workers.

1. Load and validate the YAML (tandem/cli/launch_config.py; deploy/cluster.example.yaml documents
   every key); an unknown or bad key is a ValueError that names it, e.g. `hosts[1].decode.cont: unknown key`.
2. Plan one command per process: the router on `router.host`, then `count` workers per role per
   host, worker i of a role listening on `port + i`. Hosts named localhost/127.0.0.1 run as local
   processes, any other host over `ssh -T` (tandem/cli/launch_ssh.py). Workers bind only the address
   of their host as the YAML names it. Every command is checked against `tandem`'s own argument
   parser before anything starts. `--dry-run` prints the commands and stops here.
   Then every remote host must answer over ssh with this tandem version (preflight), or nothing starts
   and the launch exits 2 naming the host.
3. Start the router, then the workers (registering to `tcp://router.host:listen_port`), wait until
   the router's /health counts all of them, print the endpoints, and supervise exactly as
   `tandem up` does (tandem/cli/supervise.py): a dead process stops everything with exit 1.

Each command runs tethered (`python -m tandem.cli.up ROLE ...`): ssh forwards the closing of its
stdin, so a remote worker stops when `tandem launch` or its ssh connection goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from tandem.cli import cpus
from tandem.cli.engine_args import engine_flags
from tandem.cli.launch_config import LOCAL_HOSTS, LOCAL_SECRET, load_cluster
from tandem.cli.launch_ssh import preflight, remote_command, remote_python, ssh_prefix
from tandem.cli.supervise import Supervisor, run_supervised, wait_healthy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="start a router and workers on several hosts from a cluster YAML",
                       description="Start the processes a cluster YAML describes (over ssh for remote hosts), "
                                   "wait until the router sees every worker, supervise; Ctrl-C stops them all. "
                                   "See deploy/cluster.example.yaml.")
    p.add_argument("cluster", help="cluster YAML file")
    p.add_argument("--dry-run", action="store_true", help="print the exact commands and exit")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every worker")
    p.add_argument("--quiet", action="store_true", help="do not relay the processes' logs to stderr")
    p.set_defaults(func=run)


@dataclass(slots=True)
class Planned:
    name: str
    host: str
    role: str
    argv: list[str]  # what runs on this machine (ssh ... for a remote host)
    env: dict[str, str] = field(default_factory=dict)
    where: str = ""  # the YAML entry it comes from, for error messages
    ssh: list[str] = field(default_factory=list)  # remote only: `ssh ... user@host`
    python: str = ""  # remote only: the interpreter there


def run(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster)
    try:
        router, workers = plan(cluster)
    except ValueError as exc:
        raise ValueError(f"{args.cluster}: {exc}") from None
    if args.dry_run:
        for proc in (router, *workers):
            print(f"# {proc.name} on {proc.host}")
            print(shlex.join(proc.argv))
        return 0
    from tandem import __version__

    preflight([(p.where, p.host, p.ssh, p.python) for p in (router, *workers) if p.ssh], __version__)
    sup = Supervisor(echo=not args.quiet)
    counts = {role: sum(w.role == role for w in workers) for role in ("decode", "prefill")}

    def start_all() -> dict:
        ep = sup.router_endpoints(sup.start("router", router.argv, {**os.environ, **router.env}), args.startup_timeout)
        host = cluster["router"]["host"]  # the router prints its bind address; clients use its host
        ep["http"] = f"http://{host}:{ep['http'].rsplit(':', 1)[1]}"
        ep["grpc"] = f"{host}:{ep['grpc'].rsplit(':', 1)[1]}"
        for w in workers:
            sup.start(w.name, w.argv, {**os.environ, **w.env})
        ready = {w.name: sup.worker_ready(sup.children[w.name], w.role, args.startup_timeout) for w in workers}
        health = wait_healthy(sup, ep["http"], counts["decode"], counts["prefill"], args.startup_timeout)
        return {**ep, "model": health.get("model", ""), "workers": ready}

    return run_supervised(sup, start_all, "tandem launch",
                          f"{counts['prefill']} prefill + {counts['decode']} decode on {len(cluster['hosts'])} host(s)")


def plan(cluster: dict[str, Any]) -> tuple[Planned, list[Planned]]:
    """The router's and every worker's command line (checked against tandem's argument parser)."""
    r, model, connector = cluster["router"], cluster["model"], cluster["kv_connector"]
    router_local = r["host"] in LOCAL_HOSTS
    bind = r.get("bind", "127.0.0.1" if router_local else "0.0.0.0")
    router_args = ["router", *_model_flag(r.get("model", model)), "--host", bind, "--http-port", str(r["http_port"]),
                   "--grpc-port", str(r["grpc_port"]), "--listen", f"tcp://{bind}:{r['listen_port']}", *r["args"]]
    links, secret_env = _link_security(cluster["link_keys"])
    router = _command("router", r["host"], router_args + links, dict(secret_env), cluster, r, "router")
    registration = f"tcp://{r['host']}:{r['listen_port']}"
    workers = []
    for i, h in enumerate(cluster["hosts"]):
        local = h["host"] in LOCAL_HOSTS
        on_host, slot = h["prefill"]["count"] + h["decode"]["count"], 0
        for role in ("prefill", "decode"):
            spec = h[role]
            for k in range(spec["count"]):
                # each worker its own cores: the role's cpuset cut in `count` slices, else its share of
                # the host's affinity mask (decided on the host, whose core count we do not know here)
                # (":p" names the first p as prefill: past the host's core count the roles then share
                # cores only within themselves, as under tandem up)
                both = h["prefill"]["count"] and h["decode"]["count"]
                cores = (cpus.format_cpuset(cpus.slices(spec["cpus"], spec["count"])[k]) if spec["cpus"]
                         else f"{slot}/{on_host}" + (f":{h['prefill']['count']}" if both else ""))
                slot += 1
                name = f"{h['host']}-{role}-{k}"
                port = spec["port"] + k if spec["port"] else 0
                # bound on the host's own address only: the one the router and P reach it at
                argv = [role, *_model_flag(h.get("model", model)), "--kv-connector", connector,
                        "--listen", f"tcp://{'127.0.0.1' if local else h['host']}:{port}",
                        "--router", registration, "--worker-id", name, "--cpus", cores]
                if role == "decode" and connector != "none" and (spec["kv_port"] is not None or not local):
                    # (a wildcard bind would advertise whatever the hostname resolves to, often 127.0.1.1)
                    kv_port = spec["kv_port"] + k if spec["kv_port"] else 0
                    argv += ["--kv-listen", f"tcp://{'127.0.0.1' if local else h['host']}:{kv_port}"]
                argv += [*links, *engine_flags(cluster["engine"]), *spec["args"]]
                env = {**secret_env, **{key: v.replace("{index}", str(k)) for key, v in spec["env"].items()}}
                workers.append(_command(name, h["host"], argv, env, cluster, h, f"hosts[{i}].{role}"))
    return router, workers


def _link_security(link_keys: str | None) -> tuple[list[str], dict[str, str]]:
    """(flags, environment) that give every process the cluster's link keys."""
    if link_keys is None:
        return [], {}
    if link_keys == LOCAL_SECRET:  # all local: the secret travels in the environment, never on a command line
        import secrets

        from tandem.protocol.security import SECRET_ENV

        return [], {SECRET_ENV: secrets.token_hex(32)}
    return ["--link-keys", link_keys], {}


def _model_flag(model: str | None) -> list[str]:
    return ["--model", model] if model else []  # none: each host serves tandem's built-in model


def _command(name: str, host: str, tandem_args: list[str], env: dict[str, str], cluster: dict[str, Any],
             entry: dict[str, Any], where: str) -> Planned:
    _check_args(tandem_args, where)
    if host in LOCAL_HOSTS:
        python = entry.get("python", sys.executable)
        return Planned(name, host, tandem_args[0], [python, "-m", "tandem.cli.up", *tandem_args], env, where)
    ssh = cluster["ssh"]
    return Planned(name, host, tandem_args[0], remote_command(host, entry, ssh, tandem_args, env), where=where,
                   ssh=ssh_prefix(host, entry, ssh), python=remote_python(entry, ssh))


def _check_args(tandem_args: list[str], where: str) -> None:
    """Parse the command as `tandem` would, so a bad flag fails here, not on a remote host later."""
    from tandem.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(tandem_args)
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        raise ValueError(f"{where}: the command `tandem {shlex.join(tandem_args)}` is invalid: "
                         f"{lines[-1].split('error: ', 1)[-1] if lines else 'bad arguments'}") from None
