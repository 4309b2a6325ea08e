"""`tandem launch cluster.yaml`: bare-metal multi-node launch of a router and its workers.

1. Load and validate the YAML (`deploy/cluster.example.yaml` documents every key); an unknown or bad
   key is a ValueError that names it, e.g. `hosts[1].decode.cont: unknown key`.
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
from tandem.cli.launch_ssh import preflight, remote_command, remote_python, ssh_prefix
from tandem.cli.supervise import Supervisor, engine_actions, engine_flags, run_supervised, wait_healthy

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
CONNECTORS = ("zmq", "shm", "torch_dist", "none")
TOP_KEYS = ("model", "kv_connector", "engine", "link_keys", "insecure_links", "ssh", "router", "hosts")
SSH_KEYS = ("user", "port", "options", "python")
ROUTER_KEYS = ("host", "bind", "http_port", "grpc_port", "listen_port", "model", "python", "args")
HOST_KEYS = ("host", "user", "python", "model", "prefill", "decode")
ROLE_KEYS = ("count", "port", "kv_port", "cpus", "args", "env")
DEFAULT_PORTS = {"prefill": 6000, "decode": 6100}
LOCAL_SECRET = ""  # link_keys of an all-local cluster: a secret made per launch


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


# ---- validation --------------------------------------------------------------------------------
def load_cluster(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: is not valid YAML: {' '.join(str(exc).split())}") from None
    try:
        return validate(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def validate(raw: Any) -> dict[str, Any]:
    """The cluster with defaults filled in; ValueError naming the first bad key."""
    top = _mapping(raw, "the cluster file", TOP_KEYS, required=("router", "hosts"))
    ssh = _mapping(top.get("ssh", {}), "ssh", SSH_KEYS)
    router = _mapping(top["router"], "router", ROUTER_KEYS, required=("host",))
    _strs(top, "", ("model",))
    _strs(ssh, "ssh.", ("user", "python"))
    _strs(router, "router.", ("host", "bind", "model", "python"))
    ssh["options"] = _str_list(ssh.get("options", []), "ssh.options")
    if "port" in ssh:
        _port(ssh["port"], "ssh.port")
    router["args"] = _str_list(router.get("args", []), "router.args")
    connector = top.get("kv_connector", "zmq")
    if connector not in CONNECTORS:
        raise ValueError(f"kv_connector: {connector!r} is not one of {', '.join(CONNECTORS)}")
    engine = _engine(top.get("engine", {}))
    router_local = router["host"] in LOCAL_HOSTS
    for key, default in (("http_port", 8000), ("grpc_port", 50051), ("listen_port", 5557)):
        router[key] = _port(router.get(key, default), f"router.{key}", allow_zero=router_local and key != "listen_port")
    if not isinstance(top["hosts"], list) or not top["hosts"]:
        raise ValueError("hosts: must be a non-empty list of hosts")
    hosts = [_host(h, f"hosts[{i}]") for i, h in enumerate(top["hosts"])]
    names = [h["host"] for h in hosts]
    remote = not router_local or any(n not in LOCAL_HOSTS for n in names)
    for i, h in enumerate(hosts):
        if h["host"] in names[:i]:
            raise ValueError(f"hosts[{i}].host: {h['host']!r} is listed twice; give each host one entry")
        if remote and h["host"] in LOCAL_HOSTS:
            raise ValueError(f"hosts[{i}].host: {h['host']!r} cannot be reached from the other hosts; name this "
                             "machine by an address they can reach")
        for role in ("prefill", "decode"):
            h[role] = _role(h.get(role, {}), f"hosts[{i}].{role}", role, local=h["host"] in LOCAL_HOSTS)
    _check_roles(connector, hosts)
    _check_ports(router, hosts)
    _check_cpus(hosts)
    return {"model": top.get("model"), "kv_connector": connector, "engine": engine,
            "link_keys": _link_keys(top, remote), "ssh": ssh, "router": router, "hosts": hosts}


def _link_keys(top: dict[str, Any], remote: bool) -> str | None:
    """Worker links are authenticated by default: remote hosts share a key directory the user copied
    there; an all-local cluster gets a fresh secret in its processes' environment (see `plan`)."""
    _strs(top, "", ("link_keys",))
    insecure = top.get("insecure_links", False)
    if not isinstance(insecure, bool):
        raise ValueError(f"insecure_links: expected true or false, got {insecure!r}")
    if insecure and "link_keys" in top:
        raise ValueError("insecure_links: true contradicts link_keys: drop one")
    if remote and not insecure and "link_keys" not in top:
        raise ValueError("link_keys: required when hosts are remote: run `tandem keys DIR`, copy DIR to every "
                         "host, and set `link_keys: DIR` (or `insecure_links: true` to leave worker links open)")
    return None if insecure else top.get("link_keys", LOCAL_SECRET)


def _check_roles(connector: str, hosts: list[dict[str, Any]]) -> None:
    n_prefill = sum(h["prefill"]["count"] for h in hosts)
    if not sum(h["decode"]["count"] for h in hosts):
        raise ValueError("hosts: no decode workers (set decode.count on at least one host)")
    if connector == "none" and n_prefill:
        raise ValueError("kv_connector: 'none' means colocated decode workers; remove the prefill workers")
    if connector != "none" and not n_prefill:
        raise ValueError("hosts: no prefill workers; add some, or set kv_connector: none (colocated decode)")
    if connector == "shm" and len([h for h in hosts if h["prefill"]["count"] or h["decode"]["count"]]) > 1:
        raise ValueError("kv_connector: 'shm' works within one host; use zmq or torch_dist across hosts")


def _check_cpus(hosts: list[dict[str, Any]]) -> None:
    """Workers on one host must not share cores unless nobody said which: then they split the mask."""
    for i, h in enumerate(hosts):
        p, d = h["prefill"], h["decode"]
        if p["count"] and d["count"] and (p["cpus"] is None) != (d["cpus"] is None):
            missing = "prefill" if p["cpus"] is None else "decode"
            raise ValueError(f"hosts[{i}].{missing}.cpus: set cpus for both roles on a host, or for neither "
                             "(then the host's workers split its cores evenly)")
        if p["count"] and d["count"] and p["cpus"] and d["cpus"]:
            both = sorted(set(p["cpus"]) & set(d["cpus"]))
            if both:
                raise ValueError(f"hosts[{i}]: prefill.cpus and decode.cpus overlap on cores "
                                 f"{cpus.format_cpuset(both)}")


def _check_ports(router: dict[str, Any], hosts: list[dict[str, Any]]) -> None:
    """Two processes told to bind one port on one host would fail at start-up, far from the cause."""
    used: dict[tuple[str, int], str] = {}

    def claim(host: str, port: int | None, what: str) -> None:
        key = ("local" if host in LOCAL_HOSTS else host, port or 0)
        if port and key in used:
            raise ValueError(f"{what}: port {port} on {host} is already taken by {used[key]}")
        used[key] = what

    for key in ("http_port", "grpc_port", "listen_port"):
        claim(router["host"], router[key], f"router.{key}")
    for i, h in enumerate(hosts):
        for role in ("prefill", "decode"):
            spec = h[role]
            for k in range(spec["count"]):
                for field_ in ("port", "kv_port"):
                    if spec.get(field_):
                        claim(h["host"], spec[field_] + k, f"hosts[{i}].{role}.{field_} (worker {k})")


def _mapping(value: Any, where: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            prefix = "" if where == "the cluster file" else f"{where}."
            raise ValueError(f"{prefix}{key}: unknown key (expected one of: {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise ValueError(f"{where}: missing required key {key!r}")
    return dict(value)


def _host(value: Any, where: str) -> dict[str, Any]:
    h = _mapping(value, where, HOST_KEYS, required=("host",))
    _strs(h, f"{where}.", ("host", "user", "python", "model"))
    return h


def _strs(d: dict[str, Any], prefix: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in d:
            _str(d[key], f"{prefix}{key}")


def _role(value: Any, where: str, role: str, local: bool) -> dict[str, Any]:
    r = _mapping(value or {}, where, ROLE_KEYS if role == "decode" else tuple(k for k in ROLE_KEYS if k != "kv_port"))
    count = r.get("count", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{where}.count: expected an integer >= 0, got {count!r}")
    cores = None
    if "cpus" in r:
        try:
            cores = cpus.parse_cpuset(_str(r["cpus"], f"{where}.cpus", scalar=True))
        except ValueError as exc:
            raise ValueError(f"{where}.cpus: {exc}") from None
        if len(cores) < count:
            raise ValueError(f"{where}.cpus: {len(cores)} cores for {count} workers; give each at least one")
    env = r.get("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"{where}.env: expected a mapping of environment variables, got {env!r}")
    return {"count": count, "port": _port(r.get("port", DEFAULT_PORTS[role]), f"{where}.port", local),
            "kv_port": _port(r["kv_port"], f"{where}.kv_port", local) if "kv_port" in r else None,
            "cpus": cores, "args": _str_list(r.get("args", []), f"{where}.args"),
            "env": {str(k): _str(v, f"{where}.env.{k}", scalar=True) for k, v in env.items()}}


def _engine(value: Any) -> dict[str, Any]:
    actions = engine_actions()
    engine = _mapping(value, "engine", tuple(sorted(actions)))
    for key, v in engine.items():
        action = actions[key]
        ok = isinstance(v, bool) if isinstance(action, argparse.BooleanOptionalAction) else not isinstance(v, bool)
        try:
            if ok and action.type is not None:
                action.type(v)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"engine.{key}: bad value {v!r}")
    return engine


def _port(value: Any, where: str, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (0 if allow_zero else 1) <= value <= 65535:
        rule = "0 (any free port, local hosts only) or 1..65535" if allow_zero else "1..65535"
        raise ValueError(f"{where}: expected a port {rule}, got {value!r}")
    return value


def _str(value: Any, where: str, scalar: bool = False) -> str:
    if scalar and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of strings, got {value!r}")
    return [_str(v, f"{where}[{i}]", scalar=True) for i, v in enumerate(value)]


# ---- planning ----------------------------------------------------------------------------------
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
                cores = (cpus.format_cpuset(cpus.slices(spec["cpus"], spec["count"])[k]) if spec["cpus"]
                         else f"{slot}/{on_host}")
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
