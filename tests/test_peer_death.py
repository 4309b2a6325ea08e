"""A decode worker notices a dead prefill worker in ~2 s, not after --prefill-timeout, and recomputes
the prompt itself; a prefill worker that is only slow keeps its work (real router, P and D processes).

P's first prefill step is made to take long (a `sitecustomize` hook, service_procs.step_hook_env),
the request is in flight on it, then P is SIGKILLed or SIGSTOPped: the answer arrives within a few
seconds, identical to the offline engine's, though --prefill-timeout is 30 s.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from service_procs import (
    Proc,
    post,
    router_endpoints,
    start_router,
    step_hook_env,
    stop_all,
    wait_workers,
    worker_stats,
)

from tandem.default_model import ASSETS_DIR, TARGET_NAME

pytestmark = pytest.mark.slow
TARGET_DIR = ASSETS_DIR / TARGET_NAME
PROMPT = "class Config:\n    def __init__(self, path):\n        self.path = path\n"
MAX_TOKENS = 16


def start(role: str, name: str, router: str, logs: Path, *flags: str, env: dict | None = None) -> Proc:
    return Proc(name, [sys.executable, "-m", "tandem.cli", role, "--model", str(TARGET_DIR), "--listen",
                       "tcp://127.0.0.1:0", "--router", router, "--worker-id", name, "--num-kv-blocks", "256",
                       "--kv-connector", "zmq", *flags], logs, env)


def start_pair(ep: dict, tmp_path: Path, stall: str, procs: list) -> tuple[Proc, Proc]:
    """P (its steps slowed by `stall`, see service_procs.step_hook_env) and D, registered; both added to procs."""
    prefill = start("prefill", "p", ep["listen"], tmp_path, env=step_hook_env(tmp_path / "hook", stall=stall))
    decode = start("decode", "d", ep["listen"], tmp_path, "--local-prefill-threshold", "0", "--prefill-timeout", "30")
    procs += [prefill, decode]
    wait_workers(ep["http"], decode=1, prefill=1)
    return prefill, decode


@pytest.fixture(scope="module")
def expected() -> str:
    from tandem import LLM, SamplingParams

    llm = LLM(str(TARGET_DIR))  # with the checkpoint's generation_config defaults, as the server applies them
    return llm.generate([PROMPT], SamplingParams(**{**llm.sampling_defaults, "temperature": 0,
                                                    "max_tokens": MAX_TOKENS}))[0].text


@pytest.mark.parametrize("fate", ["sigkill", "sigstop", "slow"])
def test_decode_worker_outlives_its_prefill_peer(tmp_path, expected, fate):
    stall = "1:4" if fate == "slow" else "1:120"
    router = start_router("router", str(TARGET_DIR), tmp_path)
    procs = [router]
    try:
        ep = router_endpoints(router)
        prefill, decode = start_pair(ep, tmp_path, stall, procs)
        d_control = decode.wait_for(r'tandem-decode-ready \{"control": "([^"]+)"').group(1)
        body = {"model": "tiny-target", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=post(f"{ep['http']}/v1/completions", body)))
        t0 = time.monotonic()
        t.start()
        time.sleep(1.5)  # the prefill request is on P now, stalled in its first step
        if fate == "sigkill":
            prefill.popen.kill()
        elif fate == "sigstop":
            prefill.popen.send_signal(signal.SIGSTOP)
        t.join(60)
        elapsed = time.monotonic() - t0
        if fate == "sigstop":
            prefill.popen.send_signal(signal.SIGCONT)
        status, _, out = result["r"]
        assert status == 200 and out["choices"][0]["text"] == expected, out
        stats = worker_stats(d_control)
        assert stats["remote_prefills"] == 1
        if fate == "slow":
            assert stats["fallbacks"] == 0 and elapsed >= 4  # waited for the slow peer
        else:
            assert stats["fallbacks"] == 1 and "disconnected" in stats["last_fallback_reason"]
            assert elapsed < 8, f"took {elapsed:.1f}s: the dead peer was noticed late"
    finally:
        stop_all(procs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prefill_worker_handshakes_again_with_a_restarted_decode_worker(tmp_path, expected):
    """D restarted at the same control and KV addresses: P's old handshake is stale, P notices the
    new receiver instance and handshakes again, so the prompt still comes from P (no fallback)."""
    router = start_router("router", str(TARGET_DIR), tmp_path)
    procs = [router]
    try:
        ep = router_endpoints(router)
        procs.append(start("prefill", "p", ep["listen"], tmp_path))
        control, kv = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
        body = {"model": "tiny-target", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        for life in range(2):
            decode = Proc(f"d{life}", [sys.executable, "-m", "tandem.cli", "decode", "--model", str(TARGET_DIR),
                                       "--listen", control, "--kv-listen", kv, "--router", ep["listen"],
                                       "--worker-id", "d", "--num-kv-blocks", "256", "--kv-connector", "zmq",
                                       "--local-prefill-threshold", "0"], tmp_path)
            procs.append(decode)
            wait_workers(ep["http"], decode=1, prefill=1)
            status, _, out = post(f"{ep['http']}/v1/completions", {**body, "prompt": f"# {life}\n{PROMPT}"})
            assert status == 200, out
            stats = worker_stats(control)
            assert (stats["remote_prefills"], stats["fallbacks"]) == (1, 0), stats
            if life == 0:
                decode.popen.kill()
                decode.popen.wait()
                wait_workers(ep["http"], decode=0, prefill=1)
    finally:
        stop_all(procs)


def test_prefill_worker_frees_blocks_lent_to_a_lost_decode_worker(tmp_path):
    """D stops (SIGSTOP) while its prompt waits on P, so P's push of that prompt is never acknowledged. The
    router declares D lost after ~2 s and tells P (`decode_lost`), which drops its link to D's receiver and
    with it the blocks lent to the transfer — within seconds, not after its 60 s hold timeout."""
    router = start_router("router", str(TARGET_DIR), tmp_path)
    procs = [router]
    decode = None
    try:
        ep = router_endpoints(router)
        # P's second step (the second prompt's) waits 3 s first: D is stopped meanwhile
        prefill, decode = start_pair(ep, tmp_path, "2:3", procs)
        p_control = prefill.wait_for(r'tandem-prefill-ready \{"control": "([^"]+)"').group(1)
        body = {"model": "tiny-target", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        status, _, out = post(f"{ep['http']}/v1/completions", body)
        assert status == 200, out
        assert worker_stats(p_control)["kv_blocks_used"] == 0  # a transfer D acknowledged gives its blocks back
        t = threading.Thread(target=lambda: post(f"{ep['http']}/v1/completions", {**body, "prompt": f"# 2\n{PROMPT}"}))
        t.start()
        time.sleep(1.0)  # the second prompt is on P, its step stalled
        assert worker_stats(p_control)["kv_blocks_used"] > 0
        decode.popen.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        used = -1
        while time.monotonic() - stopped < 20:
            used = worker_stats(p_control)["kv_blocks_used"]
            if time.monotonic() - stopped > 4 and used == 0:  # past P's step (at ~2 s) and D's expiry (~2 s)
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - stopped
        assert used == 0 and elapsed < 10, f"P still holds {used} blocks {elapsed:.1f}s after D stopped"
        assert "decode worker lost: dropping its KV link" in prefill.log.read_text()
        t.join(30)
    finally:
        if decode is not None:
            decode.popen.send_signal(signal.SIGCONT)
        stop_all(procs)
