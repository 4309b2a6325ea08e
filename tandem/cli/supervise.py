"""Child-process supervision shared by `tandem up` and `tandem launch`: start tethered children in
their own sessions, relay and remember their output, wait for their ready lines and for the router
to see every worker, print the endpoints, and keep serving: a worker that dies is reported with its
last lines and restarted (backoff 1, 2, 4 ... 30 s; at most MAX_RESTARTS in a row, a run of
HEALTHY_RUN_S resets the count) while the router serves with the survivors. Only the router's death,
or a worker that keeps dying, stops everything; so does a signal, in order.

A Supervisor is driven from the main thread; one reader thread per child drains its output (so a
chatty child never blocks on a full pipe) into a bounded tail plus, until it is ready, the list of
start-up lines the ready checks search.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

STOP_GRACE_S = 40.0  # SIGTERM -> SIGKILL: the services' default drain (30 s) and a margin
TAIL_LINES = 40  # a dead child's last lines, shown in the error report
MAX_RESTARTS = 5  # a worker that dies this many times in a row (each run shorter than HEALTHY_RUN_S) stops all
HEALTHY_RUN_S = 60.0
MAX_BACKOFF_S = 30.0


class ChildExited(RuntimeError):
    def __init__(self, name: str, code: int | None, tail: list[str]) -> None:
        super().__init__(f"{name} exited unexpectedly (exit code {code})")
        self.name, self.code, self.tail = name, code, tail


class Stopped(Exception):
    """Raised in the main thread by SIGINT / SIGTERM / SIGHUP: an orderly shutdown."""


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen
    env: dict[str, str] | None = None
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # consecutive restarts (reset by a run of HEALTHY_RUN_S)
    restart_at: float | None = None  # dead, to be started again at this time
    startup: list[str] = field(default_factory=list)  # every line until the child is ready
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready: bool = False
    reader: threading.Thread | None = None


class Supervisor:
    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.children: dict[str, Child] = {}
        self.restarts_total = 0
        self._cond = threading.Condition()
        self._print_lock = threading.Lock()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        # start_new_session: a terminal's Ctrl-C reaches only us, and killpg() reaches the child's
        # own children (ssh's, for remote ones). stdin=PIPE is the tether: it closes when we die.
        popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True, bufsize=0)
        child = Child(name, argv, popen, env)
        child.reader = threading.Thread(target=self._read, args=(child,), name=f"read-{name}", daemon=True)
        self.children[name] = child
        child.reader.start()
        return child

    def _read(self, child: Child) -> None:
        assert child.popen.stdout is not None
        for raw in _lines(child.popen.stdout.fileno()):
            line = raw.decode("utf-8", "replace")
            with self._cond:
                child.tail.append(line)
                if not child.ready:
                    child.startup.append(line)
                self._cond.notify_all()
            if self.echo:
                with self._print_lock:
                    print(f"[{child.name}] {line}", file=sys.stderr, flush=True)
        with self._cond:
            self._cond.notify_all()

    def check(self) -> None:
        """Raise ChildExited for the first child that is no longer running."""
        for child in self.children.values():
            code = child.popen.poll()
            if code is not None:
                if child.reader is not None:
                    child.reader.join(1.0)  # its last words
                raise ChildExited(child.name, code, list(child.tail))

    def keep_workers_up(self, label: str) -> None:
        """Serving: restart dead workers with backoff; ChildExited if the router died or a worker
        keeps dying (then everything stops)."""
        now = time.monotonic()
        for name, child in list(self.children.items()):
            if child.restart_at is not None:
                if now >= child.restart_at:
                    restarted = self.start(name, child.argv, child.env)
                    restarted.restarts, restarted.ready = child.restarts, True
                    self.restarts_total += 1
                continue
            code = child.popen.poll()
            if code is None:
                continue
            if child.reader is not None:
                child.reader.join(1.0)  # its last words
            if now - child.started_at >= HEALTHY_RUN_S:
                child.restarts = 0
            if name == "router" or child.restarts >= MAX_RESTARTS:
                raise ChildExited(name, code, list(child.tail))
            child.restarts += 1
            delay = min(MAX_BACKOFF_S, 2.0 ** (child.restarts - 1))
            child.restart_at = now + delay
            tail = "\n".join(f"    {line}" for line in list(child.tail)[-10:]) or "    (no output)"
            print(f"{label}: {name} exited (exit code {code}); its last output:\n{tail}\n{label}: restarting {name} "
                  f"in {delay:.0f}s (restart {child.restarts} of at most {MAX_RESTARTS} in a row); the router serves "
                  "with the other workers meanwhile", file=sys.stderr, flush=True)

    def wait_for(self, child: Child, patterns: list[str], timeout: float) -> list[re.Match]:
        """Wait until each regex matches a start-up line of `child` (MULTILINE), then mark it ready."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                text = "\n".join(child.startup)
                found = [re.search(p, text, re.MULTILINE) for p in patterns]
                if all(found):
                    child.ready, child.startup = True, []
                    return found  # type: ignore[return-value]
                self._cond.wait(0.1)
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} did not become ready within {timeout:.0f}s")

    def router_endpoints(self, child: Child, timeout: float) -> dict[str, str]:
        keys = ["http", "grpc", "listen", "metrics"]
        found = self.wait_for(child, [rf"^\s*{k}\s+(\S+)" for k in keys], timeout)
        return {k: m.group(1) for k, m in zip(keys, found)}

    def worker_ready(self, child: Child, role: str, timeout: float) -> dict:
        return json.loads(self.wait_for(child, [rf"tandem-{role}-ready (\{{.*\}})"], timeout)[0].group(1))

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop every child (they shut down in parallel), SIGKILL what is left after `grace`. A remote
        child (ssh) is stopped through its tether, not a signal: closing ssh's stdin reaches the remote
        process, which stops itself, and ssh exits when it has, so this returns only once remote
        processes are gone too (a SIGTERM would end ssh at once and leave the remote to stop unseen)."""
        force = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: force.set())  # a second Ctrl-C: stop waiting, kill
        for child in self.children.values():
            if child.argv[0] == "ssh":
                _close_tether(child)
            else:
                _signal(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.popen.poll() is None for c in self.children.values()):
            if force.is_set() or time.monotonic() > deadline:
                for child in self.children.values():
                    _signal(child, signal.SIGKILL)
                break
            time.sleep(0.05)
        for child in self.children.values():
            child.popen.wait()
            _close_tether(child)
            if child.reader is not None:
                child.reader.join(2.0)


def _lines(fd: int) -> Iterator[bytes]:
    """A child's output, line by line (without the newline), as the pipe delivers it. Read in chunks: the
    unbuffered pipe's readline() read one byte per system call, ~0.6 ms of CPU per relayed log line (with
    two lines a request, `tandem up --colocated` served 1-token requests at 8.5 ms p50 instead of ~5)."""
    rest = b""
    while chunk := os.read(fd, 65536):
        *lines, rest = (rest + chunk).split(b"\n")
        yield from lines
    if rest:
        yield rest


def _close_tether(child: Child) -> None:
    if child.popen.stdin is not None and not child.popen.stdin.closed:
        try:
            child.popen.stdin.close()
        except OSError:
            pass  # ssh already gone


def _signal(child: Child, sig: int) -> None:
    if child.popen.poll() is None:
        try:
            os.killpg(child.popen.pid, sig)
        except ProcessLookupError:
            pass


def wait_healthy(sup: Supervisor, http: str, decode: int, prefill: int, timeout: float) -> dict:
    """Poll the router's /health until it counts exactly the expected live workers."""
    deadline, health = time.monotonic() + timeout, {}
    want = {"decode": decode, "prefill": prefill}
    while time.monotonic() < deadline:
        sup.check()
        try:
            # our own child on loopback: a self-signed certificate is expected, not an attack
            context = ssl._create_unverified_context() if http.startswith("https") else None
            with urllib.request.urlopen(f"{http}/health", timeout=5, context=context) as r:
                health = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 503 until a decode worker is live; same JSON body
            health = json.loads(e.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if health.get("live_workers") == want:
            return health
        time.sleep(0.2)
    raise TimeoutError(f"the router at {http} never saw {want} live workers (last /health: {health})")


def run_supervised(sup: Supervisor, start_all: Callable[[], dict], label: str, summary: str) -> int:
    """Start everything, print the endpoints, serve until a signal (exit 0) or a child's death (exit 1)."""
    def _stop(signum, _frame):
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    try:
        info = start_all()
        print_ready(label, summary, info)
        while True:
            sup.keep_workers_up(label)
            time.sleep(0.2)
    except Stopped as exc:
        print(f"{label}: {exc}, stopping {len(sup.children)} processes", file=sys.stderr, flush=True)
        return 0
    except ChildExited as exc:
        tail = "\n".join(f"    {line}" for line in exc.tail) or "    (no output)"
        print(f"{label}: error: {exc}; its last output:\n{tail}\n{label}: stopping the others",
              file=sys.stderr, flush=True)
        return 1
    except TimeoutError as exc:
        print(f"{label}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        sup.stop()


def print_ready(label: str, summary: str, info: dict) -> None:
    http, grpc_target, model = info["http"], info["grpc"], info.get("model", "")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "def fibonacci(n):"}],
                       "max_tokens": 64})
    lines = [f"{label}: serving {model!r} with {summary}",
             f"  http     {http}   OpenAI API: /v1/chat/completions /v1/completions /v1/models, /health",
             f"  grpc     {grpc_target}   tandem.v1.Generation (try: tandem chat --url {grpc_target})"]
    metrics = {"router": info["metrics"]} if info.get("metrics") else {}
    metrics.update({n: w["metrics"] for n, w in info.get("workers", {}).items() if w.get("metrics")})
    if metrics:
        lines.append("  metrics  " + "  ".join(f"{n}={url}" for n, url in metrics.items()))
    curl = f"curl -N {http}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"
    lines += ["  try:", f"    {curl}",
              "Ctrl-C stops everything.",
              "tandem-up-ready " + json.dumps({"http": http, "grpc": grpc_target, "model": model, "metrics": metrics,
                                               "workers": info.get("workers", {})})]
    print("\n".join(lines), flush=True)
