"""Alive, slow and hung are three things (real router and decode workers on loopback).

- A worker whose engine step takes 10 s keeps its registration and finishes its stream; while it is
  stalled, a new request goes to another worker.
- A worker whose step never returns is declared hung after the router's --hung-timeout: its stream
  ends with a clear error, it stops getting requests, the other worker serves.
- SIGKILL and SIGSTOP are noticed within ~2 s; a SIGCONTed worker comes back.

The stall is injected by a `sitecustomize` module put on the PYTHONPATH of one worker process only
(service_procs.step_hook_env): it wraps `LLMEngine.step` so that step number N sleeps (tandem's own
code has no test hook).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import pytest
from service_procs import (
    get_json,
    metric_value,
    router_endpoints,
    start_colocated_decode,
    start_router,
    stop_all,
    wait_workers,
)

from tandem.default_model import ASSETS_DIR, TARGET_NAME

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

TARGET_DIR = ASSETS_DIR / TARGET_NAME

HEALTH_POLL_S = 0.1


def stream_completion(http: str, prompt: str, max_tokens: int) -> tuple[list[str], str | None, float]:
    """(text pieces, error message or None, seconds) of one streamed completion."""
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    pieces, error, t0 = [], None, time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            else:
                pieces += [c["text"] for c in event["choices"] if c.get("text")]
    return pieces, error, time.monotonic() - t0


class HealthWatch:
    """Polls the router's /health in the background: the fewest live decode workers it saw, and
    the longest loop_age_s it saw reported for a worker."""

    def __init__(self, http: str) -> None:
        self.http, self.min_live, self.max_loop_age = http, 99, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            _, health = get_json(f"{self.http}/health")
            self.min_live = min(self.min_live, health["live_workers"]["decode"])
            for w in health.get("workers", []):
                self.max_loop_age = max(self.max_loop_age, w.get("loop_age_s", 0.0))
            time.sleep(HEALTH_POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def logs(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    return d


def _wait_stalled(http: str, worker_id: str, timeout: float = 60.0) -> None:
    """Until the router reports `worker_id`'s engine loop as late as a slow worker's (STALLED_S = 2 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, health = get_json(f"{http}/health")
        if any(w["worker_id"] == worker_id and w.get("loop_age_s", 0.0) > 2.5 for w in health.get("workers", [])):
            return
        time.sleep(HEALTH_POLL_S)
    raise AssertionError(f"{worker_id} never stalled: {health}")


def test_slow_step_keeps_registration_and_stream_and_sheds_new_requests(logs):
    """The stall lasts at least 10 s and until the test releases it, after the second worker has
    registered and served a request: no race between the stall and another process's start-up."""
    router = start_router("router", str(TARGET_DIR), logs)
    release = logs / "release-slow"
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs.append(start_colocated_decode("slow", ep["listen"], logs, stall="4:10", release=release))
        wait_workers(ep["http"], decode=1)
        watch = HealthWatch(ep["http"])
        result: dict = {}
        slow = threading.Thread(target=lambda: result.update(a=stream_completion(ep["http"], "import os\n", 16)))
        slow.start()
        procs.append(start_colocated_decode("ok", ep["listen"], logs))  # registers while "slow" is stalled
        wait_workers(ep["http"], decode=2)
        _wait_stalled(ep["http"], "slow")
        pieces_b, error_b, seconds_b = stream_completion(ep["http"], "def main():\n", 16)
        assert "a" not in result, "the stalled request finished before the stall was released"
        release.touch()
        slow.join(60)
        watch.stop()
        pieces_a, error_a, seconds_a = result["a"]
        assert error_a is None and len(pieces_a) == 16, (error_a, pieces_a)
        assert seconds_a >= 10, "the step did not stall"
        assert error_b is None and len(pieces_b) == 16
        assert seconds_b < seconds_a
        assert watch.min_live >= 1 and watch.max_loop_age > 2.0, (watch.min_live, watch.max_loop_age)
        assert metric_value(ep["http"], "tandem_router_workers_lost_total") == 0
        assert metric_value(ep["http"], "tandem_router_workers_hung_total") == 0
        assert '"decode": "ok"' in router.log.read_text() or "decode=ok" in router.log.read_text()
    finally:
        stop_all(procs)


def test_step_that_never_returns_is_hung_after_the_timeout(logs):
    """The hung worker's stream moves to the other worker (migration) once the hung timeout passes;
    it is kept out of routing, counted, and listed as hung. Both workers are up before the request:
    round robin over the workers sorted by id sends the first request to "hung"."""
    router = start_router("router", str(TARGET_DIR), logs, "--hung-timeout", "15", "--decode-policy", "round_robin")
    procs = [router]
    try:
        ep = router_endpoints(router)
        hung = start_colocated_decode("hung", ep["listen"], logs, stall="4:3600")
        procs += [hung, start_colocated_decode("ok", ep["listen"], logs)]
        wait_workers(ep["http"], decode=2)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(a=stream_completion(ep["http"], "import os\n", 16)))
        t.start()
        t.join(90)
        pieces, error, seconds = result["a"]
        assert error is None and len(pieces) == 16, (error, pieces)
        assert 15 <= seconds < 45, seconds
        _, health = get_json(f"{ep['http']}/health")
        hung_entry = [w for w in health["workers"] if w["worker_id"] == "hung"]
        assert hung_entry and hung_entry[0]["hung"] and not hung_entry[0]["alive"], health
        assert metric_value(ep["http"], "tandem_router_workers_hung_total") == 1
        assert metric_value(ep["http"], "tandem_router_migrations_total") == 1
        assert health["live_workers"]["decode"] == 1  # "ok"; the hung one is not counted
        pieces, error, _ = stream_completion(ep["http"], "def main():\n", 8)
        assert error is None and len(pieces) == 8
        hung.popen.kill()
    finally:
        stop_all(procs)


def _seconds_until_live(http: str, decode: int, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        _, health = get_json(f"{http}/health")
        if health["live_workers"]["decode"] == decode:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the router still counts {health['live_workers']} after {timeout}s")


def test_sigkill_and_sigstop_are_noticed_within_2s(logs):
    router = start_router("router", str(TARGET_DIR), logs)
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs += [start_colocated_decode("d1", ep["listen"], logs), start_colocated_decode("d2", ep["listen"], logs)]
        wait_workers(ep["http"], decode=2)
        procs[1].popen.kill()
        assert _seconds_until_live(ep["http"], 1) < 2.5
        procs[2].popen.send_signal(signal.SIGSTOP)
        try:
            assert _seconds_until_live(ep["http"], 0) < 2.5
        finally:
            procs[2].popen.send_signal(signal.SIGCONT)
        assert _seconds_until_live(ep["http"], 1) < 5  # back: it registers again
    finally:
        stop_all(procs)
