"""Network-namespace "hosts" for multi-host tests: N namespaces on one Linux bridge, each with its own
address on a private /24 (10.77.K.i, never loopback), a command runner inside a host, a link that
can be cut and restored like a pulled cable, and cleanup that always runs.

Layout (one `Hosts` instance, the k-th this process made; K is derived from the pid and k so that
collide):

    root namespace (the test, the client, `ssh`) ── bridge tb<pid>x<k> 10.77.K.254/24
        ├── veth tv<pid>x<k>h1 ══ eth0 in namespace tnd<pid>x<k>h1   10.77.K.1/24
        ├── veth tv<pid>x<k>h2 ══ eth0 in namespace tnd<pid>x<k>h2   10.77.K.2/24
        └── ...

`cut(i)` sets the bridge side of host i's veth pair down: inside the namespace eth0 keeps its address
and route but loses carrier, so packets are silently dropped in both directions — what a dead switch
port looks like to TCP (no RST, no ENETUNREACH), unlike setting eth0 itself down.

Cleanup: `close()` kills every process still running in the namespaces (only ours: nothing else
runs there), deletes the namespaces (which deletes the veth pairs) and the bridge; it runs from the
context manager, from atexit, and `reap_stale()` removes what a SIGKILLed earlier test process left.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

PREFIX = "tnd"  # namespace names: tnd<pid>x<k>h<i>; bridge tb<pid>x<k>; veths tv<pid>x<k>h<i> (IFNAMSIZ is 15)


def unavailable() -> str | None:
    """Why these hosts cannot be made here (None: they can): root and `ip netns` are needed."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns, veth, bridge)"
    if shutil.which("ip") is None:
        return "network-namespace hosts need iproute2's `ip`"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def reachable(addr: str, port: int = 9, timeout: float = 0.5) -> bool:
    """Does `addr` answer a TCP connect (accepted or refused) from here? (No ping on the CI image.)"""
    try:
        socket.create_connection((addr, port), timeout).close()
        return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reap_stale() -> None:
    """Remove namespaces and bridges of earlier test processes that no longer exist."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    for ns in names:
        tag = ns[len(PREFIX):].split("x")[0]
        if ns.startswith(PREFIX) and tag.isdigit() and not _pid_alive(int(tag)):
            _kill_in(ns)
            _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        tag = name[2:].split("x")[0]
        if name.startswith("tb") and tag.isdigit() and not _pid_alive(int(tag)):
            _ip("link", "del", name, check=False)


def _kill_in(ns: str) -> None:
    """SIGKILL whatever still runs in namespace `ns` (the test started all of it)."""
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@dataclass(frozen=True)
class Host:
    index: int  # 1-based
    ns: str
    addr: str  # its own address on the bridge network
    veth: str  # the bridge side of its cable (what cut/restore switch)


class Hosts:
    """`with Hosts(4) as net:` — net.hosts[0].addr is 10.77.K.1; net.gateway is the root namespace's."""

    _made = 0  # instances made by this process

    def __init__(self, n: int) -> None:
        # Names and subnet are new for every instance: the kernel frees a deleted namespace's veth
        # asynchronously, so reusing a name right after close() fails with "File exists".
        pid, k = os.getpid(), Hosts._made
        Hosts._made += 1
        tag = f"{pid}x{k}"
        self.subnet = f"10.77.{(pid + 17 * k) % 250}"
        self.bridge = f"tb{tag}"
        self.gateway = f"{self.subnet}.254"  # the root namespace's address: where the test client sits
        self.hosts = [Host(i, f"{PREFIX}{tag}h{i}", f"{self.subnet}.{i}", f"tv{tag}h{i}") for i in range(1, n + 1)]
        self._closed = False
        reap_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("link", "set", h.veth, "master", self.bridge)
            _ip("link", "set", h.veth, "up")
            self.ip(h, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            self.ip(h, "link", "set", "eth0", "up")
            self.ip(h, "link", "set", "lo", "up")  # ZMQ and Python expect a working loopback
        for h in self.hosts:  # the bridge must forward before anything runs (br_netfilter, STP delay)
            self.wait_reachable(h)

    def ip(self, host: Host, *args: str) -> subprocess.CompletedProcess:
        return _ip("-n", host.ns, *args)

    def argv(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` as it runs on `host` (for subprocess.Popen / service_procs.Proc)."""
        return ["ip", "netns", "exec", host.ns, *argv]

    def run(self, host: Host, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True, timeout=timeout)

    def wait_reachable(self, host: Host, timeout: float = 10) -> None:
        """Until a TCP connect to `host` gets an answer (a refusal counts: the packets got there)."""
        deadline = time.monotonic() + timeout
        while not reachable(host.addr):
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {host.ns} ({host.addr}) does not answer over bridge {self.bridge}")
            time.sleep(0.1)

    def cut(self, host: Host) -> None:
        """Pull host's cable: its packets (both ways) are dropped from now on."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def listening(self, host: Host) -> list[str]:
        """Local addresses of the TCP sockets listening on `host` (e.g. '10.77.3.2:6000')."""
        out = self.run(host, ["ss", "-Hltn"]).stdout
        return sorted(line.split()[3] for line in out.splitlines() if line.strip())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            _kill_in(h.ns)
            _ip("netns", "del", h.ns, check=False)  # takes the veth pair with it
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sshd:
    """An sshd on each host's own address (port 22), root login by a key made here: what `tandem
    launch` needs of a remote host. `options` are the ssh client arguments that reach them."""

    def __init__(self, net: Hosts, workdir: str) -> None:
        self.net, self.dir, self.procs = net, workdir, []
        key, host_key = os.path.join(workdir, "id"), os.path.join(workdir, "host_key")
        for path in (key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
        shutil.copy(key + ".pub", os.path.join(workdir, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for h in net.hosts:
            config = os.path.join(workdir, f"sshd-{h.index}.conf")
            with open(config, "w") as f:
                f.write(f"ListenAddress {h.addr}\nPort 22\nHostKey {host_key}\n"
                        f"AuthorizedKeysFile {workdir}/authorized_keys\nPermitRootLogin prohibit-password\n"
                        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        f"PidFile {workdir}/sshd-{h.index}.pid\n")
            self.procs.append(subprocess.Popen(net.argv(h, [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e",
                                                            "-f", config]),
                                               stdout=subprocess.DEVNULL, stderr=open(config + ".log", "w")))
        self.options = ["-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                        "-o", "LogLevel=ERROR"]
        for h in net.hosts:  # until each answers a command
            deadline = time.monotonic() + 15
            while subprocess.run(["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", *self.options,
                                  f"root@{h.addr}", "true"], capture_output=True).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {h.addr} does not answer: see {workdir}/sshd-{h.index}.conf.log")
                time.sleep(0.2)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def sshd_unavailable() -> str | None:
    missing = [tool for tool in ("sshd", "ssh", "ssh-keygen") if shutil.which(tool) is None
               and not (tool == "sshd" and os.path.exists("/usr/sbin/sshd"))]
    return f"`tandem launch` over ssh needs OpenSSH: missing {', '.join(missing)}" if missing else None
