"""Graceful drain on SIGTERM (real router and decode workers on loopback, the shipped model).

- A decode worker that gets SIGTERM mid-stream finishes the stream, takes no new request (the router
  sends it elsewhere), deregisters (gone from the registry at once, not counted as lost) and exits 0.
- A router that gets SIGTERM answers new requests with 503, lets the stream in flight finish, and
  exits 0.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from service_procs import (
    get_json,
    metric_value,
    post,
    router_endpoints,
    start_colocated_decode,
    start_router,
    stop_all,
    stream_completion_text,
    wait_workers,
)

from tandem.default_model import ASSETS_DIR, TARGET_NAME

pytestmark = pytest.mark.slow
TARGET_DIR = ASSETS_DIR / TARGET_NAME
PROMPT = "import os\nimport sys\n\n\ndef main():\n"
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def expected() -> str:
    from tandem import LLM, SamplingParams

    llm = LLM(str(TARGET_DIR))  # the server applies the checkpoint's generation_config defaults: so do we
    params = SamplingParams(**{**llm.sampling_defaults, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    return llm.generate([PROMPT], params)[0].text


def test_sigterm_drains_a_decode_worker(tmp_path, expected):
    router = start_router("router", str(TARGET_DIR), tmp_path)
    procs = [router]
    try:
        ep = router_endpoints(router)
        workers = {name: start_colocated_decode(name, ep["listen"], tmp_path, delay=0.02) for name in ("d1", "d2")}
        procs += workers.values()
        wait_workers(ep["http"], decode=2)
        terminated: list[str] = []

        def on_chunk(n: int) -> None:
            if n == 10:
                _, health = get_json(f"{ep['http']}/health")
                busy = [w["worker_id"] for w in health["workers"] if w["role"] == "decode" and w["inflight"]]
                terminated.append(busy[0])
                workers[busy[0]].popen.send_signal(signal.SIGTERM)

        text, error = stream_completion_text(ep["http"], PROMPT, MAX_TOKENS, on_chunk)
        assert error is None and text == expected  # finished where it started: no migration needed
        assert metric_value(ep["http"], "tandem_router_migrations_total") == 0
        draining = workers[terminated[0]]
        assert draining.popen.wait(30) == 0
        time.sleep(0.3)
        _, health = get_json(f"{ep['http']}/health")
        assert [w["worker_id"] for w in health["workers"]] == [n for n in workers if n != terminated[0]]
        assert metric_value(ep["http"], "tandem_router_workers_lost_total") == 0  # it left; it was not lost
        assert "draining: finishing the requests in flight" in draining.log.read_text()
    finally:
        stop_all(procs)


def test_sigterm_drains_the_router(tmp_path, expected):
    router = start_router("router", str(TARGET_DIR), tmp_path)
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs.append(start_colocated_decode("d1", ep["listen"], tmp_path, delay=0.02))
        wait_workers(ep["http"], decode=1)
        refused: list[int] = []

        def on_chunk(n: int) -> None:
            if n == 10:
                router.popen.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                status, _, body = post(f"{ep['http']}/v1/completions", {"model": "tiny-target", "prompt": "x"})
                refused.append(status)

        result: dict = {}
        t = threading.Thread(target=lambda: result.update(
            r=stream_completion_text(ep["http"], PROMPT, MAX_TOKENS, on_chunk)))
        t.start()
        t.join(60)
        text, error = result["r"]
        assert error is None and text == expected
        assert refused == [503]
        assert router.popen.wait(30) == 0
    finally:
        stop_all(procs)


def _catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sigterm_stops_a_worker_that_is_pid_1_while_it_starts():
    """A container's entrypoint is PID 1 of its pid namespace (Kubernetes runs tandem so), and the kernel
    drops a signal PID 1 has no handler for: without one installed from the start, SIGTERM during
    startup would be ignored until the grace period's SIGKILL."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode:
        pytest.skip("needs unshare --pid (util-linux, root) to run a process as PID 1 of a namespace")
    # no router answers at port 1: the worker stays in its startup (model load, then registration)
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "tandem.cli",
                             "prefill", "--router", "tcp://127.0.0.1:1", "--listen", "tcp://127.0.0.1:0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        child = None
        while child is None and time.monotonic() < deadline:  # the namespace's PID 1, as we see it
            out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            child = int(out[0]) if out else None
            time.sleep(0.05)
        assert child is not None
        # Send once the worker catches SIGTERM (/proc's SigCgt): a fixed 1 s wait raced the interpreter's
        # start under load (another test worker's processes on the cores), and the kernel drops a signal
        # PID 1 does not catch yet — the failure this test looks for, but not a product's.
        while time.monotonic() < deadline + 20 and not _catches_sigterm(child):
            time.sleep(0.05)
        assert _catches_sigterm(child), "the starting worker never installed a SIGTERM handler"
        sent = time.monotonic()
        subprocess.run(["kill", "-TERM", str(child)], check=True)
        assert proc.wait(timeout=15) is not None, "SIGTERM to a starting worker as PID 1 was ignored"
        assert time.monotonic() - sent < 5
    finally:
        proc.kill()
        proc.wait()
