"""The cluster YAML of `tandem launch`: load it and validate every key (deploy/cluster.example.yaml
documents them). An unknown or bad key is a ValueError that names it, e.g.
`hosts[1].decode.cont: unknown key`; cross-checks (roles vs connector, cpusets, ports per host) too.
"""

from __future__ import annotations

import argparse
from typing import Any

from tandem.cli import cpus
from tandem.cli.engine_args import engine_actions

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
CONNECTORS = ("zmq", "shm", "torch_dist", "none")
TOP_KEYS = ("model", "kv_connector", "engine", "link_keys", "insecure_links", "ssh", "router", "hosts")
SSH_KEYS = ("user", "port", "options", "python")
ROUTER_KEYS = ("host", "bind", "http_port", "grpc_port", "listen_port", "model", "python", "args")
HOST_KEYS = ("host", "user", "python", "model", "prefill", "decode")
ROLE_KEYS = ("count", "port", "kv_port", "cpus", "args", "env")
DEFAULT_PORTS = {"prefill": 6000, "decode": 6100}
LOCAL_SECRET = ""  # link_keys of an all-local cluster: a secret made per launch


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
