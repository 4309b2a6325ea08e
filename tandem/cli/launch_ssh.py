"""How `tandem launch` reaches remote hosts: the ssh command line of each process, and the preflight
that runs before anything starts.

Preflight: every remote host (each distinct ssh target + interpreter) is asked, in parallel, to run
`python -c "import tandem; print(tandem.__version__)"` over the same ssh options the processes will
use. A host that does not answer (no route, refused, no key, timeout), has no tandem, or has another
tandem version than this one is an error that names it, before any process starts anywhere: never a
half-started cluster left running.
"""

from __future__ import annotations

import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PREFLIGHT_TIMEOUT_S = 20.0  # ssh connect + a Python start that imports tandem (no torch)
PROBE = "import sys, tandem; sys.stdout.write(tandem.__version__)"


def ssh_prefix(host: str, entry: dict[str, Any], ssh: dict[str, Any]) -> list[str]:
    """`ssh ... user@host`: what runs a command on `host` (BatchMode: never wait on a password prompt)."""
    user = entry.get("user", ssh.get("user"))
    port = ["-p", str(ssh["port"])] if "port" in ssh else []
    return ["ssh", "-T", "-o", "BatchMode=yes", *port, *ssh["options"], f"{user}@{host}" if user else host]


def remote_python(entry: dict[str, Any], ssh: dict[str, Any]) -> str:
    return entry.get("python", ssh.get("python", "python3"))


def remote_command(host: str, entry: dict[str, Any], ssh: dict[str, Any], tandem_args: list[str],
                   env: dict[str, str]) -> list[str]:
    """The ssh argv that runs `python -m tandem.cli.up ARGS` on `host`, tethered to ssh's stdin."""
    remote = ["exec", *(["env", *(f"{k}={v}" for k, v in env.items())] if env else []),
              remote_python(entry, ssh), "-m", "tandem.cli.up", *tandem_args]
    return [*ssh_prefix(host, entry, ssh), shlex.join(remote)]


def preflight(targets: list[tuple[str, str, list[str], str]], version: str) -> None:
    """`targets`: (where, host, ssh prefix, python) per remote process. Raises ValueError naming
    every host that cannot run this tandem version; returns when all can."""
    unique = {(tuple(prefix), python): (where, host) for where, host, prefix, python in targets}

    def probe(key: tuple[tuple[str, ...], str]) -> str | None:
        (prefix, python), (where, host) = key, unique[key]
        argv = [*prefix[:-1], "-o", f"ConnectTimeout={int(PREFLIGHT_TIMEOUT_S // 2)}", prefix[-1],
                shlex.join([python, "-c", PROBE])]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"{where}: host {host} did not answer over ssh in {PREFLIGHT_TIMEOUT_S:.0f} s"
        except FileNotFoundError:
            return f"{where}: host {host} is remote, and this machine has no `ssh` client"
        said = (done.stderr.strip().splitlines() or [""])[-1]
        if done.returncode == 255:  # ssh's own failure: the host, not the command
            return f"{where}: host {host} is unreachable over ssh: {said or 'ssh exited 255'}"
        if done.returncode != 0:
            return f"{where}: host {host} cannot run tandem with {python}: {said or f'exit {done.returncode}'}"
        if done.stdout.strip() != version:
            return f"{where}: host {host} has tandem {done.stdout.strip()!r}, this one is {version!r}: install the same"
        return None

    with ThreadPoolExecutor(max_workers=min(16, len(unique) or 1)) as pool:
        problems = [p for p in pool.map(probe, list(unique)) if p]
    if problems:
        raise ValueError("cannot launch, nothing was started: " + "; ".join(problems))
