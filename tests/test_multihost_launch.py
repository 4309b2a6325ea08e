"""`tandem launch` for real across network-namespace hosts (tests/netns_hosts.py), each running an
sshd on its own address: the router, a prefill worker and two decode workers started over ssh from
one cluster YAML with CURVE link keys made by `tandem keys`.

- The launched cluster serves P/D requests equal to transformers' greedy output; every process binds
  only its host's address; SIGTERM to `tandem launch` stops every remote process (exit 0).
- Preflight: a host that does not answer over ssh, or one whose interpreter has no tandem, is exit 2
  with a message naming it, and nothing was started on any host.
The per-role commands across the same kind of hosts (and a link cut mid-stream) are test_multihost.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import yaml
from netns_hosts import Hosts, Sshd, sshd_unavailable, unavailable
from service_procs import Proc
from test_multihost import ENGINE, MAX_TOKENS, PROMPTS, generate_all
from tiny_models import hf_greedy, make_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    reason = unavailable() or sshd_unavailable()
    if reason:
        pytest.skip(reason)
    with Hosts(4) as hosts:  # router, prefill, decode, decode
        sshd = Sshd(hosts, str(tmp_path_factory.mktemp("ssh")))
        try:
            yield hosts, sshd
        finally:
            sshd.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys") / "cluster"
    subprocess.run([sys.executable, "-m", "tandem.cli", "keys", str(directory)], check=True, capture_output=True)
    return str(directory)


def cluster_yaml(path, net, sshd, ckpt, keys, hosts=None, python=sys.executable) -> str:
    r, p, d1, d2 = net.hosts
    engine = dict(zip([flag.lstrip("-").replace("-", "_") for flag in ENGINE[::2]], map(int, ENGINE[1::2])))
    spec = {"model": ckpt, "kv_connector": "zmq", "link_keys": keys, "engine": engine,
            "ssh": {"user": "root", "options": sshd.options, "python": python},
            "router": {"host": r.addr, "bind": r.addr, "http_port": 8000, "grpc_port": 50051, "listen_port": 5557},
            "hosts": hosts or [{"host": p.addr, "prefill": {"count": 1}},
                               {"host": d1.addr, "decode": {"count": 1, "kv_port": 6200}},
                               {"host": d2.addr, "decode": {"count": 1, "kv_port": 6200}}]}
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def tandem_pids(net) -> dict[str, list[str]]:
    """Per host, the command lines of the tandem processes running in it (sshd itself excluded)."""
    found = {}
    for h in net.hosts:
        pids = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True).stdout.split()
        cmds = []
        for pid in pids:
            try:
                cmds.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
            except OSError:
                continue
        found[h.ns] = [c for c in cmds if "tandem" in c]
    return found


def test_launch_over_ssh_serves_across_hosts_and_stops_everything(net, ckpt, keys, tmp_path):
    hosts, sshd = net
    expected = hf_greedy(ckpt, PROMPTS, MAX_TOKENS)
    path = cluster_yaml(tmp_path / "cluster.yaml", hosts, sshd, ckpt, keys)
    launch = Proc("launch", [sys.executable, "-m", "tandem.cli", "launch", path], tmp_path)
    try:
        ready = json.loads(launch.wait_for(r"tandem-up-ready (\{.*\})", timeout=240).group(1))
        r = hosts.hosts[0]
        assert ready["http"] == f"http://{r.addr}:8000" and ready["grpc"] == f"{r.addr}:50051"
        assert len(ready["workers"]) == 3
        assert generate_all(ready["grpc"], PROMPTS) == expected
        for host in hosts.hosts:  # every tandem process binds only its host's address
            bound = [a.replace("[::ffff:", "").replace("]", "") for a in hosts.listening(host)]
            assert bound and all(a.startswith(f"{host.addr}:") for a in bound), (host.ns, bound)
        running = tandem_pids(hosts)
        assert all(running[h.ns] for h in hosts.hosts), running  # one process per host, each on its own host
        launch.popen.send_signal(signal.SIGTERM)
        assert launch.popen.wait(60) == 0
        assert tandem_pids(hosts) == {h.ns: [] for h in hosts.hosts}  # the ssh tethers took them all down
    finally:
        launch.stop()


def test_preflight_refuses_an_unreachable_host_and_one_without_tandem(net, ckpt, keys, tmp_path):
    hosts, sshd = net
    ghost = f"{hosts.subnet}.99"  # on the subnet, no host there
    bad_hosts = [{"host": hosts.hosts[1].addr, "prefill": {"count": 1}}, {"host": ghost, "decode": {"count": 1}}]
    path = cluster_yaml(tmp_path / "ghost.yaml", hosts, sshd, ckpt, keys, hosts=bad_hosts)
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "launch", path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "nothing was started" in done.stderr and f"hosts[1].decode: host {ghost} is unreachable over ssh" \
        in done.stderr, done.stderr
    assert tandem_pids(hosts) == {h.ns: [] for h in hosts.hosts}
    # an interpreter without tandem on the hosts (the system's, not the venv's)
    path = cluster_yaml(tmp_path / "nopkg.yaml", hosts, sshd, ckpt, keys, python="/usr/bin/python3")
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "launch", path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "cannot run tandem with /usr/bin/python3" in done.stderr, done.stderr
    assert "No module named 'tandem'" in done.stderr
    assert tandem_pids(hosts) == {h.ns: [] for h in hosts.hosts}
