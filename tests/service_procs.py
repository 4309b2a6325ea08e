"""Helpers for tests that run tandem services as real processes on loopback: start/stop a process
with its output in a log file, wait for a line, small HTTP (SSE too) / ZMQ / gRPC client calls, and a
prefill or decode worker driven directly, with a router stand-in (Client)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import msgpack
import zmq

from tandem.protocol import messages
from tandem.protocol.codec import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[1]
# PYTHONPATH: the services run from the source tree even where the editable install predates them.
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


# A `sitecustomize` for one worker process: wraps LLMEngine.step so that step N sleeps (stall
# "N:SECONDS") and/or every step with work sleeps (delay "SECONDS") — tandem itself has no test hook.
# With a release file, the stalled step also waits until that file exists: a test then decides when
# the stall ends instead of racing a fixed sleep against another process's start-up.
_STEP_HOOK = """
import os
_stall, _delay = os.environ.get("TANDEM_TEST_STALL"), float(os.environ.get("TANDEM_TEST_STEP_DELAY") or 0)
_release = os.environ.get("TANDEM_TEST_STALL_RELEASE")
if _stall or _delay:
    import time
    from tandem.engine.llm_engine import LLMEngine
    _n, _seconds = (int(_stall.split(":")[0]), float(_stall.split(":")[1])) if _stall else (0, 0.0)
    _step, _count = LLMEngine.step, [0]
    def step(self):
        if self.scheduler.running or self.scheduler.waiting:
            _count[0] += 1
            if _count[0] == _n:
                time.sleep(_seconds)
                while _release and not os.path.exists(_release):
                    time.sleep(0.05)
            time.sleep(_delay)
        return _step(self)
    LLMEngine.step = step
"""


def step_hook_env(hook_dir: Path, stall: str | None = None, delay: float | None = None,
                  release: Path | None = None) -> dict[str, str]:
    """Environment for a worker whose engine steps are slowed (see _STEP_HOOK)."""
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(_STEP_HOOK)
    env = {"PYTHONPATH": f"{hook_dir}{os.pathsep}{ROOT}"}
    if stall:
        env["TANDEM_TEST_STALL"] = stall
    if delay:
        env["TANDEM_TEST_STEP_DELAY"] = str(delay)
    if release:
        env["TANDEM_TEST_STALL_RELEASE"] = str(release)
    return env


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str | None] | None = None) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        # `env` adds to ENV; a None value removes the variable
        merged = {k: v for k, v in {**ENV, **(env or {})}.items() if v is not None}
        self.popen = subprocess.Popen(args, cwd=ROOT, env=merged, stdout=self.log.open("w"),
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log.read_text())
            if m:
                return m
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no {pattern!r} in its output:\n{self.log.read_text()[-3000:]}")

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10) -> None:
        self.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def stop_all(procs: list[Proc]) -> None:
    for p in procs:  # signal them all first: they shut down in parallel
        p.terminate()
    for p in procs:
        p.stop()


def start_router(name: str, ckpt: str, log_dir: Path, *flags: str) -> Proc:
    return Proc(name, [sys.executable, "-m", "tandem.cli", "router", "--model", ckpt, "--host", "127.0.0.1",
                       "--http-port", "0", "--grpc-port", "0", "--listen", "tcp://127.0.0.1:0", *flags], log_dir)


def router_endpoints(proc: Proc) -> dict[str, str]:
    return {k: proc.wait_for(rf"{k}\s+(\S+)").group(1) for k in ("http", "grpc", "listen")}


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def wait_workers(http: str, decode: int, prefill: int = 0, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, health = get_json(f"{http}/health")
        if health["live_workers"] == {"decode": decode, "prefill": prefill}:
            return health
        time.sleep(0.1)
    raise AssertionError(f"router never saw {decode} decode + {prefill} prefill workers: {health}")


def worker_stats(address: str) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(msgpack.packb({"type": "stats", "v": PROTOCOL_VERSION}))
        assert sock.poll(5000), f"no stats_reply from {address}"
        return msgpack.unpackb(sock.recv())["stats"]
    finally:
        sock.close()


def grpc_stub(target: str):
    from tandem.protocol import generation_pb2_grpc

    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(target))


def stream_completion_text(http: str, prompt: str, max_tokens: int, on_chunk=None,
                           **sampling) -> tuple[str, str | None]:
    """Stream one completion (greedy unless `sampling` says otherwise; ignore_eos) over SSE: (text,
    error message or None). `on_chunk(n)` is called after the n-th text chunk arrived (n from 1)."""
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **sampling}
    req = urllib.request.Request(f"{http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text, error, chunks = "", None, 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            text += "".join(c["text"] for c in event["choices"])
            chunks += 1
            if on_chunk is not None:
                on_chunk(chunks)
    return text, error


def start_colocated_decode(name: str, router: str, log_dir: Path, stall: str | None = None,
                           delay: float | None = None, release: Path | None = None) -> Proc:
    """A decode worker on the shipped model that prefills its own prompts and registers to `router`;
    its engine steps optionally slowed (see step_hook_env)."""
    from tandem.default_model import ASSETS_DIR, TARGET_NAME

    env = (step_hook_env(log_dir / f"hook-{name}", stall=stall, delay=delay, release=release)
           if stall or delay else None)
    return Proc(name, [sys.executable, "-m", "tandem.cli", "decode", "--model", str(ASSETS_DIR / TARGET_NAME),
                       "--kv-connector", "none", "--listen", "tcp://127.0.0.1:0", "--router", router,
                       "--worker-id", name, "--num-kv-blocks", "256"], log_dir, env)


def metric_value(http: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` on a /metrics page: all label sets, or those with `labels`."""
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        lines = [line for line in r.read().decode().splitlines() if re.match(rf"{name}(\{{.*\}})? ", line)]
    lines = [line for line in lines if all(f'{k}="{v}"' in line for k, v in labels.items())]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def start_serving(ckpt: str, log_dir: Path, *router_flags: str, disaggregated: bool = True,
                  num_kv_blocks: int = 256,
                  prefill_step_delay: float | None = None) -> tuple[list[Proc], dict[str, str]]:
    """A router on `ckpt` and its workers: a prefill + decode pair that prefills every prompt remotely
    (so the first token is sampled on the prefill worker; each of its steps slowed by
    `prefill_step_delay` seconds if given), or one decode worker that prefills its own.
    Waits until they registered; returns (processes, the router's endpoints). stop_all(processes)."""
    procs = [start_router("router", ckpt, log_dir, *router_flags)]
    try:
        ep = router_endpoints(procs[0])
        worker = [sys.executable, "-m", "tandem.cli", "--model", ckpt, "--listen", "tcp://127.0.0.1:0",
                  "--router", ep["listen"], "--num-kv-blocks", str(num_kv_blocks)]
        if disaggregated:
            slow = step_hook_env(log_dir / "hook-prefill", delay=prefill_step_delay) if prefill_step_delay else None
            procs.append(Proc("prefill", [*worker[:3], "prefill", *worker[3:]], log_dir, slow))
            procs.append(Proc("decode", [*worker[:3], "decode", *worker[3:], "--local-prefill-threshold", "0"],
                              log_dir))
        else:
            procs.append(Proc("decode", [*worker[:3], "decode", *worker[3:], "--kv-connector", "none"], log_dir))
        wait_workers(ep["http"], decode=1, prefill=1 if disaggregated else 0)
    except BaseException:
        stop_all(procs)
        raise
    return procs, ep


def sse(http: str, path: str, body: dict) -> list[dict]:
    """POST a streaming request; every SSE event's JSON, [DONE] left out."""
    req = urllib.request.Request(f"{http}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# ---- a worker driven directly (no router): tests/test_disagg.py and others --------------------------
ENGINE = ["--num-kv-blocks", "512", "--max-model-len", "1024", "--dtype", "float32"]  # fp32 on a GPU too
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def start_worker(role, ckpt, log_dir, *flags, name=None):
    """A prefill or decode worker process on loopback, and its ready line's JSON."""
    proc = Proc(name or role, [sys.executable, "-m", "tandem.cli", role, "--model", ckpt,
                               "--listen", "tcp://127.0.0.1:0", *ENGINE, *flags], log_dir)
    return proc, json.loads(proc.wait_for(rf"tandem-{role}-ready (\{{.*\}})").group(1))


class Client:
    """A router stand-in: one DEALER socket to a decode worker."""

    def __init__(self, address):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.tokens, self.finished = {}, {}

    def add(self, rid, token_ids, peer, sampling=GREEDY):
        self.sock.send(messages.encode("add_request", id=rid, token_ids=token_ids, sampling=sampling,
                                       prefill_peer=peer))

    def collect(self, ids, timeout=120):
        deadline = time.monotonic() + timeout
        while not set(ids) <= set(self.finished) and time.monotonic() < deadline:
            if self.sock.poll(200):
                msg = messages.decode(self.sock.recv())
                assert msg["type"] == "output", msg
                self.tokens.setdefault(msg["id"], []).extend(msg["token_ids"])
                if msg["finished"]:
                    self.finished[msg["id"]] = msg
        missing = set(ids) - set(self.finished)
        assert not missing, f"requests never finished: {sorted(missing)}"
        return {i: self.tokens.get(i, []) for i in ids}

    def request(self, msg_type, **fields):
        self.sock.send(messages.encode(msg_type, **fields))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.sock.poll(200):
                msg = messages.decode(self.sock.recv())
                if msg["type"] == f"{msg_type}_reply":
                    return msg
        raise AssertionError(f"no {msg_type}_reply")
