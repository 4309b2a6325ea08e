"""Chaos soak: `tandem up` under steady streaming load while its workers are SIGKILLed at random.

    python -m bench.chaos [--model DIR] [--prefill 2] [--decode 2] [--clients 4] [--seconds 600]
                          [--kill-every 30] [--stop-share 0.3] [--stop-seconds 5] [--seed 0] [--out FILE]
                          [--up-arg=ARG ...]

Starts `tandem up` (workers restart themselves under its supervision), keeps `--clients` greedy
streaming completions in flight over the OpenAI HTTP API, and every `--kill-every` seconds faults
one worker process chosen at random (prefill or decode): SIGKILL, or (a `--stop-share` of the time)
SIGSTOP for `--stop-seconds` then SIGCONT. Every request's prompt comes from a fixed set whose
greedy answers were computed offline first (`tandem.LLM`, same checkpoint), so a completed stream is
checked token for token, across any migration. Reports requests completed / failed with an error /
hung (no answer within the client timeout) / wrong, faults, restarts seen in tandem up's log, router
migrations and retries, the KV invariant on every surviving worker at the end, `/dev/shm` segments
left after shutdown, and the latency of completed requests. Loopback only; loops are bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [f"# {i}\ndef {name}(path):\n    \"\"\"" for i, name in
           enumerate(["load", "save", "parse", "render", "check", "merge", "split", "walk"])]
MAX_TOKENS = 48


def expected_answers(model: str) -> dict[str, str]:
    from tandem import LLM, SamplingParams

    llm = LLM(model)  # with the checkpoint's generation_config defaults, as the server applies them
    outs = llm.generate(PROMPTS, SamplingParams(**{**llm.sampling_defaults, "temperature": 0,
                                                   "max_tokens": MAX_TOKENS, "ignore_eos": True}))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


def stream(http: str, prompt: str) -> tuple[str, str | None]:
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text = ""
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return text, event["error"]["message"]
                    text += "".join(c["text"] for c in event["choices"])
    except Exception as exc:  # refused while nothing serves, 503, reset: all count as failed
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            return text, "HUNG: no answer within the client timeout"
        return text, f"{type(exc).__name__}: {exc}"
    return text, None


def worker_pids(up_pid: int) -> dict[int, str]:
    """The tandem up children that are workers: pid -> role."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(up_pid)], capture_output=True, text=True).stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for role in ("prefill", "decode"):
            if f"tandem.cli.up {role} " in cmd:
                out[int(pid)] = role
    return out


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def kv_invariant(http: str) -> dict[str, bool]:
    """Each live worker's `kv_invariant_ok`, as its last heartbeat reported it to the router."""
    try:
        with urllib.request.urlopen(f"{http}/health", timeout=10) as r:
            health = json.loads(r.read())
    except OSError as exc:  # a 503 still carries the body
        health = json.loads(getattr(exc, "read", lambda: b"{}")() or b"{}")
    return {w["worker_id"]: bool(w["stats"].get("kv_invariant_ok")) for w in health.get("workers", [])
            if w.get("alive")}


def metric(http: str, name: str) -> float:
    try:
        with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)", text, re.MULTILINE))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "tandem" / "assets" / "tiny-target"))
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--kill-every", type=float, default=30)
    ap.add_argument("--stop-share", type=float, default=0.3, help="fraction of faults that SIGSTOP instead of kill")
    ap.add_argument("--stop-seconds", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                    help="extra `tandem up` argument (repeat), e.g. --up-arg=--link-secret-file --up-arg=FILE")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    expected = expected_answers(a.model)
    log = tempfile.NamedTemporaryFile("w+", prefix="chaos-up-", suffix=".log", delete=False)
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--model", a.model, "--prefill", str(a.prefill),
                           "--decode", str(a.decode), "--http-port", "0", "--grpc-port", "0", "--quiet",
                           *a.up_arg],
                          stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    results: list[tuple[float, str, str | None, str]] = []  # (seconds, prompt, error, text)
    lock, stop = threading.Lock(), threading.Event()
    kills: list[tuple[float, str]] = []
    invariant: dict[str, bool] = {}
    migrations = retries = float("nan")
    try:
        ready = next(json.loads(line.split(" ", 1)[1]) for line in up.stdout if line.startswith("tandem-up-ready "))
        http, t_start = ready["http"], time.monotonic()

        def client(i: int) -> None:
            crng = random.Random(a.seed * 1000 + i)
            while not stop.is_set():
                prompt, t0 = crng.choice(PROMPTS), time.monotonic()
                text, error = stream(http, prompt)
                with lock:
                    results.append((time.monotonic() - t0, prompt, error, text))
                if error:
                    time.sleep(0.2)  # back off while nothing serves

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        while time.monotonic() - t_start < a.seconds and up.poll() is None:
            time.sleep(a.kill_every)
            pids = worker_pids(up.pid)
            if pids:
                pid = rng.choice(sorted(pids))
                fault = "sigstop" if rng.random() < a.stop_share else "sigkill"
                kills.append((round(time.monotonic() - t_start, 1), f"{fault} {pids[pid]}"))
                if fault == "sigkill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(a.stop_seconds, _cont, args=(pid,)).start()
        stop.set()
        for t in threads:
            t.join(90)
        time.sleep(2)  # the survivors' next heartbeats carry their final stats
        invariant = kv_invariant(http)
        migrations = metric(http, "tandem_router_migrations_total")
        retries = metric(http, "tandem_router_retries_total")
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
    shm_left = len([f for f in os.listdir("/dev/shm") if f.startswith("tandem-kv-")]) if os.path.isdir(
        "/dev/shm") else 0
    log.seek(0)
    restarts = len(re.findall(r"restarting (?:prefill|decode)-\d+ in", log.read()))
    done = [r for r in results if r[2] is None]
    wrong = [r for r in done if r[3] != expected[r[1]]]
    lat = sorted(r[0] for r in done)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "prefill": a.prefill, "decode": a.decode,
              "clients": a.clients, "seconds": a.seconds, "kills": kills, "restarts_seen": restarts,
              "requests": len(results), "completed": len(done), "failed": len(results) - len(done),
              "hung": sum(1 for r in results if r[2] and r[2].startswith("HUNG")), "wrong": len(wrong),
              "completed_share": round(len(done) / max(1, len(results)), 4),
              "migrations": migrations, "retries": retries, "kv_invariant_ok_on_survivors": invariant,
              "shm_segments_left": shm_left,
              "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
              "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
              "errors": sorted({r[2] for r in results if r[2]})[:10], "tandem_up_exit": up.returncode}
    print(json.dumps(report, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    os.unlink(log.name)
    ok = not wrong and up.returncode == 0 and all(invariant.values()) and shm_left == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
