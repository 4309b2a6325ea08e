"""bench/interference's worker processes: spawn `python -m tandem.cli` workers, wait for them, pin
every thread to a core set once ready, a busy-loop burner for the control phase, and stop them all.
Their CPU time and run-queue wait come from /proc."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@dataclass
class Worker:
    name: str
    popen: subprocess.Popen
    log: Path
    cores: set[int] | None
    control: str = ""

    def cpu_seconds(self) -> float:
        """user + system CPU time so far (all threads), from /proc."""
        try:
            fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def runqueue_wait_seconds(self) -> float:
        """Time its main thread (the one that runs the engine steps) spent runnable but waiting for a
        CPU (schedstat field 2): on a shared box, what other jobs took from it; pinning cannot prevent it."""
        try:
            return int(Path(f"/proc/{self.popen.pid}/schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0


def _child_setup() -> None:
    """Runs in the child before exec: have the kernel SIGTERM it if the bench dies without cleaning
    up (PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def spawn(name: str, role: str, model: str, log_dir: Path, cores: set[int] | None, flags: list[str]) -> Worker:
    log = log_dir / f"{name}.log"
    args = [sys.executable, "-m", "tandem.cli", role, "--model", model, "--listen", "tcp://127.0.0.1:0", *flags]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        popen = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
    return Worker(name, popen, log, cores)


def pin(w: Worker, cores: set[int] | None) -> None:
    """Pin every thread of a ready worker; threads it creates later inherit their creator's mask.
    Pinning only once it is ready lets the workers start (imports, model load) on both cores."""
    if not cores:
        return
    tasks = lambda: Path(f"/proc/{w.popen.pid}/task").glob("*")  # noqa: E731
    for _ in range(2):  # again, in case a thread appeared while the first pass ran
        for task in tasks():
            try:
                os.sched_setaffinity(int(task.name), cores)
            except ProcessLookupError:
                pass  # the thread just exited
    bad = [t.name for t in tasks() if os.sched_getaffinity(int(t.name)) != cores]
    if bad:
        raise RuntimeError(f"{w.name}: threads {bad} are not pinned to {cores}")


def wait_ready(w: Worker, role: str, park: set[int] | None, timeout: float = 240) -> None:
    """Wait for the ready line, then park the worker on `park` until its setup runs (see main)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(rf"tandem-{role}-ready (\{{.*\}})", w.log.read_text())
        if m:
            w.control = json.loads(m.group(1))["control"]
            pin(w, park)
            return
        if w.popen.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{w.name} never became ready; log tail:\n{w.log.read_text()[-3000:]}")


def burner(cores: set[int] | None) -> subprocess.Popen:
    """A busy loop pinned where P runs: the control phase's stand-in for a busy P that sends D nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_child_setup)
    if cores:
        os.sched_setaffinity(proc.pid, cores)
    return proc


def stop(workers: list[Worker], timeout: float = 20) -> None:
    """SIGTERM all (a worker finishes its current step, possibly a long prefill), then SIGKILL stragglers."""
    for w in workers:
        if w.popen.poll() is None:
            w.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            w.popen.kill()
            w.popen.wait()
